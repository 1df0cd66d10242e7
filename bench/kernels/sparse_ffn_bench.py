"""Issue 47's op-level goals: the sparse FFN (``GgufSparseFfn``) against the dense FFN of fleet's kernels, decode
(one token), in one run.

Per ``--dims`` (``1b``: Llama-3.2-1B's FFN, d 2048, F 8192; ``8b``: Llama-3-8B's, d 4096, F 14336) and thread count
T, a child process pinned to cores 0..T-1 (``INFERENCE_NUM_THREADS=T``; ``--realtime``: SCHED_FIFO through ``chrt``
where permitted) builds ``--layers`` FFNs of random GGUF blocks (``kernel_ops.random_blocks``; several, so that
their weights come from memory, not the 32 MB L3) for each gate/up type of ``--types``, and compiles, all on the
same weights and the same input row x:

* **dense**: per FFN three ``GgufMatMul`` (gate and up [F, d] of the type, down as stored [d, F] of
  ``--dense-down``, by default ``--down-t``'s type so that both read the same bytes at 0%), the activation
  (OpenVINO's Swish or Relu) and a Multiply;
* **sparse s** for s in ``--sparsity``: per FFN one ``GgufSparseFfn`` (down_t [F, d] of ``--down-t``) whose
  threshold drops exactly the fraction s of that FFN's neurons for x: the middle between two neighbours of the
  sorted |a(g)| of its gate's values g (computed by ``GgufMatMul``; ``activation`` computes a(g) as the op does).

The cells are timed in turn, ``--runs`` rounds (after warm-up): each a decode inference of all the FFNs on x; the
median per FFN. Reported per cell: µs per FFN, the ratio sparse ÷ dense, the weight bytes a token reads by formula
(dense: all three matrices; sparse: all of gate + the kept rows of up and down_t) and their ratio, beside the
goals of the issue: at 90% sparsity <= 0.5x dense, at 50% <= 0.8x, at 0% <= 1.05x. Each child's peak RSS.

    python bench/kernels/sparse_ffn_bench.py [--dims 1b,8b] [--types Q4_0,Q4_K] [--down-t Q8_0] [--threads 1,2]
        [--sparsity 0,0.5,0.9] [--activation silu] [--realtime] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness

DIMS = {"1b": (2048, 8192), "8b": (4096, 14336)}  # (d, F)
LAYERS = {"1b": 4, "8b": 2}  # FFNs a model: 146 and 380 MB of Q4_0/Q8_0 weights, well past the L3
GOALS = {0.0: 1.05, 0.5: 0.8, 0.9: 0.5}  # sparsity -> time sparse / dense at most


def row_bytes(name: str, cols: int) -> int:
    import gguf

    per, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return cols // per * nbytes


def activation(g: np.ndarray, name: str) -> np.ndarray:
    """a(g) f32 as the op computes it, within an ulp: relu, or fleet's SiLU g / (1 + exp(-g)) with exp's argument
    clamped to [-87, 88] (kernels/core/sparse.h), so that a gate far below zero gives the op's tiny negative value,
    not float64's far tinier one (random Q4_K blocks, whose minimums shift every gate by hundreds, have many)."""
    g = g.astype(np.float32)
    if name == "relu":
        return np.maximum(g, np.float32(0))
    return g / (np.float32(1) + np.exp(np.clip(-g, np.float32(-87), np.float32(88))))


def thresholds(a: np.ndarray, sparsity: float) -> tuple[float, int]:
    """(threshold, kept): a threshold dropping exactly round(sparsity x F) of the neurons |a| [F] (0: none), and
    how many it keeps."""
    v = np.sort(np.abs(a.astype(np.float64)))
    drop = int(round(sparsity * len(v)))
    if drop == 0:
        return 0.0, int((v > 0).sum())
    return float((v[drop - 1] + v[drop]) / 2), len(v) - drop


def ffn_weights(spec: dict, gate_type: str, rng: np.random.Generator) -> list[dict]:
    from bench.kernels.kernel_ops import random_blocks

    d, f = DIMS[spec["dims"]]
    return [{"gate": random_blocks(gate_type, f, d, rng), "up": random_blocks(gate_type, f, d, rng),
             "down_t": random_blocks(spec["down_t"], f, d, rng), "down": random_blocks(spec["dense_down"], d, f, rng)}
            for _ in range(spec["layers"])]


def models(spec: dict, gate_type: str, layers: list[dict], x: np.ndarray) -> tuple[dict, dict]:
    """({cell: compiled model}, {cell: (FFN bytes a token, kept neurons a FFN)}): dense and each sparsity."""
    import openvino as ov
    from openvino import opset13 as op

    from fleet_common import kernels

    d, f = DIMS[spec["dims"]]
    core, config = kernels.new_core(), {"INFERENCE_NUM_THREADS": spec["threads"]}
    xp = op.parameter([-1, d], ov.Type.f32)
    const = [{k: kernels.blocks_constant(v) for k, v in w.items()} for w in layers]
    gates = core.compile_model(ov.Model([kernels.gguf_matmul(xp.output(0), c["gate"], gate_type) for c in const], [xp]),
                               "CPU", config)([x])
    a = [activation(gates[i][0], spec["activation"]) for i in range(len(const))]
    dense = []
    for c in const:
        g, u = (kernels.gguf_matmul(xp.output(0), c[k], gate_type) for k in ("gate", "up"))
        act = op.relu(g) if spec["activation"] == "relu" else op.swish(g)
        dense.append(kernels.gguf_matmul(op.multiply(act, u).output(0), c["down"], spec["dense_down"]))
    cells = {"dense": core.compile_model(ov.Model(dense, [xp]), "CPU", config)}
    gate_b, up_b, down_t_b = (row_bytes(t, d) for t in (gate_type, gate_type, spec["down_t"]))
    nbytes = {"dense": (f * (gate_b + up_b) + d * row_bytes(spec["dense_down"], f), f)}
    for s in spec["sparsity"]:
        cuts = [thresholds(al, s) for al in a]
        outs = [kernels.gguf_sparse_ffn(xp.output(0), c["gate"], c["up"], c["down_t"], gate_type, gate_type,
                                        spec["down_t"], spec["activation"], cut) for c, (cut, _) in zip(const, cuts)]
        cells[f"sparse {s:g}"] = core.compile_model(ov.Model(outs, [xp]), "CPU", config)
        kept = statistics.mean(k for _, k in cuts)
        nbytes[f"sparse {s:g}"] = (f * gate_b + kept * (up_b + down_t_b), kept)
    return cells, nbytes


def child(spec: dict) -> dict:
    """One (dims, threads) cell group in this process: every gate/up type, the cells timed in turn."""
    os.sched_setaffinity(0, set(range(spec["threads"])))
    from fleet_common import kernels

    rng = np.random.default_rng(0)
    d, _ = DIMS[spec["dims"]]
    x = rng.standard_normal((1, d)).astype(np.float32)
    out = {"isa": kernels.active_isa(), "types": {}}
    for gate_type in spec["types"]:
        layers = ffn_weights(spec, gate_type, rng)
        cells, nbytes = models(spec, gate_type, layers, x)
        requests = {name: c.create_infer_request() for name, c in cells.items()}
        for req in requests.values():
            for _ in range(3):
                req.infer([x])
        times = {name: [] for name in requests}
        for _ in range(spec["runs"]):  # in turn: the host's drift meets every cell alike
            for name, req in requests.items():
                t0 = time.perf_counter()
                req.infer([x])
                times[name].append(time.perf_counter() - t0)
        out["types"][gate_type] = {name: {"us": statistics.median(t) / spec["layers"] * 1e6, "bytes": nbytes[name][0],
                                          "kept": nbytes[name][1]} for name, t in times.items()}
        del cells, requests, layers
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def realtime_prefix() -> list[str]:
    """``chrt -f 50`` if this user may run SCHED_FIFO, else nothing (and a note on stderr)."""
    if subprocess.run(["chrt", "-f", "50", "true"], capture_output=True, check=False).returncode == 0:
        return ["chrt", "-f", "50"]
    print("--realtime: SCHED_FIFO is not permitted here; running at normal priority", file=sys.stderr)
    return []


def run_child(spec: dict, prefix: list[str]) -> dict:
    cmd = [*prefix, sys.executable, "-m", "bench.kernels.sparse_ffn_bench", "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=harness.repo_env(), check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the sparse FFN child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def cell_rows(spec: dict, result: dict, report: dict) -> list[list]:
    """The table's rows (and the report's cells) of one child's result."""
    rows = []
    for gate_type, cells in result["types"].items():
        dense = cells["dense"]
        for name, cell in cells.items():
            s = None if name == "dense" else float(name.split()[1])
            ratio, byte_ratio = cell["us"] / dense["us"], cell["bytes"] / dense["bytes"]
            goal = GOALS.get(s)
            report["cells"].append({"dims": spec["dims"], "threads": spec["threads"], "isa": result["isa"],
                                    "gate_up": gate_type, "down_t": spec["down_t"], "dense_down": spec["dense_down"],
                                    "cell": name, "sparsity": s, **cell, "time_ratio": ratio, "bytes_ratio": byte_ratio,
                                    "goal": goal, "met": None if goal is None else ratio <= goal})
            rows.append([spec["dims"], spec["threads"], gate_type, spec["down_t"], name, f"{cell['us']:.0f}",
                         f"{ratio:.2f}", f"{cell['bytes'] / 1e6:.1f}", f"{byte_ratio:.2f}",
                         None if goal is None else f"<= {goal}",
                         None if goal is None else ("yes" if ratio <= goal else "NO")])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="1b,8b", help=f"FFN shapes: {', '.join(DIMS)}")
    p.add_argument("--types", default="Q4_0,Q4_K", help="gate/up block types")
    p.add_argument("--down-t", default="Q8_0", choices=("Q8_0", "Q4_0", "F16", "BF16", "F32"))
    p.add_argument("--dense-down", help="the dense FFN's down type (default: --down-t's)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--sparsity", default="0,0.5,0.9")
    p.add_argument("--activation", default="silu", choices=("silu", "relu"),
                   help="relu drops g <= 0 whatever the threshold: a sparsity below that fraction is not reached")
    p.add_argument("--layers", type=int, help="FFNs a model (default: 4 at 1b, 2 at 8b)")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--realtime", action="store_true", help="run the children at SCHED_FIFO priority where permitted")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    dims = [d for d in args.dims.split(",") if d]
    if unknown := [d for d in dims if d not in DIMS]:
        p.error(f"--dims {','.join(unknown)}: not one of {', '.join(DIMS)}")
    prefix = realtime_prefix() if args.realtime else []
    report = {"goals": {str(k): v for k, v in GOALS.items()}, "cells": [], "children": []}
    rows = []
    for dim in dims:
        for threads in map(int, args.threads.split(",")):
            spec = {"dims": dim, "threads": threads, "types": args.types.split(","), "down_t": args.down_t,
                    "dense_down": args.dense_down or args.down_t, "activation": args.activation,
                    "sparsity": [float(s) for s in args.sparsity.split(",")], "layers": args.layers or LAYERS[dim],
                    "runs": args.runs}
            result = run_child(spec, prefix)
            report["children"].append({**spec, "isa": result["isa"], "peak_rss_mib": result["peak_rss_mib"]})
            rows += cell_rows(spec, result, report)
            print(f"{dim} T={threads}: peak RSS {result['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    print(harness.table(["dims", "threads", "gate/up", "down_t", "cell", "µs/FFN", "÷ dense", "weight MB/token",
                         "bytes ÷ dense", "goal", "met"], rows, pad=True))
    harness.write_json(args.json, "sparse_ffn", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
