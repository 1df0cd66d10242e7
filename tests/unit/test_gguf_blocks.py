"""compiler/gguf.py's kept block forms against gguf-py's dequantization (``gguf.quants.dequantize``, the
reference): for every kept type, random blocks unpacked by ``GGUFWeights.blocks`` give back gguf-py's f32
values exactly, as codes x scale (+ offset) and as the zero-point form; the codes fit the OpenVINO type they are stored as (``STORED``). MXFP4's E2M1 codes and
E8M0 bytes, decoded as the OCP MX spec defines them, are gguf-py's values too."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from compiler.gguf import (
    GROUP,
    KEPT,
    MXFP4_I8,
    STORED,
    WITH_OFFSET,
    GGUFTensor,
    GGUFWeights,
    offset_group,
)
from compiler.weights import WeightsError

Q = gguf.GGMLQuantizationType
K_FIELDS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "Q3_K": (110, (108,)),
            "Q2_K": (84, (80, 82))}  # block bytes, where its f16 d (and dmin) are
RANGE = {"i8": (-128, 127), "u8": (0, 255), "i4": (-8, 7), "u4": (0, 15), "f4e2m1": (-12, 12)}  # MXFP4: 2 E2M1
# own code ranges (MXFP4: its doubled E2M1 values)
BITS = {"MXFP4": (-12, 12), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q5_K": (0, 31), "Q3_K": (-128, 124), "Q2_K": (0, 45)}


def raw_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid ``kind`` blocks: gguf-py's quantizer where it has one, else random
    bytes with f16 scales (d, dmin) of 1e-3..3e-3 (every bit pattern of the rest is a valid block)."""
    if kind not in K_FIELDS:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q[kind])
    size, fields = K_FIELDS[kind]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in fields:
        raw[:, at:at + 2] = (rng.uniform(1, 3, (len(raw), 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def weights_of(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFWeights:
    w = GGUFWeights.__new__(GGUFWeights)  # no file: one tensor as a reader's memory map would give it
    w.folder, w._files = None, ()  # no mapped file whose pages a read gives back
    w.tensors = {"w": GGUFTensor(raw, kind, shape, 0)}
    return w


@pytest.mark.parametrize("kind", KEPT)
def test_kept_blocks_are_gguf_py_dequantization_exactly(kind):
    rng = np.random.default_rng(KEPT.index(kind))
    rows, cols = 12, 768
    raw = raw_blocks(kind, rows, cols, rng)
    theirs = gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols)
    q = weights_of(kind, raw, (rows, cols)).blocks("w", (0, rows))
    assert q.kind == kind and q.values.shape == (rows, cols // GROUP[kind], GROUP[kind])
    assert q.scale.dtype == np.float32 and q.scale.shape == q.values.shape[:2]
    low, high = RANGE[STORED[kind]]
    assert low <= q.values.min() and q.values.max() <= high
    if kind in BITS:
        assert (q.values.min(), q.values.max()) == BITS[kind]  # random blocks reach both ends
    assert (q.offset is not None) == (kind in WITH_OFFSET)
    ours = (q.values.astype(np.float32) * q.scale[..., None]).reshape(rows, cols)
    if q.offset is not None:  # one offset per offset_group(kind) weights of a row
        assert q.offset.shape == (rows, cols // offset_group(kind))
        ours = ours + np.repeat(q.offset, offset_group(kind), axis=-1)
    assert np.array_equal(ours, theirs), np.abs(ours - theirs).max()
    if kind in WITH_OFFSET:
        values, zero, scale = q.zero_point()
        assert values.shape == (rows, cols // offset_group(kind), offset_group(kind)) == (*zero.shape, values.shape[-1])
        ours = ((values.astype(np.float32) - zero[..., None]) * scale[..., None]).reshape(rows, cols)
        assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-6 * np.abs(theirs).max())


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_K", "Q3_K", "Q2_K"])
def test_kept_blocks_of_a_row_range(kind):
    """Rows [a, b) unpack as those rows of the whole."""
    raw = raw_blocks(kind, 8, 512, np.random.default_rng(7))
    w = weights_of(kind, raw, (8, 512))
    whole, part = w.blocks("w", (0, 8)), w.blocks("w", (3, 6))
    assert np.array_equal(part.values, whole.values[3:6]) and np.array_equal(part.scale, whole.scale[3:6])


def e2m1(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0) as f64, from the OCP Microscaling
    Formats (MX) v1.0 spec's definition (not gguf-py's table): subnormal m / 2 at exponent 0, else 2^(e - 1) (1 +
    m / 2)."""
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).astype(np.float64)
    return sign * np.where(exponent == 0, mantissa / 2, 2.0 ** (exponent.astype(np.float64) - 1) * (1 + mantissa / 2))


def test_mxfp4_codes_and_scale_bytes_are_the_mx_spec_s_and_gguf_py_s_values():
    """Random MXFP4 blocks (every code, every scale byte 1..254): the kept codes times 2^(e - 127) (OpenVINO's
    f4e2m1 and f8e8m0, both the MX spec's encodings) and the i8 form (doubled values times 2^(e - 128)) are
    gguf-py's values exactly; a scale byte 0 is gguf-py's denormal in the i8 form; 255 is refused in the f4e2m1
    form (NaN there), kept in the i8 form."""
    rng = np.random.default_rng(39)
    rows, cols = 254, 256
    raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = np.arange(1, 255, dtype=np.uint8)[:, None]  # row r: scale byte r + 1
    raw = raw.reshape(rows, -1)
    with np.errstate(over="ignore"):  # bytes 253, 254: 4 x 2^126 and more is beyond f32, inf for both
        theirs = gguf.quants.dequantize(raw, Q.MXFP4).reshape(rows, cols)
    w = weights_of("MXFP4", raw, (rows, cols))
    q = w.blocks("w", (0, rows))
    assert q.kind == "MXFP4" and q.e2m1.shape == (rows, cols // 32, 32) and q.e8m0.shape == (rows, cols // 32)
    assert set(np.unique(q.e2m1)) == set(range(16))
    spec = e2m1(q.e2m1) * 2.0 ** (q.e8m0.astype(np.float64)[..., None] - 127)
    with np.errstate(over="ignore"):
        assert np.array_equal(spec.reshape(rows, cols).astype(np.float32), theirs)
        assert np.array_equal((q.values.astype(np.float32) * q.scale[..., None]).reshape(rows, cols), theirs)
    raw.reshape(rows, -1, 17)[0, 0, 0] = 0  # 2^-128 times the doubled values: f32 denormals
    raw.reshape(rows, -1, 17)[1, 0, 0] = 255
    w.tensors["w"] = GGUFTensor(raw, "MXFP4", (rows, cols), 0, expert=True)  # an expert: the i8 form
    assert w.kind("w") == MXFP4_I8
    q = w.blocks("w", (0, rows))
    with np.errstate(over="ignore"):
        ours = (q.values.astype(np.float32) * q.scale[..., None]).reshape(rows, cols)
        theirs = gguf.quants.dequantize(raw, Q.MXFP4).reshape(rows, cols)
    assert q.kind == MXFP4_I8 and np.array_equal(ours[0], theirs[0]) and (ours[0, :32] != 0).any()
    assert np.array_equal(ours, theirs)
    w.tensors["w"] = GGUFTensor(raw, "MXFP4", (rows, cols), 0)
    with pytest.raises(WeightsError, match=r"^w: MXFP4 scale byte 255"):
        w.blocks("w", (0, rows))
