"""bench/kernels/sparse_model_bench.py's ReLU model: its sparsity is what it was set to for tokens it was not
calibrated on, neurons are hot and cold, coordinate 0 of the residual stays the anchor, and the GGUF copy's
names and q/k order are llama.cpp's."""

from __future__ import annotations

import numpy as np

from bench import real_gguf
from bench.kernels import sparse_model_bench as smb


def test_firing_rates_have_the_set_mean_a_cap_and_a_skew() -> None:
    rates = smb.firing_rates(8192, 0.12, np.random.default_rng(0))
    assert abs(rates.mean() - 0.12) < 1e-6
    assert rates.max() <= smb.HOT and rates.min() > 0
    hot = np.sort(rates)[::-1]
    assert hot[:1638].sum() > 0.75 * rates.sum()  # the hottest fifth gives over 3/4 of all firings


def test_one_layer_fires_at_the_set_sparsity_for_unseen_tokens() -> None:
    vocab, sparsity = 4096, 0.88
    w = smb.model_tensors(1, vocab, sparsity, seed=3)
    embed = w["model.embed_tokens.weight"]
    assert (embed[:, 0] == smb.ANCHOR).all()
    assert not w["model.layers.0.self_attn.o_proj.weight"][0].any()  # coordinate 0 is never written
    assert not w["model.layers.0.mlp.down_proj.weight"][0].any()
    tokens = np.random.default_rng(7).integers(0, vocab, 256)  # drawn apart from the calibration's
    x = smb.rms_normed(embed[tokens].astype(np.float32), real_gguf.SHAPES[smb.SHAPE].eps)
    gate = x @ w["model.layers.0.mlp.gate_proj.weight"].astype(np.float32).T
    zeros = (gate <= 0).mean()
    assert abs(zeros - sparsity) < 0.02, zeros
    per_token = (gate <= 0).mean(1)
    assert per_token.min() > sparsity - 0.08 and per_token.max() < sparsity + 0.08  # every token, not on average


def test_gguf_names_and_q_k_order_are_llama_cpp_s() -> None:
    assert smb.hf_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    assert smb.hf_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert smb.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    names = {smb.hf_name(n) for n, _ in real_gguf.tensors(real_gguf.SHAPES[smb.SHAPE], 1, 64)}
    layer = [f"model.layers.0.{role}.weight" for role in smb.GGUF_NAMES]
    assert names == {"model.embed_tokens.weight", "model.norm.weight", *layer}  # tied: no output.weight
    w = np.arange(2 * 8 * 3).reshape(2 * 8, 3)  # 2 heads of 8 rows: each head's halves interleaved
    head = smb.permute(w, 2)[:8, 0] // 3
    assert head.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
