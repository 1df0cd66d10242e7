"""Which weight layout OpenVINO's CPU plugin runs fastest: one decode MatMul ``[1, K] x [N, K]^T`` (Llama-3.2-1B's
``gate``/``up``: N 8192, K 2048) in each form a GGUF block type can take in an IR, side by side in one process.

A form is the constant subgraph the plugin's ``ConvertFullyConnectedToFullyConnectedCompressed`` matches
(``Constant(codes) -> Convert -> [Subtract(zero point)] -> Multiply(scale) -> Reshape``) or a plain f16 weight:

* the exact forms of the blocks fleet keeps (compiler/export.py ``_kept``): Q4_0 as i4 per 32 with an f32 scale;
  Q4_K/Q4_1 as u4 per 32 without a zero point plus the second, small product of each group's input sum with the
  group's offset (``offset``); Q8_0 (and Q6_K by default, near-exact) as i8 per 32; exact Q6_K as i8 per 16;
* the other exact forms of Q4_K/Q4_1: a float zero point per 32 (``f32 zp``), and the decompression in the other
  order, codes times scale plus offset, as the blocks store it (``Multiply -> Add``: not the plugin's pattern); the
  integer zero point OpenVINO GenAI's GGUF reader and OpenVINO's GGUF frontend use for them (``u4 zp``, which
  rounds the offsets: not exact);
* forms that would requantize the blocks (bigger groups, per channel: what NNCF writes), to show what the group size
  costs;
* each at f32 and bf16 activations, with the plugin's int8 activations ("dynamic quantization", DQ) at its default
  group (32) and off (0).

Every (form, precision, DQ) is compiled in this one process with ``--matmuls`` independent MatMuls of the same
input (their weights differ), then timed in turn, round after round, so load from other processes hits them alike.
A cell is the median over rounds of each round's median call time ÷ ``--matmuls``; "÷ f16" is the median over
rounds of the per-round ratio against the f16 weight at the same precision and DQ. GB/s is the form's bytes in the
IR (codes, scales, offsets) over the cell's time. "rel err" is the L2 error of the output against float64 of the
form's own dequantized weights (DQ's int8 activations show there; a requantizing form's own rounding does not).
``--probe`` also runs each form once in a child process with ``ONEDNN_VERBOSE=1`` and reports whether oneDNN took
the int8-activation kernel (``src_dyn_quant``): PERF_COUNT's exec type names the same ``brgemm_avx512_*`` either way.

    python bench/kernels/layout_bench.py [--shape 8192x2048] [--threads 1] [--rounds 9] [--calls 30] [--probe] [--realtime]
                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import harness


@dataclass(frozen=True)
class Form:
    """One weight layout: codes ``codes`` (i4/u4/i8/u8, or f16 for the plain weight) in groups of ``group`` along K
    (0: one group per row), scale ``scale`` (f32/f16), zero point ``zp`` (None, "int": the codes' own type, "f32"),
    or (``offset``) Q4_K's exact offsets as a second product. ``exact``: what it is for the GGUF blocks."""

    name: str
    codes: str
    group: int = 32
    scale: str = "f32"
    zp: str | None = None
    offset: bool = False
    exact: str = ""


FORMS = (
    Form("f16", "f16", exact="reference (F16)"),
    Form("Q4_0 kept: i4/32, f32 scale", "i4", exact="Q4_0 exact"),
    Form("i4/32, f16 scale", "i4", scale="f16", exact="Q4_0 exact (GenAI: f16 scale)"),
    Form("Q4_K kept: u4/32 + offset product", "u4", offset=True, exact="Q4_K/Q4_1 exact"),
    Form("u4/32, f32 zp", "u4", zp="f32", exact="Q4_K/Q4_1 exact"),
    Form("u4/32, u4 zp, f16 scale", "u4", zp="int", scale="f16", exact="rounds Q4_K (GenAI, OV GGUF frontend)"),
    Form("u4/32, scale then f32 offset", "u4", zp="add", exact="Q4_K/Q4_1 exact (w = q d + m, as stored)"),
    Form("i4/64", "i4", group=64, exact="requantizes"),
    Form("i4/128", "i4", group=128, exact="requantizes (NNCF int4 default)"),
    Form("i4/channel", "i4", group=0, exact="requantizes"),
    Form("Q8_0 kept: i8/32", "i8", exact="Q8_0 exact, Q6_K near-exact"),
    Form("i8/16", "i8", group=16, exact="Q6_K exact"),
    Form("i8/channel", "i8", group=0, exact="requantizes (NNCF int8)"),
)
BITS = {"i4": 4, "u4": 4, "i8": 8, "u8": 8, "f16": 16}


def weight(form: Form, n: int, k: int, rng: np.random.Generator):  # noqa: ANN201 - (ov.Output, f64 [N, K], bytes)
    """The form's weight subgraph ``[N, K]`` f32, its float64 dequantization and its bytes in the IR."""
    import openvino as ov
    from openvino import opset13 as op

    from compiler.gguf import pack_nibbles

    if form.codes == "f16":
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float16)
        return op.convert(op.constant(w), ov.Type.f32).output(0), w.astype(np.float64), w.nbytes
    g = form.group or k
    signed, four = form.codes.startswith("i"), BITS[form.codes] == 4
    lo, hi = (-(8 if four else 128), 8 if four else 128) if signed else (0, 16 if four else 256)
    codes = rng.integers(lo, hi, (n, k // g, g))
    store = ov.Tensor(getattr(ov.Type, form.codes), ov.Shape([n, k // g, g]))
    raw = store.data.view(np.uint8 if not signed or four else np.int8)
    raw[...] = (pack_nibbles(codes) if four else codes.astype(raw.dtype)).reshape(raw.shape)
    scale = (rng.random((n, k // g, 1)) * 0.004 + 0.001).astype({"f32": np.float32, "f16": np.float16}[form.scale])
    x, deq, nbytes = op.convert(op.constant(store), ov.Type.f32), codes.astype(np.float64), store.byte_size + scale.nbytes
    if form.zp == "add":  # the decompression in the other order: q * scale + offset (not the plugin's pattern)
        offset = (rng.standard_normal((n, k // g, 1)) * 0.01).astype(np.float32)
        s = op.multiply(x, op.constant(scale))
        x = op.reshape(op.add(s, op.constant(offset)), op.constant(np.array([n, k], np.int64)), False).output(0)
        deq = codes * scale.astype(np.float64) + offset.astype(np.float64)
        return x, deq.reshape(n, k), nbytes + offset.nbytes
    if form.zp:
        zp = rng.integers(lo, hi, (n, k // g, 1))
        if form.zp == "int":  # one code per group, packed like the codes
            zt = ov.Tensor(getattr(ov.Type, form.codes), ov.Shape([n, k // g, 1]))
            flat = zt.data.view(np.uint8).reshape(-1)
            flat[...] = pack_nibbles(zp.reshape(-1)) if four else zp.reshape(-1).astype(np.uint8)
            zc, nbytes = op.convert(op.constant(zt), ov.Type.f32), nbytes + zt.byte_size
        else:
            zc, nbytes = op.constant(zp.astype(np.float32)), nbytes + zp.size * 4
        x, deq = op.subtract(x, zc), deq - zp
    s = op.constant(scale) if form.scale == "f32" else op.convert(op.constant(scale), ov.Type.f32)
    x = op.reshape(op.multiply(x, s), op.constant(np.array([n, k], np.int64)), False).output(0)
    return x, (deq * scale.astype(np.float64)).reshape(n, k), nbytes


def offset_product(x, n: int, k: int, rng: np.random.Generator):  # noqa: ANN001, ANN201
    """Q4_K's exact offsets as compiler/export.py writes them: ``ReduceSum(x per 32) @ (m * -dmin)^T``, the
    6-bit minima ``m`` u8 [N, K/256, 8] times an f32 step per 256. Returns (output [.., N], f64 offsets [N, K/32],
    bytes)."""
    import openvino as ov
    from openvino import opset13 as op

    groups = k // 32
    m = rng.integers(0, 64, (n, groups // 8, 8)).astype(np.uint8)
    step = -(rng.random((n, groups // 8, 1)) * 0.001).astype(np.float32)
    w = op.reshape(op.multiply(op.convert(op.constant(m), ov.Type.f32), op.constant(step)),
                   op.constant(np.array([n, groups], np.int64)), False)
    sums = op.reduce_sum(op.reshape(x, op.constant(np.array([0, 0, groups, 32], np.int64)), True),
                         op.constant(np.array([-1], np.int64)), False)
    return op.matmul(sums, w, False, True).output(0), (m * step.astype(np.float64)).reshape(n, groups), m.nbytes + step.nbytes


def build(form: Form, n: int, k: int, matmuls: int, seed: int):  # noqa: ANN201 - (ov.Model, [f64 [N, K]], bytes)
    """``matmuls`` MatMuls of one input ``x`` [?, ?, K] f32, each with its own weights of ``form``."""
    import openvino as ov
    from openvino import opset13 as op

    rng = np.random.default_rng(seed)
    x = op.parameter(ov.PartialShape([-1, -1, k]), ov.Type.f32, name="x")
    outs, refs, nbytes = [], [], 0
    for _ in range(matmuls):
        w, deq, b = weight(form, n, k, rng)
        y = op.matmul(x, w, False, True).output(0)
        if form.offset:
            extra, offsets, ob = offset_product(x, n, k, rng)
            y, deq, b = op.add(y, extra).output(0), deq + np.repeat(offsets, 32, axis=1), b + ob
        outs.append(y)
        refs.append(deq)
        nbytes += b
    return ov.Model(outs, [x]), refs, nbytes // matmuls


def config(threads: int, precision: str, dq: int | None) -> dict:
    """The compile properties of a cell: a worker's latency settings, the precision hint and the DQ group."""
    cfg = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
           "INFERENCE_PRECISION_HINT": precision}
    if dq is not None:
        cfg["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq
    return cfg


def probe(form_index: int, n: int, k: int, threads: int, precision: str, dq: int | None) -> bool:
    """Whether oneDNN ran the form's MatMul with int8 activations (``src_dyn_quant`` in ``ONEDNN_VERBOSE``), in a
    child process (the variable is read when the plugin loads)."""
    code = ("import numpy as np, openvino as ov; "
            f"from bench import layout_bench as lb; m, _, _ = lb.build(lb.FORMS[{form_index}], {n}, {k}, 1, 0); "
            f"c = ov.Core().compile_model(m, 'CPU', lb.config({threads}, {precision!r}, {dq!r})); "
            f"c.create_infer_request().infer({{0: np.ones((1, 1, {k}), np.float32)}})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=harness.repo_env(ONEDNN_VERBOSE="1"))
    if run.returncode:
        raise RuntimeError(f"probe of {FORMS[form_index].name} failed:\n{run.stderr[-2000:]}")
    return bool(re.search(r"src_dyn_quant", run.stdout))


def runtime_weight(compiled) -> str:  # noqa: ANN001 - ov.CompiledModel
    """The element type the compiled model's first FullyConnected holds its weight in: the codes' (u4, i8, ...) when
    the plugin matched the compressed pattern, f32/bf16 when it folded the decompression into a float copy."""
    for node in compiled.get_runtime_model().get_ordered_ops():
        if "FullyConnected" in node.get_rt_info()["layerType"].astype(str):
            return str(node.input(1).get_source_output().get_element_type().get_type_name())
    return "none"


def measure(args: argparse.Namespace) -> list[dict]:
    """Compile every (form, precision, DQ) cell, check its output, time them in turn (module docstring)."""
    import openvino as ov

    n, k = args.shape
    core, rng = ov.Core(), np.random.default_rng(1)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    cells = []
    for i, form in enumerate(FORMS):
        model, refs, nbytes = build(form, n, k, args.matmuls, seed=i)
        for precision in args.precisions:
            for dq in args.dq:
                compiled = core.compile_model(model, "CPU", config(args.threads, precision, dq))
                req = compiled.create_infer_request()
                out = req.infer({0: x})
                err = max(np.linalg.norm(out[j][0, 0] - ref @ x[0, 0]) / np.linalg.norm(ref @ x[0, 0])
                          for j, ref in enumerate(refs))
                cells.append({"form": form.name, "exact": form.exact, "precision": precision,
                              "dq": "default" if dq is None else dq, "bytes": nbytes,
                              "bits_per_weight": nbytes * 8 / (n * k), "rel_err": float(err),
                              "runs_weight": runtime_weight(compiled), "_req": req,
                              "_index": i, "_dq": dq, "times": []})
    if args.realtime:  # only while timing: numpy's BLAS threads spin-wait, which SCHED_FIFO on one core starves
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    for _ in range(args.rounds):
        for c in cells:
            for _ in range(3):
                c["_req"].infer({0: x})  # warm after the others ran
            calls = []
            for _ in range(args.calls):
                t = time.perf_counter()
                c["_req"].infer({0: x})
                calls.append(time.perf_counter() - t)
            c["times"].append(float(np.median(calls)) / args.matmuls)
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    for c in cells:
        ref = next(r for r in cells if r["form"] == "f16" and r["precision"] == c["precision"] and r["dq"] == c["dq"])
        c["us"] = float(np.median(c["times"])) * 1e6
        c["over_f16"] = float(np.median([a / b for a, b in zip(c["times"], ref["times"])]))
        c["gb_s"] = c["bytes"] / (c["us"] * 1e3)
        if args.probe:
            c["int8_activations"] = probe(c["_index"], n, k, args.threads, c["precision"], c["_dq"])
    return [{k: v for k, v in c.items() if not k.startswith("_")} for c in cells]


def main(argv: list[str] | None = None) -> int:
    """Measure every cell and print the table (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x2048", type=lambda s: tuple(int(v) for v in s.split("x")),
                        help="N x K of the weight (N outputs, K inputs; K a multiple of 256)")
    parser.add_argument("--threads", type=int, default=1, help="INFERENCE_NUM_THREADS, and the cores pinned")
    parser.add_argument("--precisions", default="f32,bf16", type=lambda t: t.split(","))
    parser.add_argument("--dq", default="default,0", type=lambda t: [None if v == "default" else int(v)
                                                                   for v in t.split(",")],
                        help="DYNAMIC_QUANTIZATION_GROUP_SIZE values ('default': the plugin's own, 32)")
    parser.add_argument("--matmuls", type=int, default=8, help="independent MatMuls per call")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per cell and round")
    parser.add_argument("--probe", action="store_true", help="also ask oneDNN which kernel each cell ran")
    parser.add_argument("--realtime", action="store_true", help="time at SCHED_FIFO priority (root): other "
                        "processes on the pinned cores no longer preempt the timed calls")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.shape[1] % 256:
        parser.error("K must be a multiple of 256 (Q4_K's super-block)")
    os.sched_setaffinity(0, set(range(args.threads)))
    cells = measure(args)
    print(harness.table(
        ["form", "for the GGUF blocks", "activations", "DQ", "bits/weight", "runs as", "µs/MatMul", "÷ f16", "GB/s",
         "rel err",
         *(["int8 activations"] if args.probe else [])],
        [[c["form"], c["exact"], c["precision"], c["dq"], f"{c['bits_per_weight']:.2f}", c["runs_weight"], f"{c['us']:.0f}",
          f"{c['over_f16']:.2f}", f"{c['gb_s']:.1f}", f"{c['rel_err']:.1e}",
          *([("yes" if c["int8_activations"] else "no")] if args.probe else [])] for c in cells]))
    harness.write_json(args.json, "layout_bench", {"shape": list(args.shape), "threads": args.threads,
                                                   "matmuls": args.matmuls, "rounds": args.rounds, "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
