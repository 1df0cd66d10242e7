"""Phi-3 GGUF files (issue 28 item 2) built straight into stages, their blocks kept, against transformers in f32.

The tiny phi3 and phi4mini models of test_architectures (transformers' ``Phi3ForCausalLM``: fused ``qkv_proj``
and ``gate_up_proj``; phi4mini with LongRoPE at 4x the original context, partial rotary 0.75, tied head) are
written as llama.cpp's converter writes a ``Phi3ForCausalLM`` (convert_hf_to_gguf.py ``Phi3MiniModel``; names
from gguf-py's tensor_mapping): ``blk.N.attn_qkv`` holding q, k, v and ``blk.N.ffn_up`` holding gate then up,
rows not permuted; ``phi3.rope.dimension_count`` = int(0.75 x hidden) / heads; ``rope_factors_short.weight`` and
``rope_factors_long.weight`` with ``phi3.rope.scaling.attn_factor`` and ``.original_context_length``;
``phi3.attention.sliding_window`` (0: none). Matrices are Q8_0, Q4_0, Q4_1 (gguf-py ``gguf.quants``), norms F32;
the tokenizer is the demo's (the HF models' vocabulary).

The reference is transformers' model of the same config with every weight replaced by the file's values as
gguf-py dequantizes them (the fused tensors are HF's fused parameters, so the split is the builder's alone).
transformers' own GGUF loader is not used: it reads neither ``rope.dimension_count`` nor the LongRoPE tensors.
phi4mini's reference runs LongRoPE's long factors at every position (its short factors replaced by the long ones):
a GGUF's LongRoPE is built as llama-server runs the file at its default context (compiler/rope.py).
Logits at every position of test_architectures' 64-token sequence with rejected slots, 3 and 2 stages, f32; the
2-stage build answers through a real fleet with transformers' greedy tokens on the chat prompt.
Measured max |error| (the same for 3 and 2 stages): phi3 1.2e-5, phi4mini 1.5e-5 on logits |max| 6.4-6.7;
``ATOL`` is ~7x the worst.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from .test_architectures import (
    MAX_POSITIONS,
    NEW_TOKENS,
    PROMPT,
    SEQ,
    VOCAB,
    chained_logits,
    fleet_greedy,
    hf_greedy,
    make_tiny_model,
)
from .gguf_bytes import assert_constants_are_gguf_bytes
from .test_gguf import add_demo_tokenizer, build, demo_gguf, demo_vocabulary, save_gguf, transformers_logits  # noqa: F401

pytestmark = pytest.mark.integration

ATOL = 1e-4
LAYERS = {3: "0:1,1:3,3:4", 2: "0:2,2:4"}
KINDS = {"attn_qkv": "Q8_0", "attn_output": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0",
         "output": "Q4_1"}  # per GGUF tensor role; norms F32
TO_HF = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


def write_phi3_gguf(hf: Path, path: Path, demo: Path, drop: str = "") -> None:
    """The f32 HF folder ``hf`` (a transformers Phi3 model) as llama.cpp's converter writes it (module docstring);
    without tensor ``drop`` when given (a broken file)."""
    import gguf
    from safetensors.numpy import load_file

    config = __import__("json").loads((hf / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    tensors = load_file(str(hf / "model.safetensors"))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    tokens, merges, types, template = demo_vocabulary(str(demo))
    writer = gguf.GGUFWriter(str(path), "phi3")
    max_pos, original = config["max_position_embeddings"], config["original_max_position_embeddings"]
    writer.add_context_length(max_pos)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_sliding_window(config.get("sliding_window") or 0)
    add_demo_tokenizer(writer, (tokens, merges, types, template))
    if rope.get("long_factor"):
        scale = max_pos / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)

    def matrix(name: str, w: np.ndarray, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    matrix("token_embd.weight", tensors["model.embed_tokens.weight"], KINDS["token_embd"])
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"].astype(np.float32))
    if "lm_head.weight" in tensors:
        matrix("output.weight", tensors["lm_head.weight"], KINDS["output"])
    for i in range(config["num_hidden_layers"]):
        for role, name in TO_HF.items():
            w = tensors[f"model.layers.{i}.{name}.weight"]
            if w.ndim == 1:
                writer.add_tensor(f"blk.{i}.{role}.weight", w.astype(np.float32))
            else:
                matrix(f"blk.{i}.{role}.weight", w, KINDS[role])
    if rope.get("long_factor"):
        for name in ("long", "short"):
            if drop != f"rope_factors_{name}.weight":
                writer.add_tensor(f"rope_factors_{name}.weight", np.asarray(rope[f"{name}_factor"], np.float32))
    save_gguf(writer)


def long_factors(config: dict) -> dict:
    """``config`` (an HF config.json dict) with its LongRoPE marked to run on the long factors, as a GGUF's is
    (compiler/gguf_families.py ``phi3_rope``)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    return config | {key: config[key] | {"factors": "long"}}


def long_factors_folder(hf: Path, out: Path) -> Path:
    """A copy of ``hf`` whose LongRoPE short factors are its long ones: transformers then runs the long factors at
    every position, as llama.cpp (at its default context) and fleet run a GGUF's."""
    import json
    import shutil

    shutil.copytree(hf, out)
    config = json.loads((hf / "config.json").read_text())
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    config[key]["short_factor"] = config[key]["long_factor"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def gguf_reference(hf: Path, path: Path):  # noqa: ANN201 - a transformers model
    """transformers' model of ``hf``'s config in f32, its weights the GGUF's values as gguf-py dequantizes them."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for t in read_gguf_file(str(path)).tensors:
            if t.name.startswith("rope_factors"):
                continue
            parts = t.name.split(".")
            name = names.get(t.name) or f"model.layers.{parts[1]}.{TO_HF[parts[2]]}.weight"
            values = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
            params[name].copy_(torch.from_numpy(np.array(values, np.float32).reshape(params[name].shape)))
            seen.add(name)
    assert seen == set(params), set(params) - seen
    return model


class Zoo:
    """The module's GGUF files and their references, each made once, on first use."""

    def __init__(self, root: Path, demo_hf: Path, demo: Path) -> None:
        self.root, self.demo_hf, self.demo = root, demo_hf, demo
        rng = np.random.default_rng(7)
        self.ids, self.garbage = rng.integers(3, VOCAB, SEQ), rng.integers(3, VOCAB, 8)

    @cache  # noqa: B019 - one Zoo per module
    def hf(self, arch: str) -> Path:
        return make_tiny_model(arch, self.root / "hf", self.demo_hf)["f32"]

    @cache  # noqa: B019
    def gguf(self, arch: str) -> Path:
        path = self.root / arch / f"{arch}.gguf"
        path.parent.mkdir(parents=True)
        write_phi3_gguf(self.hf(arch), path, self.demo)
        return path

    @cache  # noqa: B019
    def reference(self, arch: str):  # noqa: ANN201 - a transformers model
        hf = self.hf(arch) if arch != "phi4mini" else long_factors_folder(self.hf(arch), self.root / "phi4mini-long")
        return gguf_reference(hf, self.gguf(arch))

    @cache  # noqa: B019
    def reference_logits(self, arch: str) -> np.ndarray:
        return transformers_logits(self.reference(arch), self.ids)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf, demo_gguf) -> Zoo:  # noqa: F811 - demo_gguf is a fixture
    return Zoo(tmp_path_factory.mktemp("gguf-phi3"), demo_hf, demo_gguf)


def test_phi3_gguf_config_is_the_hf_config(zoo):
    """The GGUF's config reads as the HF folder's: the same frequencies (LongRoPE's factors from the file's tensors:
    the long ones, as llama-server runs the file at its default context), attention factor (the file's f32 value),
    rotary dims, context (window, or the whole of it with LongRoPE's long factors) and tied head."""
    import json

    from compiler.arch import ModelConfig
    from compiler.source import open_source

    for arch in ("phi3", "phi4mini"):
        config = json.loads((zoo.hf(arch) / "config.json").read_text())
        hf = ModelConfig.from_hf(long_factors(config) if arch == "phi4mini" else config)
        source = open_source(zoo.gguf(arch), zoo.root / "work")
        cfg = source.config
        assert cfg.fused and cfg.model_type == "phi3"
        assert (cfg.rotary_dim, cfg.max_context, cfg.tie_word_embeddings) == \
            (hf.rotary_dim, hf.max_context, hf.tie_word_embeddings)
        np.testing.assert_allclose(cfg.inv_freq, hf.inv_freq, rtol=1e-6)
        assert cfg.rope_scale == pytest.approx(hf.rope_scale, rel=1e-6)
        assert "model.layers.0.mlp.gate_proj.weight" in source.weights
        assert "model.layers.0.self_attn.qkv_proj.weight" not in source.weights


@pytest.mark.parametrize("stages", [3, 2])
@pytest.mark.parametrize("arch", ["phi3", "phi4mini"])
def test_phi3_gguf_stages_match_transformers(arch, stages, zoo, tmp_path):
    """The build keeps the file's blocks (the fused tensors' row ranges, nothing dequantized) and its chained stages
    give transformers' f32 logits on the file's values within ``ATOL``, with the same argmax everywhere."""
    manifest = build(zoo.gguf(arch), tmp_path / "build", "--layers", LAYERS[stages])
    assert len(manifest["stages"]) == stages and manifest["architecture"]["model_type"] == "phi3"
    kinds: dict[str, int] = {}
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
        for kind, n in stage["compression"]["tensors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    tied = arch == "phi4mini"
    # per layer q, k, v Q8_0 (attn_qkv), o Q4_1, gate and up Q4_0 (ffn_up), down Q8_0; the embedding Q8_0 (twice
    # when tied: the last stage's head), the head Q4_1 otherwise; 2 norms per layer and the final one F32
    assert kinds == {"Q8_0": 4 * 4 + 1 + tied, "Q4_1": 4 + (not tied), "Q4_0": 2 * 4, "f32": 2 * 4 + 1}, kinds
    # each matrix (q/k/v and gate/up: row ranges of the fused tensors) and the head: the file's bytes, hashed
    assert assert_constants_are_gguf_bytes(tmp_path / "build", zoo.gguf(arch), tmp_path / "work") == 7 * 4 + 1
    got = chained_logits(tmp_path / "build", zoo.ids, zoo.garbage)
    expected = zoo.reference_logits(arch)
    err = np.abs(got - expected).max()
    assert err < ATOL, f"{arch}, {stages} stages: max |error| {err:.3g} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_phi3_gguf_with_one_longrope_factor_tensor_is_refused(zoo, tmp_path):
    """A LongRoPE file missing one of its two factor tensors is one error naming the file and the tensor it has."""
    from compiler.source import open_source

    path = tmp_path / "broken.gguf"
    write_phi3_gguf(zoo.hf("phi4mini"), path, zoo.demo, drop="rope_factors_long.weight")
    with pytest.raises(ValueError, match=f"^{path}: LongRoPE needs both .* only rope_factors_short.weight"):
        open_source(path, tmp_path / "work")


@pytest.mark.parametrize("arch", ["phi3", "phi4mini"])
def test_phi3_gguf_fleet_greedy_matches_transformers(arch, zoo, tmp_path):
    """A real 2-stage fleet (worker processes in f32, coordinator) of the GGUF's build answers the chat prompt with
    transformers' greedy tokens on the file's values, id for id (the tokenizer and template from the file)."""
    from coordinator.tokenizer import ChatTokenizer

    out = tmp_path / "build"
    build(zoo.gguf(arch), out, "--layers", LAYERS[2])
    prompt = ChatTokenizer(out).encode_chat([{"role": "user", "content": PROMPT}])
    assert len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference(arch), prompt, NEW_TOKENS)
    assert fleet_greedy(out, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)
