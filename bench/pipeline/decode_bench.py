"""Single-user decode speed of a model (the demo by default): fleet (1, 2, 3 stages) vs the whole model, side by side.

All rows come from ONE run (same chat prompts, greedy, ``ignore_eos``, same token count, default
precision and OpenVINO's default thread count everywhere), so their ratios are comparable:

* ``whole-model``: the 1-stage build's ``stage_0`` IR in this process, a numpy greedy loop fed as a
  worker feeds it. The reference row.
* ``fleet N-stage``: ``fleet-coordinator serve --local-workers N`` (a ``fleet-worker`` process
  per stage, gRPC on loopback), streamed chat completions; decode tok/s = (completion_tokens - 1) /
  (first streamed token -> last), timed by the client.
* ``GenAI``: ``openvino_genai.LLMPipeline`` on the same weights (exported without ``logits_index``
  into an optimum-style folder); decode tok/s and TTFT from its perf metrics.

Configs are set up and warmed up first, then prompts run round-robin across configs so that load
from other processes hits all rows alike; a cell is the median over prompts. The JSON holds every
run, the load average per round and machine facts.

``--model PATH`` (bench/models.py): a GGUF file or an HF folder, built into ``--cache`` per stage count, or a
fleet build used as it is (then ``--stages`` defaults to its own count, and the whole-model row needs it to be a
1-stage build). The GenAI row needs an HF folder (the demo's, or ``--model``'s); for a GGUF or a build it is left
out, with a note.

    python bench/pipeline/decode_bench.py [--model PATH] [--stages 1,2,3] [--json PATH] [--tokens 128] [--prompts 3]
                                 [--quick] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openvino as ov

from bench import clients, harness, models
from coordinator.tokenizer import ChatTokenizer

PROMPTS = clients.PROMPTS[:5]
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
        """Median decode tok/s over the runs (None for a failed or empty cell)."""
        return statistics.median(r.decode_tok_s for r in self.runs) if self.runs and not self.error else None

    @property
    def ttft_ms(self) -> float | None:
        """Median TTFT over the runs (None for a failed or empty cell)."""
        return statistics.median(r.ttft_ms for r in self.runs) if self.runs and not self.error else None


def messages(prompt: str) -> list[dict]:
    """One user message: the chat every row runs."""
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------- inputs, cached between runs

def ensure_genai_folder(hf: Path, cache: Path) -> Path:
    """Optimum-style folder for ``LLMPipeline`` of HF folder ``hf``: whole model with [B, S, V] logits + OV
    tokenizers, in ``cache`` once per compiler version and source (named as bench/models.py names builds)."""
    out = cache / f"genai-{harness.build_dir(hf, cache, 1).name}"
    if all((out / name).is_file() for name in GENAI_FILES):
        return out
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    from bench.reference_models import save_whole_model

    print(f"exporting the GenAI folder into {out} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf / name).is_file():  # generation_config.json is optional
            shutil.copy2(hf / name, out / name)
    save_whole_model(hf, out / "openvino_model.xml", logits_index_input=False)
    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(hf), with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")  # written last: GENAI_FILES marks completion
    return out


# ---------------------------------------------------------------- fleet over HTTP

def stream_chat(client: httpx.Client, url: str, prompt: str, tokens: int) -> Run:
    """One streamed greedy chat completion, timed on the client: decode tok/s = (completion_tokens - 1) /
    (first content chunk -> the chunk with ``finish_reason``). Raises ``RuntimeError`` if it ends early."""
    s = clients.stream_chat(client, url, messages(prompt), tokens, timeout=600)
    n = s.usage.get("completion_tokens", 0)
    if s.finish is None or n < 2:
        raise RuntimeError(f"stream ended early ({n} tokens)")
    return Run(s.usage["prompt_tokens"], n, s.ttft_ms, (n - 1) / (s.finish - s.times[0]), s.text,
               extra={"coordinator": s.fleet})


def fleet_runner(stack: ExitStack, build: Path, stages: int, prompts: list[str], tokens: int,
                 logs: Path) -> tuple[dict, Runner]:
    """Start a coordinator with ``stages`` local workers; it is stopped when ``stack`` closes."""
    log = logs / f"fleet-{stages}stage.log"
    proc, url = harness.start_coordinator(build, log, "--local-workers", str(stages), "--no-discover",
                                          "--log-level", "WARNING", stack=stack, healthy=True)
    client = stack.enter_context(httpx.Client())
    settings = {"command": " ".join(proc.args[1:]), "workers": f"{stages} processes, gRPC on loopback",
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
    """The whole-model row: the 1-stage IR compiled here as a shard is, greedy-decoded from numpy."""
    tokenizer = ChatTokenizer(build)
    xml = build / "stage_0" / "openvino_model.xml"
    from fleet_common.runtime import stage_core

    request = stage_core().compile_model(str(xml), "CPU", SHARD_CONFIG).create_infer_request()
    settings = {"model": str(xml), "properties": SHARD_CONFIG, "threads": "OpenVINO default"}
    return settings, lambda i: greedy_whole(request, prompt_ids[i], tokens, tokenizer)


def genai_runner(folder: Path, texts: list[str], prompt_ids: list[list[int]], tokens: int) -> tuple[dict, Runner]:
    """The GenAI row: ``openvino_genai.LLMPipeline`` on ``folder`` (SDPA backend, greedy, the same prompts)."""
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
    """Mark ``cell`` failed with ``exc`` and say so."""
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
    """One row per configuration: decode tok/s, TPOT, TTFT and the ratio to the whole model."""
    rows = [[c.config, c.stages, "failed", None, None, None] if (tok_s := c.decode_tok_s) is None else
            [c.config, c.stages, f"{tok_s:.1f}", f"{1000 / tok_s:.2f}", f"{c.ttft_ms:.0f}",
             f"{tok_s / reference:.2f}" if reference else None] for c in cells]
    return harness.table(["config", "stages", "decode tok/s", "TPOT ms", "TTFT ms", "ratio vs whole-model"], rows,
                         pad=True)


def configs(model: models.Model, cache: Path, stages: list[int]) -> tuple[dict[int, Path], Path | None, list[str]]:
    """The builds by stage count (1-stage too where one can be had: the whole-model row), the GenAI folder
    (HF folders only) and a note for each row left out."""
    builds = models.builds(model, cache, stages, optional=(1,))
    notes = [] if 1 in builds else [f"whole-model row left out: {model.path} is a {model.stages}-stage build "
                                    "(the row runs a 1-stage one)"]
    genai = ensure_genai_folder(model.path, cache) if model.kind == "hf" else None
    if genai is None:
        notes.append(f"GenAI row left out: it exports an HF folder, and --model is a {model.kind}")
    return builds, genai, notes


def setups(stack: ExitStack, builds: dict[int, Path], stages: list[int], genai: Path | None, prompts: list[str],
           prompt_ids: list[list[int]], tokens: int, logs: Path) -> list[tuple[Cell, Callable[[], tuple[dict, Runner]]]]:
    """Each row's cell and setup: the whole model (with a 1-stage build), fleets, GenAI (with its folder)."""
    rows: list[tuple[Cell, Callable[[], tuple[dict, Runner]]]] = []
    if 1 in builds:
        rows.append((Cell("whole-model (OpenVINO, 1 process)", 1), lambda: whole_runner(builds[1], prompt_ids, tokens)))
    rows += [(Cell(f"fleet {n}-stage", n), lambda n=n: fleet_runner(stack, builds[n], n, prompts, tokens, logs))
             for n in stages]
    if genai is not None:
        tokenizer = ChatTokenizer(next(iter(builds.values())))
        texts = [tokenizer.render_chat(messages(p)) for p in prompts]
        rows.append((Cell("OpenVINO GenAI LLMPipeline", 1), lambda: genai_runner(genai, texts, prompt_ids, tokens)))
    return rows


def write_json(path: Path, model: models.Model, tokens: int, prompts: list[str], cells: list[Cell],
               reference: float | None, same: dict, loadavg: list[dict], notes: list[str]) -> None:
    """The report: every cell with its settings and runs, its ratio to the whole model and whether its texts
    equal the whole model's, the load average per round and the machine."""
    harness.write_json(path, "decode_bench", {
        "model": model.name, "model_path": str(model.path), "model_kind": model.kind,
        "tokens": tokens, "prompts": prompts, "notes": notes,
        "decode": "median over prompts of (completion_tokens - 1) / seconds after the first token",
        "loadavg_per_round": loadavg,
        "cells": [{**asdict(c), "decode_tok_s": c.decode_tok_s, "ttft_ms": c.ttft_ms,
                   "same_text_as_whole_model": same.get(c.config),
                   "tpot_ms": 1000 / c.decode_tok_s if c.decode_tok_s else None,
                   "ratio_vs_whole_model": c.decode_tok_s / reference if c.decode_tok_s and reference else None}
                  for c in cells]})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (``--quick``: 16 tokens, 1 prompt); argparse's usage error for a bad value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models.add_model_option(parser)
    parser.add_argument("--stages", type=models.counts, help="fleet stage counts (default 1,2,3; a build: its own)")
    parser.add_argument("--json", type=Path, help="write every cell with its config here")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    parser.add_argument("--prompts", type=int, default=3, help=f"prompts per cell (1..{len(PROMPTS)})")
    parser.add_argument("--quick", action="store_true", help="smoke test: 16 tokens, 1 prompt")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: fetched into CACHE/SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE, help="builds are cached here")
    args = parser.parse_args(argv)
    args.tokens, args.prompts = (16, 1) if args.quick else (args.tokens, args.prompts)
    if args.tokens < 2 or not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"need --tokens >= 2 and 1 <= --prompts <= {len(PROMPTS)}")
    if args.model is not None:
        args.stages = models.stage_counts(args.model, args.stages, [1, 2, 3])
        try:
            models.check_stages(args.model, args.stages)
        except models.ModelError as exc:
            parser.error(str(exc))
    args.stages = args.stages or [1, 2, 3]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every row (module docstring); prints the table and notes, writes ``--json``. 1 if a row failed."""
    args = parse_args(argv)
    tokens, n_prompts = args.tokens, args.prompts
    harness.on_sigterm_exit()  # a timeout wrapper's SIGTERM unwinds like Ctrl-C: the coordinators get stopped
    cache = args.cache.resolve()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    model = models.from_args(args.model, cache, args.hf)
    builds, genai_dir, notes = configs(model, cache, args.stages)
    prompts = list(PROMPTS[:n_prompts])
    tokenizer = ChatTokenizer(next(iter(builds.values())))
    prompt_ids = [tokenizer.encode(tokenizer.render_chat(messages(p))) for p in prompts]
    print(f"decode bench: {model.name}, {tokens} tokens x {n_prompts} prompt(s), stages {args.stages}, "
          f"nproc {os.cpu_count()}, openvino {ov.get_version()}", flush=True)
    with ExitStack() as stack:  # stops every coordinator (and its workers) however we leave
        rows = setups(stack, builds, args.stages, genai_dir, prompts, prompt_ids, tokens, cache / "logs")
        cells = [cell for cell, _ in rows]
        loadavg = measure(rows, n_prompts)
    whole = cells[0] if cells[0].config.startswith("whole-model") else None
    reference = whole.decode_tok_s if whole else None
    print("\n" + table(cells, reference))
    for note in notes:
        print(f"note: {note}")
    # Same prompts, greedy: a row whose text differs did different work (or rounds differently, e.g. bf16).
    same = {c.config: [r.text == w.text for r, w in zip(c.runs, whole.runs)] for c in cells[1:]} if whole else {}
    if differ := [name for name, flags in same.items() if not all(flags)]:
        print(f"note: completions differ from the whole model's in: {', '.join(differ)}")
    write_json(args.json, model, tokens, prompts, cells, reference, same, loadavg, notes)
    return 0 if all(c.decode_tok_s for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
