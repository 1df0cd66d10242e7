"""fleet's kernels one product at a time: each block type's decode and prefill product on this machine, as a
fraction of the measured read bandwidth, beside llama.cpp's effective read rate on a real-size GGUF, in one run.

Per thread count T (a child process pinned to cores 0..T-1, ``INFERENCE_NUM_THREADS=T``):
* **read bandwidth**: the best of 5 reads of a 1 GiB buffer (numpy's ``bitwise_xor.reduce`` over uint64, T
  threads each reading its part): what a core (or T cores) can stream from memory; the kernels' ceiling.
* **decode**: ``--matrices`` (16) products [1, K] x [N, K]^T of random blocks (default N x K = 8192 x 2048,
  Llama-3.2-1B's gate; 16 distinct matrices so they come from memory, not cache) in one OpenVINO model; the
  median of ``--runs`` inferences / 16 is the time of one product; GB/s = the matrix's bytes / that time;
  "of limit" = GB/s / read bandwidth.
* **prefill**: the same product at ``--prefill`` (512) rows, once a matrix: µs per row-token and GB/s-equivalent.
* **llama.cpp** (``--llama-cpp``, needs ``bench/build_llama_cpp.sh``): ``llama-bench -p 0 -n 32`` and
  ``-p 512 -n 0`` on ``bench/real_gguf.py``'s Llama-3.2-1B of the matching file type, same cores and
  threads; its effective read rate = the file's matrix bytes (every tensor but token_embd) x tokens/s.

    python bench/kernels/kernel_ops.py [--types Q4_0,Q4_K,Q6_K,...] [--threads 1,2] [--llama-cpp] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench import harness

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
         "F16", "BF16", "F32")
LLAMA_FILE = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q8_0": "Q8_0", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_M",
              "Q6_K": "Q6_K", "Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "F16": "F16"}  # real_gguf file type nearest each
F16_FIELDS = {  # byte offsets of each block's f16 scales (gguf-py quants.py)
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": (),
}


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """u8 [rows, row bytes] of GGUF type ``name``: random codes, finite moderate scales (f16 in [0.002, 0.02],
    MXFP4 exponents 118..129); float types from N(0, 1). Shared with tests/unit/test_kernels.py."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if per == 1:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if name == "F32":
            return w.view(np.uint8)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8)
        return gguf.quants.quantize(w, qtype).reshape(rows, -1)
    data = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scales = rng.uniform(0.002, 0.02, (rows, cols // per)).astype(np.float16)
        data[:, :, at:at + 2] = scales.view(np.uint8).reshape(rows, cols // per, 2)
    if name == "MXFP4":
        data[:, :, 0] = rng.integers(118, 130, (rows, cols // per))
    return data.reshape(rows, -1)


CHILD = r"""
import json, os, statistics, sys, threading, time
import numpy as np, openvino as ov
from openvino import opset13 as op
from fleet_common import kernels
from bench.kernels.kernel_ops import random_blocks
types, threads, n, k, matrices, runs, prefill = json.loads(sys.argv[1])
os.sched_setaffinity(0, set(range(threads)))

def bandwidth():
    buf = np.ones(1 << 27, np.uint64)  # 1 GiB
    parts = np.array_split(buf, threads)
    best = float("inf")
    for _ in range(5):
        ts = [threading.Thread(target=np.bitwise_xor.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts: t.start()
        for t in ts: t.join()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9

out = {"threads": threads, "isa": kernels.active_isa(), "read_gbs": bandwidth(), "types": {}}
rng = np.random.default_rng(0)
core = kernels.new_core()
for name in types:
    blocks = [random_blocks(name, n, k, rng) for _ in range(matrices)]
    x = op.parameter([-1, k], ov.Type.f32)
    model = ov.Model([kernels.gguf_matmul(x.output(0), kernels.blocks_constant(b), name) for b in blocks], [x])
    req = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads}).create_infer_request()
    one = rng.standard_normal((1, k)).astype(np.float32)
    for _ in range(3): req.infer([one])
    times = []
    for _ in range(runs):
        t0 = time.perf_counter(); req.infer([one]); times.append(time.perf_counter() - t0)
    decode_s = statistics.median(times) / matrices
    many = rng.standard_normal((prefill, k)).astype(np.float32)
    first = ov.Model([kernels.gguf_matmul(x.output(0), kernels.blocks_constant(blocks[0]), name)], [x])
    preq = core.compile_model(first, "CPU", {"INFERENCE_NUM_THREADS": threads}).create_infer_request()
    preq.infer([many])
    ptimes = []
    for _ in range(3):
        t0 = time.perf_counter(); preq.infer([many]); ptimes.append(time.perf_counter() - t0)
    nbytes = blocks[0].nbytes
    out["types"][name] = {"bytes": nbytes, "decode_us": decode_s * 1e6, "decode_gbs": nbytes / decode_s / 1e9,
                          "prefill_ms": min(ptimes) * 1e3, "prefill_us_per_token": min(ptimes) / prefill * 1e6}
print("RESULT " + json.dumps(out))
"""


def run_child(types: list[str], threads: int, args: argparse.Namespace) -> dict:
    params = json.dumps([types, threads, args.n, args.k, args.matrices, args.runs, args.prefill])
    cmd = [sys.executable, "-c", CHILD, params]
    if args.realtime:
        cmd = ["chrt", "-f", "50", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=harness.repo_env(), check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the kernel child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def matrix_bytes(gguf_path: Path) -> int:
    """Bytes of every tensor a decode step reads in full: all but the token embedding (a row lookup)."""
    from compiler.gguf_read import read_gguf_file

    return sum(int(t.n_bytes) for t in read_gguf_file(gguf_path).tensors if t.name != "token_embd.weight")


def llama_cpp(file_type: str, threads: int, realtime: bool) -> dict:
    """llama-bench on real_gguf's Llama-3.2-1B of ``file_type``: decode and prefill tokens/s, effective GB/s."""
    from bench import real_gguf

    path = real_gguf.ensure("llama-3.2-1b", file_type)
    bench = harness.llama_cpp_tool("llama-bench")
    cells = {}
    for key, flags in (("decode", ["-p", "0", "-n", "32"]), ("prefill", ["-p", "512", "-n", "0"])):
        cmd = harness.pinned(None, [str(bench), "-m", str(path), "-t", str(threads), "-r", "3", "-o", "json", *flags])
        cmd = ["taskset", "-c", ",".join(map(str, range(threads))), *cmd]
        if realtime:
            cmd = ["chrt", "-f", "50", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        cells[key] = json.loads(proc.stdout[proc.stdout.index("["):])[0]["avg_ts"]
    nbytes = matrix_bytes(path)
    return {"file": file_type, "decode_tok_s": cells["decode"], "prefill_tok_s": cells["prefill"],
            "matrix_bytes": nbytes, "decode_gbs": nbytes * cells["decode"] / 1e9,
            "prefill_ns_per_byte_token": 1e9 / cells["prefill"] / nbytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--n", type=int, default=8192, help="outputs of each product (rows of the matrix)")
    p.add_argument("--k", type=int, default=2048, help="inputs of each product (a multiple of 256)")
    p.add_argument("--matrices", type=int, default=16)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--llama-cpp", action="store_true", help="llama-bench on real_gguf's Llama-3.2-1B beside each type")
    p.add_argument("--realtime", action="store_true", help="run the cells at SCHED_FIFO priority (root)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.k < 256 or args.k % 256:
        p.error(f"--k {args.k}: must be a multiple of 256 (a K-quant block's weights)")
    for name in ("n", "matrices", "runs", "prefill"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be at least 1")
    types = [t.upper() for t in args.types.split(",") if t]
    report = {"shape": [args.n, args.k], "matrices": args.matrices, "cells": []}
    rows = []
    for threads in map(int, args.threads.split(",")):
        child = run_child(types, threads, args)
        for name in types:
            cell = {"type": name, "threads": threads, "isa": child["isa"], "read_gbs": child["read_gbs"],
                    **child["types"][name]}
            cell["of_limit"] = cell["decode_gbs"] / child["read_gbs"]
            if args.llama_cpp and name in LLAMA_FILE:
                cell["llama_cpp"] = llama_cpp(LLAMA_FILE[name], threads, args.realtime)
                ours_ns = cell["prefill_ms"] * 1e6 / args.prefill / cell["bytes"]
                cell["decode_vs_llama_cpp"] = cell["decode_gbs"] / cell["llama_cpp"]["decode_gbs"]
                cell["prefill_vs_llama_cpp"] = cell["llama_cpp"]["prefill_ns_per_byte_token"] / ours_ns
            report["cells"].append(cell)
            lc = cell.get("llama_cpp")
            rows.append([name, threads, cell["isa"], f"{cell['decode_us']:.0f}", f"{cell['decode_gbs']:.1f}",
                         f"{child['read_gbs']:.1f}", f"{cell['of_limit']:.0%}", f"{cell['prefill_us_per_token']:.1f}",
                         f"{lc['decode_gbs']:.1f} ({lc['file']})" if lc else None,
                         f"{cell['decode_vs_llama_cpp']:.2f}x" if lc else None,
                         f"{cell['prefill_vs_llama_cpp']:.2f}x" if lc else None])
    print(harness.table(["type", "threads", "isa", "decode µs", "GB/s", "read GB/s", "of limit", "prefill µs/token",
                         "llama.cpp GB/s (file)", "decode vs llama.cpp", "prefill vs llama.cpp"], rows, pad=True))
    harness.write_json(args.json, "kernel_ops", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
