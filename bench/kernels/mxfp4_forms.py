"""MXFP4's forms on OpenVINO's CPU plugin (compiler/gguf_mxfp4.py): which one each op runs compressed, its exactness
and its speed, for one dense matrix (FullyConnected) and one Mixture-of-Experts block (GatherMatmul).

Weights are random MXFP4 blocks made by gguf-py's quantizer (``gguf.quants.quantize``) of N(0, 0.05) values; the
reference is gguf-py's dequantization, in f64. Forms:

* ``f4e2m1 x f8e8m0``: the file's E2M1 codes and E8M0 scale bytes as they are (compiler/export.py ``_kept``);
* ``i8 x 2^(e-128)``: the doubled E2M1 values as i8 per 32 with an f32 scale (``MXFP4_I8``, the experts' form);
* ``f16``: the dequantized values as fp16 (the form MXFP4 had before: exact here, 16 bits a weight);
* ``i4/32`` (dense only): Q4_0's kept form at the same shape, for scale (not MXFP4's values).

Dense: one MatMul [1, K] x [N, K]^T; MoE: compiler/layers.py ``moe_tiled`` (the tiled block the plugin turns into
GatherMatmul) of E experts [I, H] / [H, I], top k, one token. Each cell is compiled in this process at f32
inference precision, with the plugin's default dynamic quantization (int8 activations where its kernel has them)
and with it off (``--dq 0``); "runs as" is the element type of the weight input of the compiled FullyConnected /
GatherMatmul (its codes' when compressed, f32 when the plugin folded the decompression into a float copy).
Timing: ``--rounds`` rounds, every cell ``--calls`` calls in turn, a cell's time the median of its round medians,
"x f16" the median of per-round ratios against the f16 cell of the same kind and setting.

    python bench/kernels/mxfp4_forms.py [--dense 2048x2048] [--moe 32x1024x1024x4] [--threads 1] [--rounds 7]
                                [--calls 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import harness  # noqa: E402

FORMS = ("f4e2m1 x f8e8m0", "i8 x 2^(e-128)", "f16", "i4/32")


def mxfp4(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks of a [rows, cols] weight: (uint8 [rows, cols / 32, 17], gguf-py's values f64)."""
    import gguf

    raw = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                               gguf.GGMLQuantizationType.MXFP4)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(rows, cols)
    return raw.reshape(rows, cols // 32, 17), values.astype(np.float64)


def weight(form: str, shape: tuple[int, ...], rng: np.random.Generator):  # noqa: ANN201 - (ov.Output, f64 values)
    """A weight [*lead, rows, cols] in ``form`` as an f32 graph value and its f64 values (module docstring)."""
    import openvino as ov
    from openvino import opset13 as op

    from compiler.gguf import pack_nibbles
    from compiler.gguf_mxfp4 import mxfp4_blocks

    *lead, rows, cols = shape
    n = int(np.prod(lead, dtype=np.int64)) * rows
    grouped = [*lead, rows, cols // 32, 32]
    if form == "i4/32":
        codes = rng.integers(-8, 8, (n, cols // 32, 32))
        scale = (rng.random((n, cols // 32, 1)) * 0.004 + 0.001).astype(np.float32)
        store = ov.Tensor(ov.Type.i4, ov.Shape(grouped))
        store.data.view(np.uint8).reshape(-1)[:] = pack_nibbles(codes).reshape(-1)
        x = op.multiply(op.convert(op.constant(store), ov.Type.f32), op.constant(scale.reshape(*grouped[:-1], 1)))
        return op.reshape(x, op.constant(np.array(shape, np.int64)), False).output(0), \
            (codes * scale.astype(np.float64)).reshape(shape)
    raw, values = mxfp4(n, cols, rng)
    if form == "f16":
        return op.convert(op.constant(values.astype(np.float16).reshape(shape)), ov.Type.f32).output(0), \
            values.reshape(shape)
    kind = "MXFP4" if form.startswith("f4e2m1") else "MXFP4/i8"
    doubled, scale, codes, e = mxfp4_blocks(kind, raw, "bench")
    if kind == "MXFP4":
        store = ov.Tensor(ov.Type.f4e2m1, ov.Shape(grouped))
        store.data.view(np.uint8).reshape(-1)[:] = pack_nibbles(codes).reshape(-1)
        scales = ov.Tensor(ov.Type.f8e8m0, ov.Shape([*grouped[:-1], 1]))
        scales.data.view(np.uint8).reshape(-1)[:] = e.reshape(-1)
        s = op.convert(op.constant(scales), ov.Type.f32)
    else:
        store = ov.Tensor(doubled.reshape(grouped))
        s = op.constant(scale.reshape(*grouped[:-1], 1))
    x = op.multiply(op.convert(op.constant(store), ov.Type.f32), s)
    return op.reshape(x, op.constant(np.array(shape, np.int64)), False).output(0), values.reshape(shape)


def dense(form: str, n: int, k: int, rng: np.random.Generator):  # noqa: ANN201 - (ov.Model, reference callable)
    """One MatMul of x [1, 1, K] with a [N, K] weight of ``form``; the reference x -> x @ W^T in f64."""
    import openvino as ov
    from openvino import opset13 as op

    x = op.parameter(ov.PartialShape([-1, -1, k]), ov.Type.f32, name="x")
    w, values = weight(form, (n, k), rng)
    return ov.Model([op.matmul(x, w, False, True)], [x]), lambda v: v[0].astype(np.float64) @ values.T


def moe(form: str, experts: int, hidden: int, inter: int, top: int, rng: np.random.Generator):  # noqa: ANN201
    """compiler/layers.py ``moe_tiled`` over ``experts`` SwiGLU experts in ``form``, top ``top`` of a softmax over
    router logits given as an input; the reference the chosen experts' outputs in f64."""
    import openvino as ov
    from openvino import opset13 as op

    from compiler.layers import i64, moe_tiled

    parts = {part: weight(form, (experts, *shape), rng) for part, shape in
             (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))}
    x = op.parameter(ov.PartialShape([-1, hidden]), ov.Type.f32, name="x")
    logits = op.parameter(ov.PartialShape([-1, experts]), ov.Type.f32, name="logits")
    chosen = op.topk(op.softmax(logits, -1), i64(top), axis=-1, mode="max", sort="value",
                     index_element_type=ov.Type.i64)
    out = moe_tiled(x.output(0), chosen.output(0), chosen.output(1), {p: w for p, (w, _) in parts.items()}, experts)

    def reference(inputs: list[np.ndarray]) -> np.ndarray:
        h, r = inputs[0][0].astype(np.float64), inputs[1][0].astype(np.float64)
        p = np.exp(r - r.max()) / np.exp(r - r.max()).sum()
        y = np.zeros(hidden)
        for e in np.argsort(-p)[:top]:
            g, u = parts["gate"][1][e] @ h, parts["up"][1][e] @ h
            y += p[e] * (parts["down"][1][e] @ (g / (1 + np.exp(-g)) * u))
        return y

    return ov.Model([out], [x, logits]), reference


def runs_as(compiled, kind: str) -> str:  # noqa: ANN001 - ov.CompiledModel
    """The element type of the weight input of the compiled model's first ``kind`` node."""
    for node in compiled.get_runtime_model().get_ordered_ops():
        if node.get_rt_info()["layerType"].astype(str) == kind:
            return node.input(1).get_source_output().get_element_type().get_type_name()
    return "none"


def measure(args: argparse.Namespace) -> list[dict]:
    """Compile, check and time every (kind, form, dynamic quantization) cell (module docstring)."""
    import openvino as ov

    core, rng = ov.Core(), np.random.default_rng(0)
    n, k = args.dense
    experts, hidden, inter, top = args.moe
    inputs = {"dense": [rng.standard_normal((1, 1, k)).astype(np.float32)],
              "moe": [rng.standard_normal((1, hidden)).astype(np.float32),
                      rng.standard_normal((1, experts)).astype(np.float32)]}
    cells = []
    for kind in ("dense", "moe"):
        for form in FORMS if kind == "dense" else FORMS[:3]:
            model, reference = dense(form, n, k, rng) if kind == "dense" else \
                moe(form, experts, hidden, inter, top, rng)
            want = reference(inputs[kind])
            for dq in (None, 0):
                cfg = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": args.threads,
                       "INFERENCE_PRECISION_HINT": "f32"}
                if dq is not None:
                    cfg["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq
                compiled = core.compile_model(model, "CPU", cfg)
                req = compiled.create_infer_request()
                got = req.infer(inputs[kind])[0].reshape(-1)
                err = float(np.abs(got - want.reshape(-1)).max() / np.abs(want).max())
                cells.append({"kind": kind, "form": form, "dq": "default" if dq is None else 0, "rel_err": err,
                              "runs_as": runs_as(compiled, "FullyConnected" if kind == "dense" else "GatherMatmul"),
                              "times": [], "_req": req, "_inputs": inputs[kind]})
    for _ in range(args.rounds):
        for c in cells:
            for _ in range(3):
                c["_req"].infer(c["_inputs"])
            calls = []
            for _ in range(args.calls):
                t = time.perf_counter()
                c["_req"].infer(c["_inputs"])
                calls.append(time.perf_counter() - t)
            c["times"].append(float(np.median(calls)))
    for c in cells:
        ref = next(r for r in cells if (r["kind"], r["form"], r["dq"]) == (c["kind"], "f16", c["dq"]))
        c["us"] = float(np.median(c["times"])) * 1e6
        c["x_f16"] = float(np.median([a / b for a, b in zip(c["times"], ref["times"])]))
    return [{key: v for key, v in c.items() if not key.startswith("_")} for c in cells]


def main(argv: list[str] | None = None) -> int:
    """Measure every cell, print the table, write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape = lambda s: tuple(int(v) for v in s.split("x"))  # noqa: E731
    parser.add_argument("--dense", default="2048x2048", type=shape, help="N x K of the dense weight")
    parser.add_argument("--moe", default="32x1024x1024x4", type=shape, help="experts x hidden x width x top-k")
    parser.add_argument("--threads", type=int, default=1, help="INFERENCE_NUM_THREADS, and the cores pinned")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per cell and round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.dense[1] % 32 or args.moe[1] % 32 or args.moe[2] % 32:
        parser.error("K, hidden and width must be multiples of 32 (an MXFP4 block)")
    os.sched_setaffinity(0, set(range(args.threads)))
    cells = measure(args)
    print(harness.table(["op", "form", "int8 activations", "runs as", "µs", "x f16", "rel err"],
                        [[c["kind"], c["form"], c["dq"], c["runs_as"], f"{c['us']:.0f}", f"{c['x_f16']:.2f}",
                          f"{c['rel_err']:.1e}"] for c in cells]))
    harness.write_json(args.json, "mxfp4_forms", {"args": {k: v for k, v in vars(args).items() if k != "json"},
                                                  "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
