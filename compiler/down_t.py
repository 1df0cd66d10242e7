"""The sparse FFN's transposed down projection, ``down_t`` (issue 47).

``down`` [H, F] multiplies the FFN's F neuron values into H outputs. Its GGUF blocks (and an HF tensor's rows) run
along F, so skipping the neurons that did not fire saves nothing there: every row is still read. Transposed,
``down_t`` [F, H], neuron i's contribution is its row i (H weights), and a token reads only the kept neurons'
rows (PowerInfer's ``ffn_down_t``, built the same way for the same reason).

- From a float source (an HF folder's F16/BF16/F32, a GGUF's F16/BF16/F32) the values are transposed as they are:
  no rounding, the same weights as the dense build's ``down`` (an F32 safetensors matrix as float16, as the
  kernels store every float matrix of an HF build, ``SafetensorsWeights.kernel_type``).
- From a quantized GGUF tensor (its blocks run along F) the weights are dequantized, transposed and quantized
  again along H, to ``Q8_0`` by default (gguf-py's quantizer): a second rounding, of Q8_0's size (each weight
  within 0.56 of its 32-weight block's step, max|w| / 127; ``tests/integration/test_down_t.py``), against the
  4-6 bit original's.
"""

from __future__ import annotations

import numpy as np

REQUANTIZED = "Q8_0"  # what a quantized down projection becomes along the other axis
FLOAT_WIDTH = {"F16": np.uint16, "BF16": np.uint16, "F32": np.uint32}  # a value's bits, moved as they are


class DownTError(ValueError):
    """A down projection that cannot be transposed for the sparse FFN (its shape or type), named."""


def down_t_form(source, name: str, requantized: str = REQUANTIZED) -> tuple[tuple[int, int], str]:  # noqa: ANN001
    """(shape [F, row bytes], block type) ``down_t`` gives for ``name``, from the headers only (nothing read)."""
    import gguf

    hidden, neurons = tuple(source.shape(name))
    kind = source.kernel_type(name)
    if kind in FLOAT_WIDTH:
        return (neurons, hidden * np.dtype(FLOAT_WIDTH[kind]).itemsize), kind
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[requantized]]
    return (neurons, hidden // block * size), requantized


def down_t(source, name: str, requantized: str = REQUANTIZED) -> tuple[np.ndarray, str]:  # noqa: ANN001
    """``name``'s matrix [H, F] (``source``: ``weights.SafetensorsWeights`` or ``gguf.GGUFWeights``) transposed to
    [F, H], as (u8 [F, row bytes], block type for ``fleet_common.kernels.gguf_sparse_ffn``'s ``down_t_type``).

    Float kinds keep their bits (``FLOAT_WIDTH``); a quantized one is dequantized (f32), transposed and quantized
    to ``requantized`` (``Q8_0`` or ``Q4_0``). Reads the whole matrix (H x F x 4 bytes at most while it works:
    235 MB for Llama-3-8B's 4096 x 14336). Raises ``DownTError`` naming the tensor when it is not a matrix, its
    type has no kernel, or H is not a multiple of the requantized type's block (32)."""
    import gguf

    kind = source.kernel_type(name)
    shape = tuple(source.shape(name))
    if kind is None or len(shape) != 2:
        raise DownTError(f"{name}: the sparse FFN needs the down projection as a matrix of a type fleet's kernels "
                         f"multiply, not {kind or 'this tensor'} of shape {shape}")
    hidden, neurons = shape
    if kind in FLOAT_WIDTH:
        bits = np.ascontiguousarray(source.block_bytes(name)).view(FLOAT_WIDTH[kind]).reshape(hidden, neurons)
        return np.ascontiguousarray(bits.T).view(np.uint8), kind
    qtype = gguf.GGMLQuantizationType[requantized]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if hidden % block:
        raise DownTError(f"{name}: hidden size {hidden} is not a multiple of {requantized}'s {block}-weight blocks")
    values = gguf.quants.dequantize(np.asarray(source.block_bytes(name)), gguf.GGMLQuantizationType[kind])
    values = values.reshape(hidden, neurons)
    order = source.row_order(name)
    if order is not None:  # rows in the file's order: HF's row i is the file's row order[i]
        values = values[order]
    return gguf.quants.quantize(np.ascontiguousarray(values.T), qtype), requantized
