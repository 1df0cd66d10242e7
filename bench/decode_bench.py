"""Single-user decode speed of the demo model: fleet (1, 2, 3 stages) vs the whole model, side by side.

Measures, in ONE run so that the ratios are comparable (same machine load, same prompts, greedy,
``ignore_eos``, same token count, default precision and OpenVINO's default thread count everywhere):

* ``fleet``: ``python -m coordinator.cli serve --local-workers N`` (one ``fleet-worker`` process per
  stage on loopback, gRPC between them), driven over HTTP with streaming chat completions. Decode
  tok/s = (completion_tokens - 1) / (time from the first streamed token to the last), seen by the client.
* ``whole-model``: the 1-stage build's ``stage_0`` IR in this process, a plain numpy greedy loop.
* ``genai``: ``openvino_genai.LLMPipeline`` over the same weights, exported without ``logits_index``
  (optimum-style folder built here), throughput and TPOT from its perf metrics.

Each cell is warmed up once, then reports the median over the prompts. Ratios, not absolute times,
are the point: this 2-core machine may be shared, so the JSON records load averages per cell.

    python bench/decode_bench.py [--json PATH] [--tokens 128] [--prompts 3] [--quick]
        [--hf HF_FOLDER] [--cache models/bench]
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
SHARD_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}  # what worker/runner.py compiles shards with
GENAI_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")


@dataclass
class Run:
    """One timed generation."""

    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # request start -> first token
    decode_tok_s: float  # (completion_tokens - 1) / time after the first token
    extra: dict = field(default_factory=dict)  # per-config details (e.g. the server's own numbers)


@dataclass
class Cell:
    """One table row: a configuration and its runs (or the error that stopped it)."""

    config: str
    stages: int
    settings: dict
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    loadavg: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float | None:
        return statistics.median(r.decode_tok_s for r in self.runs) if self.runs else None

    @property
    def ttft_ms(self) -> float | None:
        return statistics.median(r.ttft_ms for r in self.runs) if self.runs else None


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------- inputs (cached between runs)

def ensure_build(hf: Path, cache: Path, shards: int) -> Path:
    out = cache / f"smollm2-{shards}stage"
    if not (out / "manifest.json").is_file():
        from compiler.build import build

        print(f"building {shards}-stage model into {out} ...", flush=True)
        build(hf, out, shards=shards)
    return out


def ensure_genai_folder(hf: Path, cache: Path) -> Path:
    """Optimum-style folder for ``LLMPipeline``: whole model with [B, S, V] logits + OV tokenizers."""
    out = cache / "genai"
    if all((out / name).is_file() for name in GENAI_FILES):
        return out
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    from compiler.build import load_source
    from compiler.export import StageSpec, export_stage

    print(f"exporting GenAI folder into {out} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = load_source(hf, out)
    layers = model.config.num_hidden_layers
    ov_model = export_stage(model, StageSpec(0, 0, layers, layers), logits_index_input=False)
    ov.save_model(ov_model, out / "openvino_model.xml", compress_to_fp16=True)
    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(hf), with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (hf / name).is_file():
            shutil.copy2(hf / name, out / name)
    return out


# ---------------------------------------------------------------- fleet over HTTP

def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the coordinator's process group (it and its workers), SIGKILL whatever outlives the grace."""
    pgid = proc.pid  # start_new_session=True: the coordinator leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(pgid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
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
    """One streamed greedy chat completion; times are taken on the client."""
    body = {"messages": messages(prompt), "temperature": 0, "ignore_eos": True, "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = None
    final: dict = {}
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
                continue
            choice = event["choices"][0]
            if first is None and choice["delta"].get("content"):
                first = time.perf_counter()
            if choice["finish_reason"] is not None:
                end = time.perf_counter()
    n = final["usage"]["completion_tokens"]
    if first is None or end is None or n < 2:
        raise RuntimeError(f"stream ended early: {n} tokens")
    return Run(final["usage"]["prompt_tokens"], n, (first - start) * 1000, (n - 1) / (end - first),
               extra={"server": final.get("fleet", {})})


def bench_fleet(build: Path, stages: int, prompts: list[str], tokens: int, logs: Path) -> Cell:
    port = free_port()
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(build), "--local-workers", str(stages),
           "--port", str(port), "--no-announce", "--no-discover", "--log-level", "WARNING"]
    cell = Cell(f"fleet {stages}-stage", stages, {"command": " ".join(cmd[1:]), "threads": "OpenVINO default",
                                                   "workers": f"{stages} processes, gRPC on loopback"})
    log = logs / f"fleet-{stages}stage.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, proc, log)
            with httpx.Client() as client:
                stream_chat(client, url, prompts[0], tokens)  # warm-up
                cell.runs = [stream_chat(client, url, p, tokens) for p in prompts]
        finally:
            stop_group(proc)
    return cell


# ---------------------------------------------------------------- in-process baselines

def greedy_whole(request: ov.InferRequest, prompt_ids: list[int], tokens: int) -> Run:
    """Greedy decode through the 1-stage shard, fed exactly as a worker feeds it."""
    request.reset_state()
    seq = len(prompt_ids)
    beam_idx = np.zeros(1, dtype=np.int32)
    start = time.perf_counter()
    logits = request.infer({
        "input_ids": np.array([prompt_ids], dtype=np.int64),  # [1, S]
        "attention_mask": np.ones((1, seq), dtype=np.int64),  # [1, S]
        "position_ids": np.arange(seq, dtype=np.int64)[None, :],  # [1, S]
        "beam_idx": beam_idx,
        "logits_index": np.array([seq - 1], dtype=np.int64),
    })[0]  # [1, 1, V]
    token = int(logits[0, -1].argmax())
    first = time.perf_counter()
    output = [token]
    for position in range(seq, seq + tokens - 1):
        logits = request.infer({
            "input_ids": np.array([[token]], dtype=np.int64),
            "attention_mask": np.ones((1, position + 1), dtype=np.int64),
            "position_ids": np.array([[position]], dtype=np.int64),
            "beam_idx": beam_idx,
            "logits_index": np.zeros(1, dtype=np.int64),
        })[0]
        token = int(logits[0, -1].argmax())
        output.append(token)
    end = time.perf_counter()
    return Run(seq, len(output), (first - start) * 1000, (len(output) - 1) / (end - first))


def bench_whole(build: Path, prompt_ids: list[list[int]], tokens: int) -> Cell:
    xml = build / "stage_0" / "openvino_model.xml"
    cell = Cell("whole-model (OpenVINO, 1 process)", 1, {"model": str(xml), "config": SHARD_CONFIG,
                                                         "threads": "OpenVINO default"})
    request = ov.Core().compile_model(str(xml), "CPU", SHARD_CONFIG).create_infer_request()
    greedy_whole(request, prompt_ids[0], tokens)  # warm-up
    cell.runs = [greedy_whole(request, ids, tokens) for ids in prompt_ids]
    return cell


def bench_genai(folder: Path, texts: list[str], prompt_ids: list[list[int]], tokens: int) -> Cell:
    import openvino_genai

    # GenAI's default CPU backend (PagedAttention) rewrites the graph with SDPAToPagedAttention, which
    # leaves our input_ids 2-D and then fails on the flattened prompt; SDPA is also the like-for-like
    # backend: stateful KV inside the IR, exactly as in the fleet shards.
    properties = {"ATTENTION_BACKEND": "SDPA"}
    cell = Cell("OpenVINO GenAI LLMPipeline", 1, {"model": str(folder), "device": "CPU", "properties": properties,
                                                  "threads": "OpenVINO default",
                                                  "openvino_genai": openvino_genai.__version__})
    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", **properties)
    config = openvino_genai.GenerationConfig(max_new_tokens=tokens, ignore_eos=True, do_sample=False,
                                             apply_chat_template=False)  # texts are already chat-rendered

    def once(text: str, ids: list[int]) -> Run:
        metrics = pipe.generate([text], config).perf_metrics
        if metrics.get_num_input_tokens() != len(ids):  # GenAI's tokenizer must see the same prompt
            raise RuntimeError(f"GenAI tokenized the prompt to {metrics.get_num_input_tokens()} tokens, "
                               f"fleet to {len(ids)}")
        return Run(len(ids), metrics.get_num_generated_tokens(), metrics.get_ttft().mean,
                   metrics.get_throughput().mean, extra={"tpot_ms": metrics.get_tpot().mean})

    once(texts[0], prompt_ids[0])  # warm-up
    cell.runs = [once(t, ids) for t, ids in zip(texts, prompt_ids)]
    return cell


# ---------------------------------------------------------------- driver

def guarded(name: str, fn, *args) -> Cell:  # noqa: ANN001 - fn is any bench_* function
    """Run one cell; a failing cell becomes a row with its error instead of killing the whole run."""
    before = os.getloadavg()
    try:
        cell = fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        cell = Cell(name, 0, {}, error=f"{type(exc).__name__}: {exc}")
    cell.loadavg = {"before": before, "after": os.getloadavg()}
    print(f"  {cell.config}: " + (f"{cell.decode_tok_s:.1f} tok/s" if cell.runs else f"FAILED {cell.error}"),
          flush=True)
    return cell


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def table(cells: list[Cell], reference: float | None) -> str:
    rows = [("config", "stages", "decode tok/s", "TPOT ms", "TTFT ms", "ratio vs whole-model")]
    for c in cells:
        if not c.runs:
            rows.append((c.config, str(c.stages or "-"), "failed", "-", "-", "-"))
            continue
        tok_s = c.decode_tok_s
        ratio = f"{tok_s / reference:.2f}" if reference else "-"
        rows.append((c.config, str(c.stages), f"{tok_s:.1f}", f"{1000 / tok_s:.2f}", f"{c.ttft_ms:.0f}", ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
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

    from compiler.source import fetch_demo

    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    hf = fetch_demo(args.hf or cache / "SmolLM2-135M-Instruct")
    builds = {n: ensure_build(hf, cache, n) for n in (1, 2, 3)}
    genai_dir = ensure_genai_folder(hf, cache)

    prompts = list(PROMPTS[:n_prompts])
    tokenizer = ChatTokenizer(builds[1])
    texts = [tokenizer.render_chat(messages(p)) for p in prompts]
    prompt_ids = [tokenizer.encode(t) for t in texts]
    print(f"decode bench: {tokens} tokens x {n_prompts} prompt(s), nproc {os.cpu_count()}, "
          f"openvino {ov.get_version()}", flush=True)

    cells = [guarded("whole-model (OpenVINO, 1 process)", bench_whole, builds[1], prompt_ids, tokens)]
    cells += [guarded(f"fleet {n}-stage", bench_fleet, builds[n], n, prompts, tokens, logs) for n in (1, 2, 3)]
    cells.append(guarded("OpenVINO GenAI LLMPipeline", bench_genai, genai_dir, texts, prompt_ids, tokens))

    reference = cells[0].decode_tok_s
    print()
    print(table(cells, reference))
    if args.json:
        report = {
            "benchmark": "decode_bench", "model": "SmolLM2-135M-Instruct", "tokens": tokens, "prompts": prompts,
            "decode": "median over prompts of (completion_tokens - 1) / time after the first token",
            "machine": {"nproc": os.cpu_count(), "cpu": cpu_model(),
                        "platform": platform.platform(), "python": platform.python_version(),
                        "openvino": ov.get_version(),
                        "cpu_bf16": "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")},
            "cells": [{**asdict(c), "decode_tok_s": c.decode_tok_s, "ttft_ms": c.ttft_ms,
                       "tpot_ms": 1000 / c.decode_tok_s if c.runs else None,
                       "ratio_vs_whole_model": c.decode_tok_s / reference if c.runs and reference else None}
                      for c in cells],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(c.runs for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
