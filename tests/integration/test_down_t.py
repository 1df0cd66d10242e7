"""The sparse FFN's transposed down projection (compiler/down_t.py): from float sources the same values, moved;
from a quantized GGUF re-quantized along the hidden axis to Q8_0 within Q8_0's rounding of the original's values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from compiler.down_t import DownTError, down_t
from compiler.source import open_source
from tests.integration.test_gguf import HIDDEN, INTER, demo_gguf, write_tiny_gguf  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

DOWN = {0: "Q4_0", 1: "Q4_K", 2: "F16", 3: "Q6_K"}  # layer -> its ffn_down's type in the tiny GGUF


def test_a_float_down_projection_is_transposed_bit_for_bit(tmp_path):
    import torch
    from safetensors.torch import save_file

    from compiler.weights import SafetensorsWeights

    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal((96, 160)).astype(np.float32))
    tensors = {f"{dtype}.weight": values.to(getattr(torch, dtype)) for dtype in ("float32", "float16", "bfloat16")}
    save_file(tensors, tmp_path / "model.safetensors")
    weights = SafetensorsWeights(tmp_path)
    for name, kind in (("float32.weight", "F16"), ("float16.weight", "F16"), ("bfloat16.weight", "BF16")):
        blocks, block_type = down_t(weights, name)
        assert block_type == kind and blocks.shape == (160, 96 * 2)
        stored = np.asarray(weights.block_bytes(name)).view(np.uint16).reshape(96, 160)
        np.testing.assert_array_equal(blocks.view(np.uint16), stored.T)  # the dense build's weights, moved


def test_a_quantized_gguf_down_projection_is_requantized_along_the_hidden_axis(demo_gguf, tmp_path):  # noqa: F811
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_gguf, vocab=400, down=DOWN)
    weights = open_source(path, tmp_path).weights
    for layer, kind in DOWN.items():
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        original = gguf.quants.dequantize(np.asarray(weights.block_bytes(name)), gguf.GGMLQuantizationType[kind])
        original = original.reshape(HIDDEN, INTER).T  # [F, H]: row i is neuron i's output column
        blocks, block_type = down_t(weights, name)
        if kind == "F16":
            assert block_type == "F16"
            np.testing.assert_array_equal(blocks.view(np.float16).reshape(INTER, HIDDEN), original)
            continue
        assert block_type == "Q8_0" and blocks.shape == (INTER, HIDDEN // 32 * 34)
        got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(INTER, HIDDEN)
        # Q8_0: d = max|w| / 127 per 32 weights, each weight within d / 2 of its value, plus d's own rounding to
        # f16 (2^-11 relative) times the code (127 at most): 0.562 d (measured worst: 0.536)
        step = np.abs(original.reshape(INTER, -1, 32)).max(axis=-1, keepdims=True) / 127
        err = np.abs(got - original).reshape(INTER, -1, 32)
        assert (err <= step * (0.5 + 127 * 2.0**-11)).all(), f"{kind}: worst {float((err / step).max()):.3f} steps"
        rel = np.linalg.norm(got - original) / np.linalg.norm(original)
        assert 0 < rel < 7e-3, f"{kind}: relative error {rel:.2e}"  # measured 5.1e-3: Gaussian rows


def test_what_cannot_be_transposed_is_named(demo_gguf, tmp_path):  # noqa: F811
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_gguf, vocab=400)
    weights = open_source(path, tmp_path).weights
    with pytest.raises(DownTError, match="model.norm.weight: the sparse FFN needs the down projection as a matrix"):
        down_t(weights, "model.norm.weight")
