"""fleet's kernels (kernels/, the fleet_gguf.GgufMatMul op) against float64 references, through OpenVINO.

For every block type, every instruction set this CPU runs (FLEET_KERNEL_ISA), odd and even shapes, M in
{1, 2, 3, 5, 8, 64} activation rows and 1 and 2 threads:
- int8 mode: within 1e-6 (relative L2) of float64 (gguf-py's dequantized blocks) x (the activations quantized
  as the kernels quantize them: per 32 values, or 256 for the 256-weight types, d = max|x| / 127,
  q = rint(x 127 / max|x|));
- f32 mode: within 1e-6 of float64 (dequantized blocks) x (the activations as they are);
- invariance, bitwise: each row's result is the same computed alone, in any batch, and on 1 or 2 threads.
"""

from __future__ import annotations

import os
import zlib

import gguf
import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as op

from bench.kernels.kernel_ops import random_blocks
from fleet_common import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="fleet's kernels are not built")

ROWS = (1, 2, 3, 5, 8, 64)
# (N outputs, K inputs in blocks): odd and even counts of both
SHAPES = ((7, 3), (16, 2), (5, 1), (13, 5))
RTOL = 1e-6


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def block_size(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block of type ``name``."""
    return gguf.GGML_QUANT_SIZES[qtype(name)]


def dequantized(name: str, blocks: np.ndarray, cols: int) -> np.ndarray:
    """float64 [rows, cols]: gguf-py's dequantization of the blocks (an independent reading of the format)."""
    return gguf.quants.dequantize(blocks, qtype(name)).reshape(blocks.shape[0], cols).astype(np.float64)


def quantized_activations(x: np.ndarray, group: int = 32) -> np.ndarray:
    """float64: x quantized as the kernels do (per ``group`` values, 32, or 256 for the 256-weight types:
    d = max|x| / 127, in f16 for groups of 32, q = rint(x * (127 / max|x|)))."""
    g = x.astype(np.float32).reshape(*x.shape[:-1], -1, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(g * inv), -127, 127)
    d = (amax / np.float32(127)).astype(np.float32)
    if group == 32:  # kept in f16 as llama.cpp's block_q8_0 keeps it (to nearest even), f32 where f16 overflows
        with np.errstate(over="ignore"):
            d16 = d.astype(np.float16).astype(np.float32)
        d = np.where(np.isinf(d16), d, d16)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def compiled_product(name: str, blocks: np.ndarray, cols: int, threads: int) -> ov.CompiledModel:
    """A model of two GgufMatMul over the same blocks, int8 and f32 mode, compiled on ``threads``."""
    x = op.parameter([-1, cols], ov.Type.f32, name="x")
    w = kernels.blocks_constant(blocks)
    outs = [kernels.gguf_matmul(x.output(0), w, name, precision) for precision in ("int8", "f32")]
    model = ov.Model(outs, [x])
    return kernels.new_core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads})


def runnable_isas() -> list[str]:
    from ctypes import CDLL, c_char_p  # noqa: F401 - cpu_has is not exported: probe by forcing each set

    found = []
    for isa in kernels.ISAS:
        os.environ["FLEET_KERNEL_ISA"] = isa
        try:
            kernels.active_isa()
            found.append(isa)
        except kernels.KernelsUnavailable:
            pass
        finally:
            del os.environ["FLEET_KERNEL_ISA"]
    return found


ISAS = runnable_isas() if kernels.available() else []


@pytest.fixture
def isa(request, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("FLEET_KERNEL_ISA", request.param)
    assert kernels.active_isa() == request.param
    return request.param


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", kernels.BLOCK_TYPES)
def test_products_match_float64_and_do_not_depend_on_batch_or_threads(name: str, isa: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{name} {isa}".encode()))
    per = block_size(name)[0]
    for n, kblocks in SHAPES:
        cols = kblocks * max(per, 32) + (3 if per == 1 else 0)  # float types: an odd K too
        blocks = random_blocks(name, n, cols, rng)
        w = dequantized(name, blocks, cols)
        x = rng.standard_normal((max(ROWS), cols)).astype(np.float32)
        x[1] *= 40.0  # rows of other magnitudes
        x[2, : cols // 2] = 0.0  # and zero groups
        ref_int8 = (quantized_activations(x, min(per, 256)) if per > 1 else x.astype(np.float64)) @ w.T
        ref_f32 = x.astype(np.float64) @ w.T
        solo = {}
        for threads in (1, 2):
            compiled = compiled_product(name, blocks, cols, threads)
            for m in ROWS:
                y8, y32 = (compiled(x[:m])[i] for i in range(2))
                assert rel_err(y8, ref_int8[:m]) <= RTOL, (name, isa, n, cols, m, threads, rel_err(y8, ref_int8[:m]))
                assert rel_err(y32, ref_f32[:m]) <= RTOL, (name, isa, n, cols, m, threads, rel_err(y32, ref_f32[:m]))
                for i in range(m):  # bitwise: row i alone, in this batch, on 1 or 2 threads
                    key = (i,)
                    if key not in solo:
                        solo[key] = tuple(compiled(x[i:i + 1])[j][0] for j in range(2))
                    assert np.array_equal(y8[i], solo[key][0]), (name, isa, cols, m, threads, i)
                    assert np.array_equal(y32[i], solo[key][1]), (name, isa, cols, m, threads, i)


def test_the_simd_kernels_agree_with_the_scalar_oracle(monkeypatch) -> None:  # noqa: ANN001
    rng = np.random.default_rng(7)
    for name in kernels.BLOCK_TYPES:
        per = block_size(name)[0]
        cols = 3 * max(per, 32)
        blocks = random_blocks(name, 9, cols, rng)
        x = rng.standard_normal((5, cols)).astype(np.float32)
        compiled = compiled_product(name, blocks, cols, 1)
        monkeypatch.setenv("FLEET_KERNEL_ISA", "scalar")
        oracle = [compiled(x)[i] for i in range(2)]
        for isa in ISAS:
            monkeypatch.setenv("FLEET_KERNEL_ISA", isa)
            for i in range(2):
                assert rel_err(compiled(x)[i], oracle[i]) <= RTOL, (name, isa, i)


def test_a_bad_shape_or_type_is_refused_by_name() -> None:
    x = op.parameter([-1, 64], ov.Type.f32)
    with pytest.raises(RuntimeError, match="Q4_0 rows of K = 64 take 36 bytes, not 35"):
        kernels.gguf_matmul(x.output(0), kernels.blocks_constant(np.zeros((4, 35), np.uint8)), "Q4_0")
    with pytest.raises(ValueError, match="do not run IQ2_XXS"):
        kernels.gguf_matmul(x.output(0), kernels.blocks_constant(np.zeros((4, 36), np.uint8)), "IQ2_XXS")
    with pytest.raises(RuntimeError, match="not 35"):  # K not a whole number of blocks
        y = op.parameter([-1, 48], ov.Type.f32)
        kernels.gguf_matmul(y.output(0), kernels.blocks_constant(np.zeros((4, 35), np.uint8)), "Q4_0")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_one_op_of_several_tensors_gives_each_separate_op_s_bits(isa: str) -> None:
    """A layer's q, k, v (or gate and up) as one GgufMatMul: types of both activation groups (32 and 256) and a
    float one, odd row counts, 1..17 activation rows, 1 and 2 threads; each output equal bit for bit to its own op's,
    in both precisions."""
    rng = np.random.default_rng(zlib.crc32(isa.encode()))
    cols = 512
    tensors = [("Q4_K", 37), ("Q6_K", 9), ("Q8_0", 66), ("F16", 5), ("Q4_0", 1)]
    blocks = [random_blocks(name, n, cols, rng) for name, n in tensors]
    x = rng.standard_normal((17, cols)).astype(np.float32)
    for precision in kernels.PRECISIONS:
        for threads in (1, 2):
            p = op.parameter([-1, cols], ov.Type.f32)
            consts = [kernels.blocks_constant(b) for b in blocks]
            fused = kernels.gguf_matmuls(p.output(0), consts, [name for name, _ in tensors], precision)
            apart = [kernels.gguf_matmul(p.output(0), c, name, precision) for c, (name, _) in zip(consts, tensors)]
            compiled = kernels.new_core().compile_model(ov.Model(fused + apart, [p]), "CPU",
                                                        {"INFERENCE_NUM_THREADS": threads})
            for m in (1, 3, 17):
                out = compiled(x[:m])
                for i, (name, n) in enumerate(tensors):
                    assert out[i].shape == (m, n)
                    assert np.array_equal(out[i], out[len(tensors) + i]), (isa, precision, threads, m, name)


def test_several_tensors_need_as_many_types() -> None:
    x = op.parameter([-1, 64], ov.Type.f32)
    q4 = kernels.blocks_constant(np.zeros((4, 36), np.uint8))
    with pytest.raises(ValueError, match="2 tensors but 1 block types"):
        kernels.gguf_matmuls(x.output(0), [q4, q4], ["Q4_0"])
    with pytest.raises(RuntimeError, match="Q8_0 rows of K = 64 take 68 bytes, not 36"):  # the second tensor's
        kernels.gguf_matmuls(x.output(0), [q4, q4], ["Q4_0", "Q8_0"])


def test_an_isa_this_cpu_lacks_is_an_error(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FLEET_KERNEL_ISA", "sse9")
    with pytest.raises(kernels.KernelsUnavailable, match="FLEET_KERNEL_ISA='sse9'"):
        kernels.active_isa()


@pytest.mark.parametrize("name", ("Q4_0", "Q4_K", "Q6_K", "Q8_0", "MXFP4", "IQ4_XS", "F16"))
def test_experts_read_only_the_chosen_and_match_float64(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    experts, n, per = 6, 9, max(block_size(name)[0], 32)
    cols = 2 * per
    blocks = np.stack([random_blocks(name, n, cols, rng) for _ in range(experts)])  # [E, N, row bytes]
    w = np.stack([dequantized(name, b, cols) for b in blocks])  # [E, N, K] float64
    x = op.parameter([-1, cols], ov.Type.f32)
    chosen = op.parameter([-1, 2], ov.Type.i32)
    outs = [kernels.gguf_moe_matmul(x.output(0), kernels.blocks_constant(blocks), chosen.output(0), name, precision)
            for precision in ("int8", "f32")]
    compiled = kernels.new_core().compile_model(ov.Model(outs, [x, chosen]), "CPU", {"INFERENCE_NUM_THREADS": 2})
    tokens = rng.standard_normal((5, cols)).astype(np.float32)
    picks = np.array([[0, 3], [3, 5], [5, 0], [3, 3], [1, 4]], np.int32)  # expert 3 three times, 2 never
    y8, y32 = compiled([tokens, picks])[0], compiled([tokens, picks])[1]
    xq = quantized_activations(tokens, block_size(name)[0]) if block_size(name)[0] > 1 else tokens.astype(np.float64)
    for t in range(5):
        for j in range(2):
            e = picks[t, j]
            assert rel_err(y8[t, j], xq[t] @ w[e].T) <= RTOL, (name, t, j)
            assert rel_err(y32[t, j], tokens[t].astype(np.float64) @ w[e].T) <= RTOL, (name, t, j)
    alone = compiled([tokens[3:4], picks[3:4]])[0]  # a token's rows do not depend on the others routed with it
    assert np.array_equal(alone[0], y8[3])
    with pytest.raises(RuntimeError, match="expert 6 is outside"):
        compiled([tokens[:1], np.array([[0, 6]], np.int32)])


@pytest.mark.parametrize("name", ("Q4_1", "Q4_K", "Q6_K", "Q8_0", "MXFP4", "BF16"))
def test_embedding_rows_are_the_dequantized_blocks(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(b"embedding " + name.encode()))
    vocab, cols = 11, 2 * max(block_size(name)[0], 32)
    table = random_blocks(name, vocab, cols, rng)
    ids = op.parameter([-1, -1], ov.Type.i64)
    out = kernels.gguf_embedding(kernels.blocks_constant(table), ids.output(0), name)
    compiled = kernels.new_core().compile_model(ov.Model([out], [ids]), "CPU")
    picks = np.array([[3, 0, 10], [7, 7, 1]], np.int64)
    rows = compiled([picks])[0]
    assert rows.shape == (2, 3, cols)
    assert rel_err(rows, dequantized(name, table, cols)[picks]) <= 1e-7
    with pytest.raises(RuntimeError, match="token id 11 is outside the vocabulary"):
        compiled([np.array([[11]], np.int64)])
