"""Greedy parity with llama.cpp on the same GGUF file: ``python bench/builds/llama_cpp_parity.py FILE.gguf ... [--json OUT]``.

For each file: the fleet's build of it (``fleet-compiler build FILE --shards 1``, its blocks kept; run in this
process at f32 inference, f32 KV cache, no dynamic activation quantization: compiler/quality.py ``StageChain``, the
worker's runtime without the network) and llama.cpp's ``llama-server`` of the same file (``bench/build_llama_cpp.sh``;
one slot, one thread, f32 KV cache, flash attention off, prompt caching off) each continue the same token-id prompts
greedily (``/completion``: temperature 0, ``ignore_eos``; BOS written by us, nothing added by either side).

llama.cpp runs each file twice:

* ``f32 copy``: the file's values dequantized to F32 by gguf-py (``dequantized_copy``), which ggml's CPU kernels
  multiply in f32: the same arithmetic as the fleet's (its kept blocks at f32), so this checks that both read the
  file's architecture alike (metadata, Q/K permutation, norms, RoPE variants, sliding windows, sinks, experts).
* ``as is``: the file itself, what llama.cpp serves. Its CPU kernels round the activations to 8-bit blocks
  (Q8_0/Q8_1, ``vec_dot_type``) before every quantized matmul, so its logits move by a few 1e-2, near-ties flip, and
  in a MoE a flipped expert moves them by up to ~2: llama.cpp's own noise, reported beside the exact run.

Per prompt:

* ``tokens_equal``: the two free-running continuations, id for id; ``first_divergence`` else.
* Log-probabilities: llama.cpp's ``n_probs`` top candidates at every step come from a softmax over all its logits
  before sampling (tools/server ``populate_token_probs``); the fleet's log-softmax at the same steps (fed llama.cpp's
  tokens, teacher-forced) is compared on those candidates. Both are logits minus a per-step constant, so
  ``max_logprob_diff`` is the largest disagreement of the two models' logits up to that shift. llama-server drops the
  probabilities of a token that ends inside a UTF-8 character (``Steps``): such steps are compared on tokens only.
* ``flips``: steps where the two sides rank a different token first (teacher-forced), each with the margin between
  the two tokens on either side; ``agreement`` is the share of steps without one.

The verdict of a ``f32 copy`` run: ``equal`` (every prompt's tokens equal), ``tie`` (flips only where both margins
are within ``TIE``) or ``mismatch`` (the exit status is 1 then); of an ``as is`` run ``equal`` or ``differs``.
Measured on the tiny files of tests/integration/test_llama_cpp_parity.py: the f32 copies within 1.2e-5 (gemma3
1.5e-3: ggml's GELU reads its input rounded to fp16, a table), every token equal.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
import numpy as np

from bench import harness, real_gguf
from compiler.gguf_read import read_gguf_file
from coordinator.fleet.local import free_port

N_PROBS = 8  # llama.cpp candidates per step compared
EXACT, AS_IS = "f32 copy", "as is"  # what llama.cpp runs: the file's values dequantized to F32, or the file
TIE = 5e-3  # logprob margin under which a flip is a near-tie, llama.cpp computing in f32 (its GELU reads fp16)
TIE_AS_IS = 0.1  # the same, llama.cpp rounding activations to 8-bit blocks
SERVER_FLAGS = ("-np", "1", "-t", "1", "-tb", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--cache-ram", "0",
                "--fit", "off", "--no-webui")


def default_prompts(count: int = 3, vocab: int = 2048, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of BOS (1) and random ids in [3, ``vocab``): 8, 20 and 40 tokens long (cycled), so a
    window of 8 or 16 is crossed before decoding starts."""
    rng = np.random.default_rng(seed)
    lengths = (8, 20, 40)
    return [[1, *map(int, rng.integers(3, vocab, lengths[i % 3] - 1))] for i in range(count)]


@dataclass
class Steps:
    """llama.cpp's greedy continuation: its tokens and, per step, its top candidates {id: logprob} (None where
    llama-server gave none: a token that ends inside a UTF-8 character is sent with the next one, its probabilities
    dropped, tools/server ``process_token``)."""

    tokens: list[int]
    top: list[dict[int, float] | None] = field(default_factory=list)


def start_llama_server(gguf: Path, context: int, logs: Path, stack: ExitStack,
                       bin_dir: Path = harness.LLAMA_CPP_BIN) -> str:
    """llama-server of ``gguf`` (``SERVER_FLAGS``, ``-c context``: 0 the model's own) stopped when ``stack`` closes; its URL once it
    serves. Raises ``FileNotFoundError`` naming the build script when llama-server is not built."""
    server = bin_dir / "llama-server"
    if not server.is_file():
        raise FileNotFoundError(f"no {server}: run bench/build_llama_cpp.sh (5-12 minutes on 2 cores)")
    port = free_port()
    cmd = [str(server), "-m", str(gguf.resolve()), "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
           *SERVER_FLAGS]
    proc = harness.spawn(cmd, logs / f"llama-server-{gguf.stem}.log", stack)
    url = f"http://127.0.0.1:{port}"
    harness.wait_ready(url, 120.0, proc)
    return url


def llama_greedy(url: str, prompt: list[int], tokens: int, n_probs: int = N_PROBS) -> Steps:
    """llama-server's greedy continuation of token ids ``prompt``, ``tokens`` long, with its top ``n_probs``
    pre-sampling log-probabilities per step. Raises ``RuntimeError`` on an error answer or a short one."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "n_probs": n_probs,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "post_sampling_probs": False}
    r = httpx.post(f"{url}/completion", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:500]}")
    answer = r.json()
    out = Steps([int(t) for t in answer["tokens"]])
    if len(out.tokens) != tokens:
        raise RuntimeError(f"llama-server gave {len(out.tokens)} tokens, not {tokens}")
    step = 0
    for entry in answer["completion_probabilities"]:  # a subsequence of the steps: each at its token's next step
        while out.tokens[step] != entry["id"]:
            out.top.append(None)
            step += 1
        out.top.append({int(c["id"]): float(c["logprob"]) for c in entry["top_logprobs"]})
        step += 1
    out.top += [None] * (tokens - step)
    return out


class FleetModel:
    """A fleet build's stages chained in this process at f32 (compiler/quality.py ``StageChain``), fleet's kernels
    at ``kernels`` precision: "f32" (exact products) or "int8" (activations rounded to 8-bit blocks, as llama.cpp's
    CPU kernels round them: per 32, per 256 for the 256-weight types)."""

    def __init__(self, build: Path, threads: int = 1, kernels: str = "f32") -> None:
        from compiler.quality import StageChain
        from fleet_common.manifest import load_manifest

        loaded = load_manifest(build)
        self.chain = StageChain(loaded, threads=threads, kernels=kernels)
        self.max_context = loaded.manifest.architecture.max_context

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        """The greedy continuation of ``prompt`` (never stopping at end-of-sequence)."""
        from compiler.quality import greedy

        return greedy(self.chain, prompt, tokens, set())

    def logprobs(self, prompt: list[int], answer: list[int]) -> np.ndarray:
        """Log-softmax [len(answer), V] of each step of ``answer`` after ``prompt`` (teacher-forced)."""
        return self.chain.score(prompt + answer[:-1], len(prompt) - 1)


def compare(prompt: list[int], llama: Steps, ours: list[int], logp: np.ndarray, tie: float) -> dict:
    """One prompt's comparison (module docstring): ``llama`` llama.cpp's steps, ``ours`` the fleet's free-running
    tokens, ``logp`` the fleet's log-softmax fed llama.cpp's tokens; a flip is a near-tie within ``tie``."""
    diffs, flips = [], []
    for step, top in enumerate(llama.top):
        if top:
            diffs.append(max(abs(float(logp[step, t]) - lp) for t, lp in top.items()))
        theirs, mine = llama.tokens[step], int(logp[step].argmax())
        if mine != theirs:
            flips.append({"step": step, "llama_cpp": theirs, "fleet": mine,
                          "fleet_margin": float(logp[step, mine] - logp[step, theirs]),
                          "llama_cpp_margin": top[theirs] - top[mine] if top and mine in top else math.inf})
    first = next((i for i, (a, b) in enumerate(zip(ours, llama.tokens)) if a != b), None)
    return {"prompt_tokens": len(prompt), "tokens_equal": ours == llama.tokens, "first_divergence": first,
            "max_logprob_diff": max(diffs), "step_logprob_diffs": diffs, "flips": flips,
            "near_ties_only": all(max(f["fleet_margin"], f["llama_cpp_margin"]) <= tie for f in flips),
            "llama_cpp_tokens": llama.tokens, "fleet_tokens": ours}


@dataclass
class FileResult:
    """One GGUF file against one llama.cpp input: per prompt (``compare``) and overall. ``llama_cpp_input``:
    ``f32 copy`` (the file's values dequantized, ``dequantized_copy``: llama.cpp computes in f32) or ``as is``
    (the file itself: llama.cpp rounds activations to 8-bit blocks). ``verdict``: ``equal``, ``tie`` (flips only
    at near-ties) or ``mismatch``; ``as is`` runs are ``equal`` or ``differs`` (their noise is llama.cpp's)."""

    name: str
    llama_cpp_input: str
    verdict: str
    max_logprob_diff: float
    median_logprob_diff: float
    agreement: float  # teacher-forced steps where the fleet ranks llama.cpp's token first
    prompts: list[dict]


def result(name: str, llama_input: str, rows: list[dict]) -> FileResult:
    """The :class:`FileResult` of ``rows`` (``compare``'s, one per prompt)."""
    steps = sum(len(r["llama_cpp_tokens"]) for r in rows)
    equal = all(r["tokens_equal"] and not r["flips"] for r in rows)
    if llama_input == EXACT:
        verdict = "equal" if equal else "tie" if all(r["near_ties_only"] for r in rows) else "mismatch"
    else:
        verdict = "equal" if equal else "differs"
    diffs = [d for r in rows for d in r["step_logprob_diffs"]]
    return FileResult(name, llama_input, verdict, max(diffs), float(np.median(diffs)),
                      1 - sum(len(r["flips"]) for r in rows) / steps, rows)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantized to F32 by gguf-py (metadata copied as gguf-py's
    ``gguf_new_metadata`` copies it): the same values, which llama.cpp's CPU kernels then multiply in f32 instead of
    rounding the activations to 8-bit blocks. Returns ``dst``."""
    import gguf

    reader = read_gguf_file(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for fld in reader.fields.values():
        if fld.name == "general.architecture" or fld.name.startswith("GGUF."):
            continue
        kind = fld.types[0]
        writer.add_key_value(fld.name, fld.contents(), kind,
                             sub_type=fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        writer.add_tensor(t.name, np.asarray(values, np.float32).reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def run_llama_cpp(name: str, llama_gguf: Path, llama_input: str, model: FleetModel, prompts: list[list[int]],
                  tokens: int, logs: Path, bin_dir: Path = harness.LLAMA_CPP_BIN) -> FileResult:
    """llama-server of ``llama_gguf`` against the fleet ``model`` on ``prompts`` (``tokens`` new tokens each)."""
    if max(len(p) for p in prompts) + tokens > model.max_context:
        raise ValueError(f"{name}: prompts of {max(len(p) for p in prompts)} + {tokens} tokens exceed the build's "
                         f"context {model.max_context}")
    tie = TIE if llama_input == EXACT else TIE_AS_IS
    with ExitStack() as stack:  # llama-server's default context (-c 0): the model's own, LongRoPE's long factors
        url = start_llama_server(llama_gguf, 0, logs, stack, bin_dir)
        rows = []
        for prompt in prompts:
            llama = llama_greedy(url, prompt, tokens)
            rows.append(compare(prompt, llama, model.greedy(prompt, tokens), model.logprobs(prompt, llama.tokens),
                                tie))
    return result(name, llama_input, rows)


def run_file(gguf: Path, build: Path, prompts: list[list[int]], tokens: int, work: Path,
             bin_dir: Path = harness.LLAMA_CPP_BIN) -> tuple[FileResult, FileResult]:
    """The fleet build ``build`` of ``gguf`` against llama.cpp on its f32 copy (written in ``work``), fleet's
    kernels exact, and on the file as is, fleet's kernels rounding activations as llama.cpp's do: (exact, as is)."""
    copy = dequantized_copy(gguf, work / f"{gguf.stem}-f32.gguf")
    exact = run_llama_cpp(gguf.stem, copy, EXACT, FleetModel(build, kernels="f32"), prompts, tokens, work, bin_dir)
    return exact, run_as_is(gguf, build, prompts, tokens, work, bin_dir)


def run_as_is(gguf: Path, build: Path, prompts: list[list[int]], tokens: int, work: Path,
              bin_dir: Path = harness.LLAMA_CPP_BIN) -> FileResult:
    """llama.cpp on the file as is against the fleet build with its kernels at int8 (both sides round the
    activations to 8-bit blocks before each product)."""
    return run_llama_cpp(gguf.stem, gguf, AS_IS, FleetModel(build, kernels="int8"), prompts, tokens, work, bin_dir)


def demo_of_type(qtype: str, cache: Path) -> Path:
    """The demo's GGUF (SmolLM2-135M, Q4_1 in its wheel) re-quantized by ``llama-quantize`` to ``qtype`` (one of
    real_gguf's ``TYPES``: llama.cpp's own mixture), made once into ``cache``."""
    from bench.real_gguf import demo_gguf, llama_quantize

    out = cache / f"demo.{qtype}.gguf"
    if not out.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        llama_quantize(demo_gguf(), out, qtype, requantize=True)
    return out


def build_gguf(gguf: Path, out: Path, shards: int = 1) -> Path:
    """``fleet-compiler build GGUF --shards N -o OUT`` (blocks kept); ``out``. Raises ``RuntimeError`` with the
    compiler's stderr if it fails."""
    cmd = [*harness.tool("fleet-compiler"), "build", str(gguf.resolve()), "--shards", str(shards), "-o",
           str(out.resolve())]
    result = subprocess.run(cmd, capture_output=True, text=True, env=harness.repo_env())
    if result.returncode != 0:
        raise RuntimeError(f"building {gguf} failed:\n{result.stderr[-3000:]}")
    return out


def report_table(results: list[FileResult]) -> str:
    """The results as a markdown table, a row per file and llama.cpp input."""
    rows = []
    for res in results:
        equal = sum(r["tokens_equal"] for r in res.prompts)
        firsts = ",".join("-" if r["first_divergence"] is None else str(r["first_divergence"]) for r in res.prompts)
        flips = [f for r in res.prompts for f in r["flips"]]
        margin = max((max(f["fleet_margin"], f["llama_cpp_margin"]) for f in flips), default=None)
        rows.append([res.name, res.llama_cpp_input, res.verdict, f"{equal}/{len(res.prompts)}", firsts,
                     f"{res.agreement:.0%}", f"{res.median_logprob_diff:.2g}", f"{res.max_logprob_diff:.2g}",
                     "-" if margin is None else f"{margin:.2g}"])
    return harness.table(["file", "llama.cpp ran", "verdict", "tokens equal", "first divergence", "forced agreement",
                          "median |dlogp|", "max |dlogp|", "widest flip margin"], rows, pad=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: compare each GGUF given (or the demo re-quantized to each of ``--types``); exit 1 if one is a
    ``mismatch`` (llama.cpp computing in f32)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="*", type=Path, help="GGUF files (each built into a temporary folder)")
    parser.add_argument("--types", default="", help="comma-separated llama-quantize types (Q4_0, Q4_K_M, ...): the "
                        "demo re-quantized to each, compared as is only")
    parser.add_argument("--shards", type=int, default=1, help="stages of each build (chained in this process)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="random token-id prompts (8, 20, 40 tokens)")
    parser.add_argument("--vocab", type=int, default=2048, help="prompt ids are drawn below this")
    parser.add_argument("--llama-cpp-bin", type=Path, default=harness.LLAMA_CPP_BIN)
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    if not args.gguf and not types:
        parser.error("give GGUF files or --types")
    prompts = default_prompts(args.prompts, args.vocab)
    results = []
    with tempfile.TemporaryDirectory(prefix="llama-cpp-parity-") as tmp:
        work = Path(tmp)
        for gguf in args.gguf:
            build = build_gguf(gguf, work / gguf.stem, args.shards)
            results += run_file(gguf, build, prompts, args.tokens, work, args.llama_cpp_bin)
        for qtype in types:
            gguf = demo_of_type(qtype, real_gguf.CACHE / "parity")
            build = build_gguf(gguf, work / gguf.stem, args.shards)
            results.append(run_as_is(gguf, build, prompts, args.tokens, work, args.llama_cpp_bin))
    print(report_table(results))
    if args.json:
        harness.write_json(args.json, "llama_cpp_parity", {"tokens": args.tokens, "prompts": prompts,
                                                          "shards": args.shards, "files": [asdict(r) for r in results]})
    return int(any(r.verdict == "mismatch" for r in results))


if __name__ == "__main__":
    sys.exit(main())
