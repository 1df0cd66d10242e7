"""fleet's sparse FFN (kernels/, the fleet_gguf.GgufSparseFfn op) against float64 references, through OpenVINO.

For down_t of every type it takes (Q8_0, Q4_0, F16, BF16, F32) and gate/up of Q4_0, Q4_K, Q8_0 and F16, odd shapes
(d a multiple of the block but not of 64, F not a multiple of 4 or 8; one d past the axpy's column block), M in
{1, 2, 3, 5, 8, 64} rows, 1 and 2 threads, relu and silu, thresholds dropping ~0%, ~50% and ~90% of the neurons:
- int8 and f32 precision within RTOL (relative L2) of float64: gguf-py's dequantized blocks, the activations as
  the products take them (tests/unit/test_kernels.py), a(g) in float64 and the mask |a(g)| > threshold. The
  thresholds sit in a wide gap between the |a(g)| of both precisions, so the kernels' rounding (~1e-7 of g) cannot
  flip a neuron; RTOL covers the products' f32 rounding and the axpy's (one rounding a fma) over the F neurons;
- bitwise: each row's y is the same computed alone, in a batch of 2..64 rows, on 1 or 2 threads;
- every instruction set this CPU runs against the scalar oracle (within RTOL: the gate and up products round
  differently; the activation and the axpy are bitwise the same, which kernels/tests/check_sparse.cpp checks);
- relu with nothing dropped (positive gates) equals the whole dense FFN; bad shapes, types and attributes are
  refused by name.
"""

from __future__ import annotations

import zlib

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as op
from openvino.utils.node_factory import NodeFactory

from bench.kernels.kernel_ops import random_blocks
from fleet_common import kernels
from tests.unit.test_kernels import ISAS, block_size, dequantized, quantized_activations, rel_err

pytestmark = pytest.mark.skipif(not kernels.available(), reason="fleet's kernels are not built")

ROWS = (1, 2, 3, 5, 8, 64)
RTOL = 2e-6  # measured 0.8-3.5e-7
# (gate, up, down_t, d, F): every down_t type, gate/up of both activation groups (32 and 256, mixed), F odd
CASES = (("Q4_0", "Q4_0", "Q8_0", 96, 37), ("Q4_K", "Q4_K", "Q4_0", 768, 13), ("Q8_0", "Q4_K", "F16", 256, 21),
         ("F16", "F16", "F32", 67, 37), ("Q4_0", "Q8_0", "BF16", 160, 29), ("Q4_0", "Q4_0", "Q8_0", 1056, 45))
DROPPED = {"relu": (0.5, 0.9), "silu": (0.0, 0.5, 0.9)}  # relu drops g <= 0 (about half) at any threshold


def weights(case: tuple, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the three tensors' blocks, their float64 values [F, d]) of a case."""
    gate_t, up_t, down_t, d, f = case
    blocks = [random_blocks(t, f, d, rng) for t in (gate_t, up_t, down_t)]
    return blocks, [dequantized(t, b, d) for t, b in zip((gate_t, up_t, down_t), blocks)]


def activations(name: str, x: np.ndarray, precision: str) -> np.ndarray:
    """float64: x as a product of ``name`` blocks takes it in ``precision``."""
    per = block_size(name)[0]
    if precision == "f32" or per == 1:
        return x.astype(np.float64)
    return quantized_activations(x, min(per, 256))


def act(g: np.ndarray, activation: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-g) of a very negative g: inf, silu -0
        return np.maximum(g, 0.0) if activation == "relu" else g / (1.0 + np.exp(-g))


def gated(case: tuple, w: list[np.ndarray], x: np.ndarray, activation: str, precision: str) -> tuple[np.ndarray, ...]:
    """float64 (a(g), u) [M, F] of the case's gate and up."""
    gate_t, up_t = case[:2]
    g = activations(gate_t, x, precision) @ w[0].T
    return act(g, activation), activations(up_t, x, precision) @ w[1].T


def reference(case: tuple, w: list[np.ndarray], x: np.ndarray, activation: str, threshold: float,
              precision: str) -> np.ndarray:
    """float64 y [M, d]: the kept neurons' a(g) u times down_t."""
    a, u = gated(case, w, x, activation, precision)
    return np.where(np.abs(a) > threshold, a * u, 0.0) @ w[2]


def threshold_for(values: np.ndarray, dropped: float) -> float:
    """A threshold dropping about ``dropped`` of |values| (0: none but exact zeros): the middle of the widest gap
    between sorted |values| near that quantile, so that no value lies within 2e-6 of the largest of it (the kernels'
    a(g) are within ~1e-7 of the largest of float64's)."""
    if dropped == 0:
        return 0.0
    v = np.sort(np.concatenate([[0.0], np.abs(values).ravel()]))
    at = int(dropped * (len(v) - 1))
    for window in (len(v) // 40, len(v) // 20, len(v) // 10, len(v) // 4):  # wider where relu's zeros fill the first
        lo, hi = max(0, at - max(3, window)), min(len(v) - 1, at + max(3, window))
        i = lo + int(np.argmax(np.diff(v[lo:hi + 1])))
        if v[i + 1] - v[i] > 4e-6 * v[-1]:
            return float((v[i] + v[i + 1]) / 2)
    raise AssertionError("no wide gap near the quantile: another seed")


def sample_input(rng: np.random.Generator, d: int) -> np.ndarray:
    x = rng.standard_normal((max(ROWS), d)).astype(np.float32)
    x[1] *= 4.0  # a row of another magnitude
    x[2, : d // 2] = 0.0  # and zero groups
    return x


def compiled_ffn(case: tuple, blocks: list[np.ndarray], activation: str, threshold: float,
                 threads: int) -> ov.CompiledModel:
    """A model of two GgufSparseFfn over the same weights, int8 and f32 precision, compiled on ``threads``."""
    gate_t, up_t, down_t, d, _ = case
    x = op.parameter([-1, d], ov.Type.f32, name="x")
    w = [kernels.blocks_constant(b) for b in blocks]
    outs = [kernels.gguf_sparse_ffn(x.output(0), *w, gate_t, up_t, down_t, activation, threshold, precision)
            for precision in ("int8", "f32")]
    return kernels.new_core().compile_model(ov.Model(outs, [x]), "CPU", {"INFERENCE_NUM_THREADS": threads})


@pytest.mark.parametrize("activation", ("relu", "silu"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sparse_ffn_matches_float64_and_does_not_depend_on_batch_or_threads(case: tuple, activation: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{case} {activation}".encode()))
    blocks, w = weights(case, rng)
    x = sample_input(rng, case[3])
    both = np.concatenate([gated(case, w, x, activation, p)[0] for p in ("int8", "f32")])
    for dropped in DROPPED[activation]:
        threshold = threshold_for(both, dropped)
        refs = [reference(case, w, x, activation, threshold, p) for p in ("int8", "f32")]
        solo = {}
        for threads in (1, 2):
            compiled = compiled_ffn(case, blocks, activation, threshold, threads)
            for m in ROWS:
                ys = [compiled(x[:m])[i] for i in range(2)]
                for y, ref in zip(ys, refs):
                    err = rel_err(y, ref[:m])
                    assert err <= RTOL, (case, activation, dropped, threads, m, err)
                for i in range(m):  # bitwise: row i alone, in this batch, on 1 or 2 threads
                    if i not in solo:
                        solo[i] = [compiled(x[i:i + 1])[j][0] for j in range(2)]
                    for j in range(2):
                        assert np.array_equal(ys[j][i], solo[i][j]), (case, activation, dropped, threads, m, i, j)


def test_the_simd_kernels_agree_with_the_scalar_oracle(monkeypatch) -> None:  # noqa: ANN001
    rng = np.random.default_rng(11)
    for case in CASES[:5]:
        blocks, w = weights(case, rng)
        x = sample_input(rng, case[3])[:5]
        for activation in ("relu", "silu"):
            both = np.concatenate([gated(case, w, x, activation, p)[0] for p in ("int8", "f32")])
            compiled = compiled_ffn(case, blocks, activation, threshold_for(both, 0.5), 1)
            monkeypatch.setenv("FLEET_KERNEL_ISA", "scalar")
            oracle = [compiled(x)[i] for i in range(2)]
            for isa in ISAS:
                monkeypatch.setenv("FLEET_KERNEL_ISA", isa)
                for i in range(2):
                    assert rel_err(compiled(x)[i], oracle[i]) <= RTOL, (case, activation, isa, i)


@pytest.mark.parametrize("gate_type", ("Q4_0", "Q4_K", "F16"))
def test_relu_with_nothing_dropped_is_the_dense_ffn(gate_type: str) -> None:
    rng = np.random.default_rng(zlib.crc32(gate_type.encode()))
    d, f = (512, 19) if gate_type == "Q4_K" else (96, 19)
    gate = random_blocks(gate_type, f, d, rng)
    if gate_type == "Q4_0":  # positive weights: codes 9..15 (w = s (c - 8)), scales > 0
        codes = gate.reshape(f, -1, 18)[:, :, 2:]
        codes[:] = (rng.integers(9, 16, codes.shape) | (rng.integers(9, 16, codes.shape) << 4)).astype(np.uint8)
    elif gate_type == "Q4_K":  # w = d sc c - dmin m: dmin 0 makes every weight >= 0
        gate.reshape(f, -1, 144)[:, :, 2:4] = 0
    else:
        gate = np.abs(gate.view(np.float16)).view(np.uint8)
    up, down_t = random_blocks("Q8_0", f, d, rng), random_blocks("Q8_0", f, d, rng)
    x = np.abs(rng.standard_normal((8, d))).astype(np.float32) + 0.1
    case = (gate_type, "Q8_0", "Q8_0", d, f)
    w = [dequantized(t, b, d) for t, b in zip(case[:3], (gate, up, down_t))]
    compiled = compiled_ffn(case, [gate, up, down_t], "relu", 0.0, 2)
    for i, precision in enumerate(("int8", "f32")):
        g = activations(gate_type, x, precision) @ w[0].T
        assert (g > 1e-3).all()  # every neuron fires
        dense = (g * (activations("Q8_0", x, precision) @ w[1].T)) @ w[2]  # relu(g) = g
        assert rel_err(compiled(x)[i], dense) <= RTOL, (gate_type, precision)


def raw_ffn(inputs: list, attrs: dict) -> ov.Node:
    """GgufSparseFfn made without gguf_sparse_ffn's own checks: the op's validation speaks."""
    factory = NodeFactory()
    factory.add_extension(str(kernels.library_path()))
    base = {"gate_type": "Q4_0", "up_type": "Q4_0", "down_t_type": "Q8_0", "precision": "int8", "activation": "relu",
            "threshold": 0.0}
    return factory.create("GgufSparseFfn", inputs, {**base, **attrs})


def test_a_bad_shape_type_or_attribute_is_refused_by_name() -> None:
    x = op.parameter([-1, 64], ov.Type.f32).output(0)
    q4, q8 = kernels.blocks_constant(np.zeros((5, 36), np.uint8)), kernels.blocks_constant(np.zeros((5, 68), np.uint8))
    refused = [
        ([x, q4, q4, q8], {"down_t_type": "Q4_K"}, "down_t type 'Q4_K' is not one the sparse axpy runs"),
        ([x, q4, q4, q8], {"gate_type": "IQ2_XXS"}, "gate type 'IQ2_XXS' is not one fleet's kernels run"),
        ([x, q4, q4, q8], {"activation": "gelu"}, "activation 'gelu' is neither relu nor silu"),
        ([x, q4, q4, q8], {"threshold": -0.5}, "threshold -0.5 is not >= 0"),
        ([x, q4, q4, q8], {"precision": "int4"}, "precision 'int4' is neither int8 nor f32"),
        ([x, q4, q4, kernels.blocks_constant(np.zeros((6, 68), np.uint8))], {}, "must have the same F rows"),
        ([x, q4, kernels.blocks_constant(np.zeros((5, 35), np.uint8)), q8], {}, "up's Q4_0 rows of d = 64 take 36"),
        ([op.parameter([-1, 48], ov.Type.f32).output(0), q4, q4, q8], {"gate_type": "Q4_K"},
         "d = 48 is not a multiple of Q4_K's block of 256 weights"),
        ([x, kernels.blocks_constant(np.zeros((5, 2, 18), np.uint8)), q4, q8], {}, "gate must be blocks"),
        ([op.parameter([-1, 64], ov.Type.f16).output(0), q4, q4, q8], {}, "x must be f32"),
        ([x, q4, op.parameter([5, 36], ov.Type.f32).output(0), q8], {}, "up must be u8 blocks"),
    ]
    for inputs, attrs, message in refused:
        with pytest.raises(RuntimeError, match=message):
            raw_ffn(inputs, attrs)
    with pytest.raises(ValueError, match="down_t must be one of"):
        kernels.gguf_sparse_ffn(x, q4, q4, q8, "Q4_0", "Q4_0", "Q6_K")
    with pytest.raises(ValueError, match="activation 'gelu'"):
        kernels.gguf_sparse_ffn(x, q4, q4, q8, "Q4_0", "Q4_0", activation="gelu")
    with pytest.raises(ValueError, match="threshold nan"):
        kernels.gguf_sparse_ffn(x, q4, q4, q8, "Q4_0", "Q4_0", threshold=float("nan"))
