"""GGUF's MXFP4 blocks (GGML type 39, gpt-oss's experts) as the stage builder keeps them (compiler/gguf.py).

MXFP4 (OCP Microscaling Formats v1.0; ggml's ``block_mxfp4``, gguf-py ``quants.MXFP4``): a nibble is an E2M1 code
(sign bit 3, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), in Q4_0's order,
and gguf-py's ``kvalues`` are those values doubled, times ``e8m0_to_fp32_half(e)`` = 2^(e - 128). OpenVINO's
``f4e2m1`` and ``f8e8m0`` types are the same encodings, so dense matrices keep the file's nibbles (repacked) and
scale bytes, and the CPU plugin runs them on its f4e2m1 FullyConnected kernel, exact at f32. Its Gather (the
embedding) and GatherMatmul (stacked experts) fold f4e2m1 into an f32 copy instead, so those keep the form both
take compressed: the doubled values -12..12 as i8 per 32 times 2^(e - 128) f32 (``MXFP4_I8``), exact as well
(E2M1 has 15 values on no affine grid, so no 4-bit integer form holds them). Measured (bench/kernels/mxfp4_forms.py,
OpenVINO 2026.4.1's CPU plugin, 2-core AMD EPYC, 1 thread, f32 inference): the tiled MoE block (compiler/layers.py
``moe_tiled``) of 32 experts of 1024 x 1024, top 4, one token, 0.66 ms with i8 experts against 3.4 ms with f4e2m1 ones
(every expert's decompression runs each call) and 2.7 ms as fp16 (held as f32); one 2048 x 2048 matrix in f4e2m1 0.97x
the time of its fp16 copy, the same values as i8 per 32 0.43x (int8 activations) / 0.80x (off): the f4e2m1 kernel takes
no int8 activations, so dense MXFP4 is kept in half the bytes of i8, not faster than it (docs/gguf.md, "Every kept form
on the demo", has the demo's whole-model figures). These are GPU/NPU stages' forms: a CPU stage multiplies MXFP4
matrices and experts as the file's bytes with fleet's kernels (compiler/experts.py).
Two scale bytes differ: OpenVINO reads e = 0 as 0, not 2^-127 (its weights are below 2^-124, f32 denormals: read
as 0; gguf-py's quantizer writes it only for such blocks), and e = 255 as NaN (the MX spec's; gguf-py 2^127): a
tensor with a 255 is refused.
"""

from __future__ import annotations

import numpy as np

from .weights import WeightsError

MXFP4_I8 = "MXFP4/i8"  # MXFP4 where the plugin folds f4e2m1 (the embedding's Gather, stacked experts): i8 per 32
# E2M1 code -> its value doubled (gguf-py MXFP4.kvalues, ggml's kvalues_mxfp4)
E2M1_DOUBLED = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.int8)
BLOCK_BYTES = 17  # one E8M0 byte, 16 bytes of nibbles: 32 weights


def mxfp4_blocks(kind: str, b: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MXFP4 blocks uint8 [rows, groups, 17] (one E8M0 byte, 16 bytes of E2M1 nibbles, element j in the low
    nibble of byte j and j + 16 in its high one as Q4_0's; ggml's ``block_mxfp4``) unpacked: (values, scale,
    codes, e), values the doubled E2M1 values int8 -12..12 [rows, groups, 32] and scale 2^(e - 128) f32 [rows,
    groups] (gguf-py ``MXFP4.dequantize_blocks``: ``kvalues`` x ``e8m0_to_fp32_half``, exact in f32, e = 0 and 1
    as denormals), codes the E2M1 codes uint8 0..15 [rows, groups, 32] and e the scale bytes uint8 [rows, groups]
    as they are (the f4e2m1 form). ``kind``: "MXFP4" (the f4e2m1 form) or ``MXFP4_I8``.

    Raises ``WeightsError`` naming ``name`` for a scale byte of 255 in the f4e2m1 form (NaN in the MX spec and in
    OpenVINO's f8e8m0, 2^127 in gguf-py)."""
    e = np.ascontiguousarray(b[..., 0])
    if kind == "MXFP4" and (e == 255).any():
        raise WeightsError(f"{name}: MXFP4 scale byte 255 (NaN in the MX spec and OpenVINO's f8e8m0, 2^127 in "
                           "gguf-py): not a weight the f4e2m1 form can hold")
    qs = b[..., 1:BLOCK_BYTES]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    scale = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)
    return E2M1_DOUBLED[codes], scale, codes, e
