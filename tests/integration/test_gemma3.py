"""Gemma 3's text decoder (``Gemma3ForCausalLM``, ``gemma3_text``; compiler/arch.py) computes what transformers
computes, in test_architectures' way: a tiny random model made by transformers (4 layers, grouped KV heads, RMSNorm
as x (1 + w) with four norms a layer and q/k norms, GeGLU with tanh GELU, ``query_pre_attn_scalar`` 24 against
head_dim 16, embeddings x sqrt(64), tied head; local layers with an 8-token sliding window and their own RoPE base
(10000) 2:1 among global ones with linear-scaled RoPE (1e6, factor 2)), saved in bf16 and f32 with the demo
tokenizer, built into 1, 2 and 3 stages.

* Logits: the 64-token sequence fed as test_architectures' ``chained_logits`` feeds it (a 40-token prefill, then
  chunks with rejected draft tokens hidden by the next chunk), so the window (8) is exercised by logical position
  across hidden slots, against transformers' f32 (eager) logits, within ``ATOL`` = 1e-4.
* Greedy: 32 tokens through a real 2-stage fleet of the bf16 build equal transformers' greedy tokens, the chat
  prompt (longer than the window) included.
* Config reading: the local/global layers, both RoPE frequency sets and the scale as transformers has them; Gemma 2's
  softcapping refused.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from .test_architectures import (
    ATOL,
    COMMON,
    MAX_POSITIONS,
    NEW_TOKENS,
    PROMPT,
    SEED,
    SEQ,
    STAGE_SPECS,
    TOKENIZER,
    VOCAB,
    WEIGHT_STD,
    chained_logits,
    fleet_greedy,
    hf_greedy,
    reference_model,
)

pytestmark = pytest.mark.integration

WINDOW = 8  # far shorter than the 64-token sequence and the chat prompt: every local layer hides keys
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]  # 2:1 (Gemma 3: 5:1)
OPTIONS = dict(head_dim=16, sliding_window=WINDOW, layer_types=LAYERS, rope_theta=1_000_000.0,
               rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               query_pre_attn_scalar=24, tie_word_embeddings=True)


def make_gemma3(folder: Path, demo_hf: Path, **overrides) -> dict[str, Path]:
    """The random Gemma3ForCausalLM as ``folder/gemma3-f32`` and ``-bf16`` (test_architectures' make_tiny_model:
    weights ~N(0, WEIGHT_STD); norm weights N(0, 0.2) around 0 (Gemma stores w of 1 + w: transformers initializes
    them to 0), so the 1 + w is what the builder must apply). ``overrides``: config fields over ``OPTIONS``."""
    import shutil

    import torch
    import transformers

    config = transformers.Gemma3TextConfig(**{**COMMON, **OPTIONS, **overrides})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, WEIGHT_STD)
            else:
                p.copy_(0.2 * torch.randn_like(p))
    out = {}
    for dtype in ("f32", "bf16"):
        path = folder / f"gemma3-{dtype}"
        model.to(torch.float32 if dtype == "f32" else torch.bfloat16).save_pretrained(path)
        for file in TOKENIZER:
            shutil.copy(demo_hf / file, path / file)
        out[dtype] = path
    return out


class Zoo:
    def __init__(self, root: Path, demo_hf: Path) -> None:
        self.root, self.demo_hf = root, demo_hf
        rng = np.random.default_rng(SEED)
        self.ids = rng.integers(3, VOCAB, SEQ)
        self.garbage = rng.integers(3, VOCAB, 8)

    @cache  # noqa: B019
    def sources(self) -> dict[str, Path]:
        return make_gemma3(self.root / "hf", self.demo_hf)

    @cache  # noqa: B019
    def reference(self, dtype: str):  # noqa: ANN201
        return reference_model(self.sources()[dtype])

    @cache  # noqa: B019
    def build(self, dtype: str, stages: int) -> Path:
        from compiler.build import build

        out = self.root / "builds" / f"gemma3-{dtype}-{stages}"
        build(self.sources()[dtype], out, **STAGE_SPECS[stages])
        return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("gemma3"), demo_hf)


def test_config_reads_gemma3(zoo):
    """The builder's config of the tiny model: local/global layers, each kind's RoPE frequencies and the global
    ones' scale as transformers' rotary embedding has them, the softmax scale, the norm offset, the embedding
    scale; the q/k and four layer norms are the tensors the build reads."""
    from compiler.arch import ModelConfig, hf_weight_names
    from compiler.weights import SafetensorsWeights

    src = zoo.sources()["bf16"]
    cfg = ModelConfig.from_folder(src)
    rotary = zoo.reference("bf16").model.rotary_emb
    assert (cfg.model_type, cfg.num_layers, cfg.kv_groups, cfg.max_context) == ("gemma3_text", 4, 2, MAX_POSITIONS)
    np.testing.assert_allclose(cfg.inv_freq, rotary.full_attention_inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(cfg.local_inv_freq, rotary.sliding_attention_inv_freq.numpy(), rtol=1e-6)
    assert not np.allclose(cfg.inv_freq, cfg.local_inv_freq)
    assert cfg.rope_scale == rotary.full_attention_attention_scaling == 1.0
    assert (cfg.sliding_window, cfg.sliding_layers) == (WINDOW, tuple(t == "sliding_attention" for t in LAYERS))
    assert (cfg.attn_scale, cfg.norm_offset, cfg.embed_scale) == (24 ** -0.5, 1.0, 8.0)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.tie_word_embeddings
    names = set(SafetensorsWeights(src).tensors)
    assert "lm_head.weight" not in names and set(hf_weight_names(cfg, 3).values()) <= names


def test_softcapping_refused():
    """Gemma 2's logit softcapping (and bidirectional attention) are refused by name, not built without."""
    from compiler.arch import ModelConfig, UnsupportedModel

    config = {"model_type": "gemma3_text", **COMMON, **OPTIONS}
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("use_bidirectional_attention", True)):
        with pytest.raises(UnsupportedModel, match=key):
            ModelConfig.from_hf(config | {key: value})
    assert ModelConfig.from_hf(config).sliding_window == WINDOW


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_gemma3_logits_match_transformers(dtype, stages, zoo):
    """Logits at all 64 positions through the chained stages, rejected slots hidden in between, are
    transformers' f32 logits within ``ATOL`` and the argmax is the same at every position."""
    import torch

    with torch.no_grad():
        expected = zoo.reference(dtype)(torch.from_numpy(zoo.ids)[None]).logits[0].numpy()
    build = zoo.build(dtype, stages)
    assert len(json.loads((build / "manifest.json").read_text())["stages"]) == stages
    got = chained_logits(build, zoo.ids, zoo.garbage)
    assert got.shape == expected.shape == (SEQ, VOCAB)
    err = np.abs(got - expected).max(axis=-1)
    assert err.max() < ATOL, f"gemma3 {dtype} {stages} stage(s): max |error| {err.max():.3g} at position " \
                             f"{int(err.argmax())} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_gemma3_fleet_greedy_matches_transformers(zoo, tmp_path):
    """A real 2-stage fleet of the bf16 build answers the chat prompt with transformers' greedy tokens."""
    from coordinator.tokenizer import ChatTokenizer

    build = zoo.build("bf16", 2)
    prompt = ChatTokenizer(build).encode_chat([{"role": "user", "content": PROMPT}])
    assert WINDOW < len(prompt) and len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference("bf16"), prompt, NEW_TOKENS)
    assert fleet_greedy(build, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)


def test_gemma3_inspect_reports_fused_attention(zoo):
    """``fleet-compiler inspect`` finds one fused stateful SDPA per layer on both stages, local layers included."""
    import subprocess

    from tests.conftest import BIN

    out = subprocess.run([str(BIN / "fleet-compiler"), "inspect", str(zoo.build("bf16", 2))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(row.endswith("ok") for row in rows), out.stdout
    assert "inspect: OK" in out.stdout
