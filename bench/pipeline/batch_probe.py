"""What one infer call of a stage costs at batch B, beside the alternative of copying sessions' KV in
and out of a batched request: the measurement batch groups (coordinator/engine/group.py) are built on.

Stage 0 of the 2-stage demo build, one thread pinned to one core, f32. For contexts 128, 512, 1024
and chunk lengths 1 (plain decode) and 4 (a speculative verify): the median step time at batch 1 and
its ratio at batch 2 and 4 (< 2 and < 4 mean batching pays), and the time to copy two sessions' KV
into one batch-2 request and back (what batching without persistent groups would add to each step).

    python bench/pipeline/batch_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import openvino as ov

from bench import harness
from fleet_common.runtime import compile_ir

VOCAB = 49152


def feed(request: ov.InferRequest, batch: int, past: int, seq: int, rng: np.random.Generator) -> float:
    """One chunk of ``seq`` random tokens per row at ``past``; returns milliseconds."""
    inputs = {"input_ids": rng.integers(0, VOCAB, (batch, seq)),
              "attention_mask": np.ones((batch, past + seq), np.int64),
              "position_ids": np.tile(np.arange(past, past + seq), (batch, 1)),
              "beam_idx": np.arange(batch, dtype=np.int32)}
    t0 = time.perf_counter()
    request.infer(inputs)
    return (time.perf_counter() - t0) * 1000


def prefill(request: ov.InferRequest, batch: int, context: int, rng: np.random.Generator) -> None:
    """Fill ``request``'s KV with ``context`` random tokens per row (fresh state, chunks of 256)."""
    request.reset_state()
    for start in range(0, context, 256):
        feed(request, batch, start, min(256, context - start), rng)


def step_ms(compiled: ov.CompiledModel, batch: int, context: int, seq: int, rng: np.random.Generator) -> float:
    """Median ms of a ``seq``-token step at batch ``batch`` after ``context`` tokens (12 steps after 2 untimed)."""
    request = compiled.create_infer_request()
    prefill(request, batch, context, rng)
    times = [feed(request, batch, context + i * seq, seq, rng) for i in range(14)]
    return float(np.median(times[2:]))


def copy_ms(compiled: ov.CompiledModel, context: int, rng: np.random.Generator) -> float:
    """Median ms of copying two sessions' KV (``context`` slots each) into a batch-2 request and back."""
    a, b, group = (compiled.create_infer_request() for _ in range(3))
    prefill(a, 1, context, rng)
    prefill(b, 1, context, rng)
    prefill(group, 2, 1, rng)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        for x, y, g in zip(a.query_state(), b.query_state(), group.query_state()):
            g.state = ov.Tensor(np.concatenate([x.state.data, y.state.data], 0))
        for x, y, g in zip(a.query_state(), b.query_state(), group.query_state()):
            data = g.state.data
            x.state = ov.Tensor(np.ascontiguousarray(data[:1]))
            y.state = ov.Tensor(np.ascontiguousarray(data[1:]))
        times.append((time.perf_counter() - t0) * 1000)
    return float(np.median(times[1:]))


def main(argv: list[str] | None = None) -> int:
    """Run the probe (module docstring); prints the table, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cache", type=Path, default=harness.CACHE)
    args = parser.parse_args(argv)
    cache = args.cache.resolve()
    build = harness.ensure_build(harness.demo_hf(None, cache), cache, 2)
    os.sched_setaffinity(0, {0})
    compiled, _, _ = compile_ir(build / "stage_0" / "openvino_model.xml", "CPU", 1, "f32")
    rng = np.random.default_rng(0)
    rows = []
    for context in (128, 512, 1024):
        copy = copy_ms(compiled, context, rng)
        for seq in (1, 4):
            ms = {b: step_ms(compiled, b, context, seq, rng) for b in (1, 2, 4)}
            rows.append({"context": context, "chunk": seq, "batch1_ms": ms[1], "batch2_ratio": ms[2] / ms[1],
                         "batch4_ratio": ms[4] / ms[1], "kv_copy_2_sessions_ms": copy})
            print(f"  context {context}, chunk {seq}: batch 1 {ms[1]:.2f} ms", flush=True)
    print(harness.table(["context", "chunk", "batch 1 ms", "batch 2 / 1", "batch 4 / 1", "KV copy 2 ms"],
                        [[r["context"], r["chunk"], f"{r['batch1_ms']:.2f}", f"{r['batch2_ratio']:.2f}",
                          f"{r['batch4_ratio']:.2f}", f"{r['kv_copy_2_sessions_ms']:.2f}"] for r in rows], pad=True))
    harness.write_json(args.json, "batch_probe", {"stage": "2-stage build, stage 0", "rows": rows})
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
