"""gemma3 GGUF files, as llama.cpp's converter (convert_hf_to_gguf.py ``Gemma3Model``) writes them: a tiny random
Gemma3ForCausalLM of Gemma 3's own 5:1 local/global pattern (6 layers, every 6th global: what llama.cpp assumes of a
gemma3 file), sliding window 8, linear RoPE factor 2 on the global layers (``rope.scaling.type`` linear), the local
base 10000 (llama.cpp's fixed one), ``query_pre_attn_scalar`` = head_dim (the file has no such key: llama.cpp takes
head_dim), tied head; every norm written as 1 + w (the converter adds the 1), no Q/K permutation; Q8_0/Q4_0/Q4_1
matrices, F32 norms. The vocabulary is the demo's BPE one (gpt2 tokenizer model), as the other GGUF tests write it,
without its chat template (the build gives it fleet's built-in chatml one, from its tokens); Gemma's own SentencePiece
vocabulary is tested in tests/unit/test_gguf_gemma_vocab.py.

The build keeps every block and its chained stages match transformers' f32 logits on the file's dequantized values
(norms minus the 1) within 1e-4; greedy through a real 2-stage fleet equals transformers'.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from .test_architectures import (
    COMMON,
    MAX_POSITIONS,
    NEW_TOKENS,
    PROMPT,
    SEED,
    SEQ,
    TOKENIZER,
    VOCAB,
    WEIGHT_STD,
    chained_logits,
    fleet_greedy,
    hf_greedy,
)
from .test_gguf import add_demo_tokenizer, build, demo_gguf, demo_vocabulary, save_gguf, transformers_logits  # noqa: F401

pytestmark = pytest.mark.integration

ATOL = 1e-4
WINDOW = 8
OPTIONS = {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 6,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "query_pre_attn_scalar": 16,
           "tie_word_embeddings": True}
KINDS = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}  # per GGUF tensor role; norms F32
TO_HF = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LAYERS = {3: "0:2,2:5,5:6", 2: "0:3,3:6"}


def make_hf(folder: Path, demo_hf: Path) -> Path:
    """The random model as an f32 HF folder (norm weights w ~ N(0, 0.2): Gemma's 1 + w)."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(**{**COMMON, **OPTIONS})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (WEIGHT_STD if p.ndim > 1 else 0.2))
    model.save_pretrained(folder)
    for file in TOKENIZER:
        shutil.copy(demo_hf / file, folder / file)
    return folder


def write_gemma3_gguf(hf: Path, path: Path, demo: Path) -> None:
    """The f32 HF folder ``hf`` as llama.cpp's Gemma3Model writes it (module docstring)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf / "config.json").read_text())
    tensors = load_file(str(hf / "model.safetensors"))
    tokens, merges, types, _ = demo_vocabulary(str(demo))
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config["rope_parameters"]["full_attention"]["factor"])
    add_demo_tokenizer(writer, (tokens, merges, types, None))  # no chat template: the build picks chatml's

    def add(name: str, w: np.ndarray, kind: str | None) -> None:
        if kind is None:  # a norm: the converter adds Gemma's 1
            writer.add_tensor(name, (w + 1).astype(np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], KINDS["token_embd"])
    add("output_norm.weight", tensors["model.norm.weight"], None)
    for i in range(config["num_hidden_layers"]):
        for role, name in TO_HF.items():
            add(f"blk.{i}.{role}.weight", tensors[f"model.layers.{i}.{name}.weight"], KINDS.get(role))
    save_gguf(writer)


def gguf_reference(hf: Path, path: Path):  # noqa: ANN201 - a transformers model
    """transformers' model of ``hf`` in f32 with the GGUF's values as gguf-py dequantizes them (norms minus 1)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for t in read_gguf_file(str(path)).tensors:
            parts = t.name.split(".")
            name = names.get(t.name) or f"model.layers.{parts[1]}.{TO_HF[parts[2]]}.weight"
            values = np.array(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type)), np.float32)
            if t.name.endswith("norm.weight"):
                values = values - 1
            params[name].copy_(torch.from_numpy(values.reshape(params[name].shape)))
            seen.add(name)
    assert seen == set(params), set(params) - seen
    return model


class Zoo:
    def __init__(self, root: Path, demo_hf: Path, demo: Path) -> None:
        self.root, self.demo_hf, self.demo = root, demo_hf, demo
        rng = np.random.default_rng(7)
        self.ids, self.garbage = rng.integers(3, VOCAB, SEQ), rng.integers(3, VOCAB, 8)

    @cache  # noqa: B019
    def hf(self) -> Path:
        return make_hf(self.root / "hf", self.demo_hf)

    @cache  # noqa: B019
    def gguf(self) -> Path:
        path = self.root / "gemma3.gguf"
        write_gemma3_gguf(self.hf(), path, self.demo)
        return path

    @cache  # noqa: B019
    def reference(self):  # noqa: ANN201
        return gguf_reference(self.hf(), self.gguf())


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf, demo_gguf) -> Zoo:  # noqa: F811 - demo_gguf is a fixture
    return Zoo(tmp_path_factory.mktemp("gguf-gemma3"), demo_hf, demo_gguf)


def test_gemma3_gguf_config_is_the_hf_config(zoo):
    """The GGUF's config reads as the HF folder's, but for the norms' 1 (in the file's values)."""
    import dataclasses

    from compiler.arch import ModelConfig
    from compiler.source import open_source

    hf = ModelConfig.from_folder(zoo.hf())
    cfg = open_source(zoo.gguf(), zoo.root / "work").config
    assert hf.sliding_layers == (True,) * 5 + (False,) and hf.norm_offset == 1.0 and cfg.norm_offset == 0.0
    assert dataclasses.replace(cfg, norm_offset=1.0, rms_norm_eps=hf.rms_norm_eps) == hf  # eps: the file's f32


@pytest.mark.parametrize("stages", [3, 2])
def test_gemma3_gguf_stages_match_transformers(stages, zoo, tmp_path):
    """Every block kept; the chained stages give transformers' f32 logits on the file's values within ``ATOL``."""
    manifest = build(zoo.gguf(), tmp_path / "build", "--layers", LAYERS[stages])
    assert len(manifest["stages"]) == stages and manifest["architecture"]["model_type"] == "gemma3_text"
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
    got = chained_logits(tmp_path / "build", zoo.ids, zoo.garbage)
    expected = transformers_logits(zoo.reference(), zoo.ids)
    err = np.abs(got - expected).max()
    assert err < ATOL, f"{stages} stages: max |error| {err:.3g} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_gemma3_gguf_fleet_greedy_matches_transformers(zoo, tmp_path):
    """A real 2-stage fleet of the GGUF's build answers with transformers' greedy tokens on the file's values."""
    from coordinator.tokenizer import ChatTokenizer

    out = tmp_path / "build"
    build(zoo.gguf(), out, "--layers", LAYERS[2])
    assert json.loads((out / "tokenizer_config.json").read_text())["fleet_chat_template"] == "builtin:chatml"
    chat = ChatTokenizer(out)
    assert chat.render_chat([{"role": "user", "content": PROMPT}]) == f"<|im_start|>user\n{PROMPT}<|im_end|>\n" \
        "<|im_start|>assistant\n"  # the file has no template: fleet's chatml, from the demo vocabulary's tokens
    prompt = chat.encode_chat([{"role": "user", "content": PROMPT}])
    assert WINDOW < len(prompt) and len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference(), prompt, NEW_TOKENS)
    assert fleet_greedy(out, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)
