"""Single-user decode speed of the demo model: fleet (1, 2, 3 stages) vs the whole model, side by side.

All rows come from ONE run (same chat prompts, greedy, ``ignore_eos``, same token count, default
precision and OpenVINO's default thread count everywhere), so their ratios are comparable:

* ``whole-model``: the 1-stage build's ``stage_0`` IR in this process, a numpy greedy loop fed as a
  worker feeds it. The reference row.
* ``fleet N-stage``: ``python -m coordinator.cli serve --local-workers N`` (a ``fleet-worker`` process
  per stage, gRPC on loopback), streamed chat completions; decode tok/s = (completion_tokens - 1) /
  (first streamed token -> last), timed by the client.
* ``GenAI``: ``openvino_genai.LLMPipeline`` on the same weights (exported without ``logits_index``
  into an optimum-style folder); decode tok/s and TTFT from its perf metrics.

Configs are set up and warmed up first, then prompts run round-robin across configs so that load
from other processes hits all rows alike; a cell is the median over prompts. The JSON holds every
run, the load average per round and machine facts.

    python bench/decode_bench.py [--json PATH] [--tokens 128] [--prompts 3] [--quick] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain script: make the repo's packages importable

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402

from coordinator.local import free_port  # noqa: E402
from coordinator.tokenizer import ChatTokenizer  # noqa: E402

PROMPTS = (
    "Explain how a rainbow forms, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a packing list for a weekend hiking trip in the mountains.",
)
SHARD_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}  # as worker/runner.py compiles shards
SETTLE_S = 0.3  # pause before each timed run: the last one's session close and spinning threads settle
GENAI_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")


@dataclass
class Run:
    """One timed generation."""

    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # request start -> first token
    decode_tok_s: float  # (completion_tokens - 1) / seconds after the first token
    text: str = ""  # the completion: same prompt, greedy, so rows agree unless they round differently
    extra: dict = field(default_factory=dict)  # per-config details (e.g. the coordinator's own numbers)


Runner = Callable[[int], Run]  # prompt index -> one timed generation


@dataclass
class Cell:
    """One table row: a configuration, its settings and runs, or the error that stopped it."""

    config: str
    stages: int
    settings: dict = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    error: str | None = None

    @property
    def decode_tok_s(self) -> float | None:
        return statistics.median(r.decode_tok_s for r in self.runs) if self.runs and not self.error else None

    @property
    def ttft_ms(self) -> float | None:
        return statistics.median(r.ttft_ms for r in self.runs) if self.runs and not self.error else None


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------- inputs, cached between runs

def ensure_build(hf: Path, cache: Path, shards: int, layers: str | None = None) -> Path:
    """The demo built into ``cache`` (default split, or explicit ``layers``), built once per exporter
    version (a hash of the compiler's export, build and plan code is part of the folder name)."""
    import hashlib

    key = hashlib.sha256(b"".join(p.read_bytes() for p in sorted((ROOT / "compiler").glob("*.py"))))
    name = f"smollm2-{shards}stage" + (f"-{layers.replace(':', '_').replace(',', '-')}" if layers else "")
    out = cache / f"{name}-{key.hexdigest()[:8]}"
    if not (out / "manifest.json").is_file():
        from compiler.build import build

        print(f"building {shards}-stage model into {out} ...", flush=True)
        build(hf, out, shards=shards, layers=layers)
    return out


def ensure_genai_folder(hf: Path, cache: Path) -> Path:
    """Optimum-style folder for ``LLMPipeline``: whole model with [B, S, V] logits + OV tokenizers."""
    out = cache / "genai"
    if all((out / name).is_file() for name in GENAI_FILES):
        return out
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    from compiler.build import save_whole_model

    print(f"exporting the GenAI folder into {out} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(hf / name, out / name)
    save_whole_model(hf, out / "openvino_model.xml", logits_index_input=False)
    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(hf), with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")  # written last: GENAI_FILES marks completion
    return out


# ---------------------------------------------------------------- fleet over HTTP

def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the coordinator's process group (it and its workers); SIGKILL whatever outlives the grace."""
    pgid = proc.pid  # start_new_session=True: the coordinator leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader so the group can empty
            os.killpg(pgid, 0)  # raises ProcessLookupError once no process of the group is left
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited ({proc.returncode}); log tail:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s:.0f} s; see {log}")


def stream_chat(client: httpx.Client, url: str, prompt: str, tokens: int) -> Run:
    """One streamed greedy chat completion, timed on the client."""
    body = {"messages": messages(prompt), "temperature": 0, "ignore_eos": True, "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = None
    final: dict = {}
    text = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if "usage" in event:
                final = event
            elif event["choices"][0]["finish_reason"] is not None:
                end = time.perf_counter()
            elif content := event["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(content)
    n = final.get("usage", {}).get("completion_tokens", 0)
    if first is None or end is None or n < 2:
        raise RuntimeError(f"stream ended early ({n} tokens)")
    return Run(final["usage"]["prompt_tokens"], n, (first - start) * 1000, (n - 1) / (end - first), "".join(text),
               extra={"coordinator": final.get("fleet", {})})


def fleet_runner(stack: ExitStack, build: Path, stages: int, prompts: list[str], tokens: int,
                 logs: Path) -> tuple[dict, Runner]:
    """Start a coordinator with ``stages`` local workers; it is stopped when ``stack`` closes."""
    port = free_port()
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(build), "--local-workers", str(stages),
           "--port", str(port), "--no-announce", "--no-discover", "--log-level", "WARNING"]
    log = logs / f"fleet-{stages}stage.log"
    fh = stack.enter_context(open(log, "w"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    stack.callback(stop_group, proc)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log)
    client = stack.enter_context(httpx.Client())
    settings = {"command": " ".join(cmd[1:]), "workers": f"{stages} processes, gRPC on loopback",
                "threads": "OpenVINO default", "log": str(log)}
    return settings, lambda i: stream_chat(client, url, prompts[i], tokens)


# ---------------------------------------------------------------- in-process baselines

def greedy_whole(request: ov.InferRequest, prompt_ids: list[int], tokens: int, tokenizer: ChatTokenizer) -> Run:
    """Greedy decode through the 1-stage shard: prefill, then one token per infer."""
    request.reset_state()
    chunk, past = prompt_ids, 0
    output: list[int] = []
    start = first = time.perf_counter()
    while len(output) < tokens:
        seq = len(chunk)
        logits = request.infer({
            "input_ids": np.array([chunk], dtype=np.int64),  # [1, S]
            "attention_mask": np.ones((1, past + seq), dtype=np.int64),  # [1, P+S]
            "position_ids": np.arange(past, past + seq, dtype=np.int64)[None, :],  # [1, S]
            "beam_idx": np.zeros(1, dtype=np.int32),  # [1]
            "logits_index": np.array([seq - 1], dtype=np.int64),  # [1]
        })[0]  # [1, 1, V]
        output.append(int(logits[0, -1].argmax()))
        if past == 0:
            first = time.perf_counter()
        chunk, past = output[-1:], past + seq
    end = time.perf_counter()
    return Run(len(prompt_ids), len(output), (first - start) * 1000, (len(output) - 1) / (end - first),
               tokenizer.decode(output))


def whole_runner(build: Path, prompt_ids: list[list[int]], tokens: int) -> tuple[dict, Runner]:
    tokenizer = ChatTokenizer(build)
    xml = build / "stage_0" / "openvino_model.xml"
    request = ov.Core().compile_model(str(xml), "CPU", SHARD_CONFIG).create_infer_request()
    settings = {"model": str(xml), "properties": SHARD_CONFIG, "threads": "OpenVINO default"}
    return settings, lambda i: greedy_whole(request, prompt_ids[i], tokens, tokenizer)


def genai_runner(folder: Path, texts: list[str], prompt_ids: list[list[int]], tokens: int) -> tuple[dict, Runner]:
    import openvino_genai

    # GenAI's default CPU backend (PagedAttention) rewrites the graph with SDPAToPagedAttention, which
    # leaves our input_ids 2-D and then fails on the flattened prompt. SDPA is also the like-for-like
    # backend: stateful KV inside the IR, as in the fleet shards.
    properties = {"ATTENTION_BACKEND": "SDPA"}
    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", **properties)
    config = openvino_genai.GenerationConfig(max_new_tokens=tokens, ignore_eos=True, do_sample=False,
                                             apply_chat_template=False)  # texts are already chat-rendered

    def run(i: int) -> Run:
        result = pipe.generate([texts[i]], config)
        metrics = result.perf_metrics
        if metrics.get_num_input_tokens() != len(prompt_ids[i]):  # GenAI's tokenizer must see the same prompt
            raise RuntimeError(f"GenAI tokenized prompt {i} to {metrics.get_num_input_tokens()} tokens, "
                               f"fleet to {len(prompt_ids[i])}")
        return Run(len(prompt_ids[i]), metrics.get_num_generated_tokens(), metrics.get_ttft().mean,
                   metrics.get_throughput().mean, result.texts[0], extra={"tpot_ms": metrics.get_tpot().mean})

    settings = {"model": str(folder), "device": "CPU", "properties": properties, "threads": "OpenVINO default",
                "openvino_genai": openvino_genai.__version__}
    return settings, run


# ---------------------------------------------------------------- driver

def fail(cell: Cell, exc: Exception) -> None:
    cell.error = f"{type(exc).__name__}: {exc}"
    print(f"  {cell.config} FAILED: {cell.error}", flush=True)


def measure(setups: list[tuple[Cell, Callable[[], tuple[dict, Runner]]]], n_prompts: int) -> list[dict]:
    """Set up and warm up every config, then run prompt i on every config in turn; fills the cells.

    A config that fails becomes a failed row instead of ending the run. Returns the load average per round.
    """
    runners: list[tuple[Cell, Runner]] = []
    for cell, setup in setups:
        print(f"  setting up {cell.config} ...", flush=True)
        try:
            cell.settings, runner = setup()
            runner(0)  # warm-up
            runners.append((cell, runner))
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            fail(cell, exc)
    loadavg = []
    for i in range(n_prompts):
        before = os.getloadavg()
        for cell, runner in runners:
            if cell.error is None:
                time.sleep(SETTLE_S)
                try:
                    cell.runs.append(runner(i))
                except Exception as exc:  # noqa: BLE001 - as above
                    fail(cell, exc)
        loadavg.append({"round": i, "before": before, "after": os.getloadavg()})
        print(f"  round {i + 1}/{n_prompts} done, load average {loadavg[-1]['after'][0]:.2f}", flush=True)
    return loadavg


def table(cells: list[Cell], reference: float | None) -> str:
    lines = [f"{'config':<34} | stages | decode tok/s | TPOT ms | TTFT ms | ratio vs whole-model", "-" * 96]
    for c in cells:
        if (tok_s := c.decode_tok_s) is None:
            lines.append(f"{c.config:<34} | {c.stages:>6} | {'failed':>12} | {'-':>7} | {'-':>7} | {'-':>20}")
            continue
        ratio = f"{tok_s / reference:.2f}" if reference else "-"
        lines.append(f"{c.config:<34} | {c.stages:>6} | {tok_s:>12.1f} | {1000 / tok_s:>7.2f} | {c.ttft_ms:>7.0f} | "
                     f"{ratio:>20}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every cell with its config here")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    parser.add_argument("--prompts", type=int, default=3, help=f"prompts per cell (1..{len(PROMPTS)})")
    parser.add_argument("--quick", action="store_true", help="smoke test: 16 tokens, 1 prompt")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: fetched into CACHE/SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", type=Path, default=ROOT / "models" / "bench", help="builds are cached here")
    args = parser.parse_args(argv)
    tokens, n_prompts = (16, 1) if args.quick else (args.tokens, args.prompts)
    if tokens < 2 or not 1 <= n_prompts <= len(PROMPTS):
        parser.error(f"need --tokens >= 2 and 1 <= --prompts <= {len(PROMPTS)}")

    # SIGTERM (e.g. a timeout wrapper) must unwind like Ctrl-C so the coordinators get stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from compiler.source import fetch_demo

    cache = args.cache.resolve()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    hf = fetch_demo(args.hf or cache / "SmolLM2-135M-Instruct")
    builds = {n: ensure_build(hf, cache, n) for n in (1, 2, 3)}
    genai_dir = ensure_genai_folder(hf, cache)
    prompts = list(PROMPTS[:n_prompts])
    tokenizer = ChatTokenizer(builds[1])
    texts = [tokenizer.render_chat(messages(p)) for p in prompts]
    prompt_ids = [tokenizer.encode(t) for t in texts]
    print(f"decode bench: {tokens} tokens x {n_prompts} prompt(s), nproc {os.cpu_count()}, "
          f"openvino {ov.get_version()}", flush=True)

    cells = [Cell("whole-model (OpenVINO, 1 process)", 1), *(Cell(f"fleet {n}-stage", n) for n in (1, 2, 3)),
             Cell("OpenVINO GenAI LLMPipeline", 1)]
    with ExitStack() as stack:  # stops every coordinator (and its workers) however we leave
        setups = [lambda: whole_runner(builds[1], prompt_ids, tokens),
                  *(lambda n=n: fleet_runner(stack, builds[n], n, prompts, tokens, cache / "logs") for n in (1, 2, 3)),
                  lambda: genai_runner(genai_dir, texts, prompt_ids, tokens)]
        loadavg = measure(list(zip(cells, setups)), n_prompts)
    reference = cells[0].decode_tok_s
    print("\n" + table(cells, reference))
    # Same prompts, greedy: a row whose text differs did different work (or rounds differently, e.g. bf16).
    same = {c.config: [r.text == w.text for r, w in zip(c.runs, cells[0].runs)] for c in cells[1:]}
    if differ := [name for name, flags in same.items() if not all(flags)]:
        print(f"note: completions differ from the whole model's in: {', '.join(differ)}")
    if args.json:
        core = ov.Core()
        report = {
            "benchmark": "decode_bench", "model": "SmolLM2-135M-Instruct", "tokens": tokens, "prompts": prompts,
            "decode": "median over prompts of (completion_tokens - 1) / seconds after the first token",
            "machine": {"nproc": os.cpu_count(), "cpu": core.get_property("CPU", "FULL_DEVICE_NAME"),
                        "cpu_capabilities": core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
                        "platform": platform.platform(), "openvino": ov.get_version()},
            "loadavg_per_round": loadavg,
            "cells": [{**asdict(c), "decode_tok_s": c.decode_tok_s, "ttft_ms": c.ttft_ms,
                       "same_text_as_whole_model": same.get(c.config),
                       "tpot_ms": 1000 / c.decode_tok_s if c.decode_tok_s else None,
                       "ratio_vs_whole_model": c.decode_tok_s / reference if c.decode_tok_s and reference else None}
                      for c in cells],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(c.decode_tok_s for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
