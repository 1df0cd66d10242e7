"""Issue 28's Mixture-of-Experts speed goal: a random model of Qwen3-30B-A3B's shape with a few layers decodes
within 1.3x the time per token of the dense model of its active parameters, and at >= 1.0x llama.cpp on the same
GGUF. One run, three cells, same thread count, one after the other:

* fleet on the MoE: ``qwen3-30b-a3b`` of ``bench/real_gguf.py`` (hidden 2048, 128 experts of 768, 8 chosen per
  token, 32 q / 4 kv heads of 128, untied head) with ``--layers`` layers, ``llama-quantize`` Q4_K_M;
* fleet on the dense model of the same active parameter count: ``qwen3-30b-a3b-dense`` (the same attention, one
  SwiGLU of 8 x 768 = 6144), Q4_K_M the same way;
* llama.cpp on the MoE file: ``llama-bench -p 0 -n TOKENS -t T`` (and on the dense file, so that a gap to it
  splits into what is MoE's and what is the kernels').

Each fleet cell is ``bench/kernels/kernel_bench.py``'s: ``fleet-compiler build FILE --shards 1``, loaded and compiled as a
worker does in its own process pinned to cores ``0..T-1``, ``--prompt`` tokens prefilled then ``--tokens`` greedy
steps, three times, the median tok/s; peak RSS is that process's VmHWM. ``--profile`` adds OpenVINO's per-op
profile (``PERF_COUNT``) of both fleet builds: ms per step by op type, the experts' products (fleet's
``GgufMoeMatMul``, compiler/experts.py: three a layer, named after their constants) by matrix, and the runtime
graph's node types of the MoE build (fleet's ops show as ``Reference``; no ``GatherMatmul`` is left).

Both files carry the demo's 49,152-token vocabulary (``real_gguf``: its tokenizer is copied so that both systems
read the same file), not Qwen3's 151,936: the head is 0.1 GB of Q6_K, not 0.3 GB.

    python bench/kernels/moe_bench.py [--layers 4] [--threads 2] [--tokens 48] [--prompt 8] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

from bench import harness, real_gguf


from bench.kernels import kernel_bench
MOE, DENSE = "qwen3-30b-a3b", "qwen3-30b-a3b-dense"
QTYPE = "Q4_K_M"
GOAL_OVER_DENSE, GOAL_OVER_LLAMA = 1.3, 1.0  # ms/token MoE <= 1.3 x dense; fleet tok/s >= 1.0 x llama.cpp


def runtime_ops(build: Path, threads: int) -> dict[str, int]:
    """The CPU plugin's node types (``layerType``) in the compiled MoE stage, counted (compiled as a worker
    compiles it): fleet's ops (``GgufMatMul``, ``GgufMoeMatMul``) as ``Reference``."""
    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import compile_config, runs_compressed, stage_core

    entry = load_manifest(build).manifest.stages[0]
    compiled = stage_core().compile_model(str(build / "stage_0" / "openvino_model.xml"), "CPU",
                                       compile_config(threads, "auto", runs_compressed("CPU", entry)))
    return dict(Counter(n.get_rt_info()["layerType"].astype(str) for n in compiled.get_runtime_model().get_ordered_ops()))


def experts_ms(ops: list) -> dict[str, float]:
    """ms per decode step of the experts' products (``GgufMoeMatMul``, named ``model.layers.N.mlp.experts.
    gate_proj.weight/matmul``) by matrix (gate, up, down), summed over the layers, from ``fleet_cell``'s ops."""
    out: dict[str, float] = {}
    for _, _, name, ms in ops:
        if ".experts." in name and name.endswith("/matmul"):
            part = name.split(".")[-2].removesuffix("_proj")
            out[part] = out.get(part, 0.0) + ms
    return out


def cells(args: argparse.Namespace) -> dict:
    """The three cells (module docstring) and the facts of their files and builds."""
    out = {}
    for name in (MOE, DENSE):
        gguf = real_gguf.ensure(name, QTYPE, args.layers, args.cache)
        build = kernel_bench.ensure_build(gguf, None, args.cache / "builds")
        print(f"{name}: timing fleet ({args.threads} threads) ...", flush=True)
        cell = kernel_bench.fleet_cell(build, args.threads, args.tokens, args.prompt, False)
        del cell["ops"]
        out[name] = {"gguf": str(gguf), "gguf_mb": gguf.stat().st_size / 1e6, "build": str(build),
                     "bin_mb": sum(p.stat().st_size for p in build.glob("stage_*/*.bin")) / 1e6, "fleet": cell}
        if args.profile:
            ops = kernel_bench.fleet_cell(build, args.threads, min(args.tokens, 21), args.prompt, True)["ops"]
            out[name]["profile"] = kernel_bench.profile_summary(ops) | {"experts_ms": experts_ms(ops)}
            out[name]["runtime_ops"] = runtime_ops(build, args.threads)
    if not args.no_llama_cpp:
        for name in (MOE, DENSE):  # the dense file too: which part of a gap is MoE's, which the kernels'
            print(f"{name}: timing llama.cpp ...", flush=True)
            out[name]["llama_cpp"] = kernel_bench.llama_cell(Path(out[name]["gguf"]), args.threads, args.tokens)
    return out


def summary(c: dict) -> tuple[str, dict]:
    """The markdown table and the ratios: MoE ms/token ÷ dense's, fleet tok/s ÷ llama.cpp's on the MoE."""
    moe, dense, llama = c[MOE]["fleet"], c[DENSE]["fleet"], c[MOE].get("llama_cpp")
    ratios = {"moe_over_dense_ms": dense["tok_s"] / moe["tok_s"],
              "fleet_over_llama_cpp_tok_s": moe["tok_s"] / llama["tok_s"] if llama else None}
    ratios["goals_met"] = {"moe_within_1.3x_dense": ratios["moe_over_dense_ms"] <= GOAL_OVER_DENSE,
                           "fleet_at_least_llama_cpp": None if llama is None else
                           ratios["fleet_over_llama_cpp_tok_s"] >= GOAL_OVER_LLAMA}
    rows = [[f"fleet, {MOE}", f"{moe['tok_s']:.1f}", f"{1000 / moe['tok_s']:.1f}", f"{moe['peak_rss_mib']:.0f}",
             f"{c[MOE]['bin_mb']:.0f}"],
            [f"fleet, {DENSE}", f"{dense['tok_s']:.1f}", f"{1000 / dense['tok_s']:.1f}",
             f"{dense['peak_rss_mib']:.0f}", f"{c[DENSE]['bin_mb']:.0f}"]]
    for name in (MOE, DENSE) if llama else ():
        cell = c[name]["llama_cpp"]
        rows.append([f"llama.cpp, {name}", f"{cell['tok_s']:.1f}", f"{1000 / cell['tok_s']:.1f}",
                     f"{cell['peak_rss_mib']:.0f}", f"{c[name]['gguf_mb']:.0f} (GGUF)"])
    if llama:
        ratios["llama_cpp_moe_over_dense_ms"] = c[DENSE]["llama_cpp"]["tok_s"] / llama["tok_s"]
    text = harness.table(["cell", "decode tok/s", "ms/token", "peak RSS MiB", "weights MB"], rows)
    text += (f"\n\nMoE ÷ dense, ms/token: {ratios['moe_over_dense_ms']:.2f} (goal <= {GOAL_OVER_DENSE})")
    if llama:
        text += (f"\nfleet ÷ llama.cpp on the MoE, tok/s: {ratios['fleet_over_llama_cpp_tok_s']:.2f} "
                 f"(goal >= {GOAL_OVER_LLAMA}); llama.cpp's own MoE ÷ dense, ms/token: "
                 f"{ratios['llama_cpp_moe_over_dense_ms']:.2f}")
    for name in (MOE, DENSE):
        if "profile" in c[name]:
            p = c[name]["profile"]
            text += (f"\n{name} profile: {p['total_ms']:.1f} ms/step; by op: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in p["by_type_ms"].items())
                     + (f"; experts' products: {', '.join(f'{k} {v:.2f}' for k, v in p['experts_ms'].items())}"
                        if p["experts_ms"] else "")
                     + f"; runtime node types: {c[name]['runtime_ops']}")
    return text, ratios


def main(argv: list[str] | None = None) -> int:
    """Make the files and builds, time the three cells, print the table and ratios, write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of both models")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--tokens", type=int, default=48, help="greedy decode steps per run")
    parser.add_argument("--prompt", type=int, default=8, help="context tokens before the timed decode")
    parser.add_argument("--profile", action="store_true", help="also PERF_COUNT both fleet builds")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--cache", type=Path, default=real_gguf.CACHE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.threads < 1 or args.tokens < 2:
        parser.error("need --layers >= 1, --threads >= 1, --tokens >= 2")
    c = cells(args)
    text, ratios = summary(c)
    print(f"\nMoE bench: {args.layers} layers, {QTYPE}, {args.threads} threads, {args.tokens} greedy tokens after "
          f"{args.prompt}, nproc {os.cpu_count()}\n{text}")
    harness.write_json(args.json, "moe_bench", {"layers": args.layers, "threads": args.threads, "tokens": args.tokens,
                                                "prompt": args.prompt, "qtype": QTYPE, "cells": c, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
