"""Does capping the sliding-window layers' KV pay? Issue 28 asks for it "if measurements say it pays".

A random model of Gemma-3-1B's dimensions (hidden 1152, 4 query heads and 1 KV head of 256, GeGLU of 6912, window
512, local and global RoPE bases 10000 and 1e6) with ``--layers`` layers in Gemma 3's pattern (five local, then
one global), the demo's tokenizer and 49,152-token vocabulary, made by transformers and built into one stage
(fp16 weights, f16 KV). Each cell is its own process, one after the other: the stage compiled as a worker compiles
it, a session prefilled with ``N`` random tokens in chunks of 512, then ``--tokens`` decode steps; two modes on the
same build:

* ``capped``: the session as a worker opens it (fleet_common/sliding_kv.py: the local layers hold at most their
  last 1,086 slots between chunks);
* ``full``: ``sliding=None``, every layer holds every slot (fleet before this change; the graph is the same).

Reported per cell: prefill seconds, decode ms/token (median), the KV bytes the session's states hold at the end
(f16) and the process's peak RSS (VmHWM); the table puts capped / full side by side with their ratios.

    python bench/kernels/sliding_kv_bench.py [--layers 6] [--contexts 2048 8192 16384] [--tokens 32] [--threads 2]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness

GEMMA3_1B = dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, sliding_window=512, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHUNK = 512


def make_build(layers: int, cache: Path) -> Path:
    """The random Gemma-3-1B-shaped model of ``layers`` layers (Gemma 3's 5:1 pattern), built once into ``cache``."""
    import shutil

    out = cache / f"gemma3-1b-dims-{layers}l"
    if (out / "build" / "manifest.json").is_file():
        return out / "build"
    import torch
    import transformers

    from compiler.build import build

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(**GEMMA3_1B, num_hidden_layers=layers, layer_types=types)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out / "hf")
    demo = harness.demo_hf()
    for file in TOKENIZER:
        shutil.copy(demo / file, out / "hf" / file)
    build(out / "hf", out / "build", shards=1)
    return out / "build"


def cell(build: Path, mode: str, context: int, tokens: int, threads: int) -> dict:
    """One cell in this process: prefill ``context`` random tokens, decode ``tokens``; the numbers as a dict."""
    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import KVSession, compile_ir, run_chunk

    manifest = load_manifest(build).manifest
    stage = manifest.stages[0]
    compiled, kv_bytes, _ = compile_ir(build / stage.xml, threads=threads, compressed=False)
    sliding = manifest.sliding_kv(0) if mode == "capped" else None
    session = KVSession("bench", compiled.create_infer_request(), context + tokens + 1, sliding=sliding)
    ids = np.random.default_rng(0).integers(3, 49152, context + tokens)
    t0 = time.perf_counter()
    for start in range(0, context, CHUNK):
        chunk = ids[None, start:min(context, start + CHUNK)]
        run_chunk(session, "input_ids", chunk, session.length, start, [], np.array([chunk.shape[1] - 1]))
    prefill_s = time.perf_counter() - t0
    times = []
    for k in range(tokens):
        t = time.perf_counter()
        run_chunk(session, "input_ids", ids[None, context + k:context + k + 1], session.length, context + k, [],
                  np.array([0]))
        times.append((time.perf_counter() - t) * 1000)
    held = session.length * manifest.kv_bytes_per_token(0, kv_bytes) \
        - session.local_start * manifest.sliding_kv_bytes_per_token(0, kv_bytes)  # full: local_start stays 0
    status = harness.proc_status()
    return {"mode": mode, "context": context, "prefill_s": prefill_s, "decode_ms": statistics.median(times),
            "kv_bytes": held, "local_start": session.local_start, "peak_rss": status.get("VmHWM", 0),
            "rss": status.get("VmRSS", 0)}


def run_cell(build: Path, mode: str, context: int, tokens: int, threads: int) -> dict:
    """``cell`` in a process of its own (its peak RSS is its own)."""
    out = subprocess.run([sys.executable, "-m", "bench.kernels.sliding_kv_bench", "--cell", mode, str(context),
                          "--build", str(build), "--tokens", str(tokens), "--threads", str(threads)],
                         capture_output=True, text=True, cwd=harness.ROOT, env=harness.repo_env(), check=False)
    if out.returncode:
        raise RuntimeError(f"cell {mode} {context} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the cells, print the table, write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=harness.CACHE / "sliding_kv")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cell", nargs=2, metavar=("MODE", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(cell(args.build, args.cell[0], int(args.cell[1]), args.tokens, args.threads)))
        return 0
    build = make_build(args.layers, args.cache)
    cells = [run_cell(build, mode, n, args.tokens, args.threads) for n in args.contexts for mode in ("capped", "full")]
    mib = 1 << 20
    rows = []
    for n in args.contexts:
        c, f = (next(x for x in cells if x["mode"] == m and x["context"] == n) for m in ("capped", "full"))
        rows.append([n, f"{c['prefill_s']:.1f} / {f['prefill_s']:.1f}", f"{c['decode_ms']:.1f} / {f['decode_ms']:.1f}",
                     f"{f['decode_ms'] / c['decode_ms']:.2f}x", f"{c['kv_bytes'] / mib:.0f} / {f['kv_bytes'] / mib:.0f}",
                     f"{c['peak_rss'] / mib:.0f} / {f['peak_rss'] / mib:.0f}"])
    print(f"Gemma-3-1B dims, {args.layers} layers (5 local : 1 global), one stage, fp16 weights, f16 KV, "
          f"{args.threads} threads; capped / full")
    print(harness.table(["context", "prefill s", "decode ms/token", "decode speed-up", "KV MiB", "peak RSS MiB"],
                        rows, pad=True))
    harness.write_json(args.json, "sliding_kv_bench", {"layers": args.layers, "threads": args.threads,
                                                      "tokens": args.tokens, "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
