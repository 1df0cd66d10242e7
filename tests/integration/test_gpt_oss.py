"""gpt-oss (``gpt_oss``, compiler/gpt_oss.py) built from an HF folder, against transformers in f32.

A tiny random ``GptOssForCausalLM`` made by transformers (4 layers alternating sliding-window and full attention,
window 16 so that 64 tokens cross it, 4 query / 2 KV heads of 16, 8 experts of 32, top 4, YaRN RoPE as
gpt-oss-20b's: factor 32, beta 32 / 1, original context 4096, theta 150000, not truncated), weights ~N(0,
WEIGHT_STD), norms 1 + N(0, 0.2), biases and sinks N(0, 0.5), saved in bf16 (as gpt-oss's checkpoints hold
everything but the experts) with the demo tokenizer. The reference is transformers' model of that folder in f32,
every parameter rounded to fp16 and back (the values the build stores: test_architectures.reference_model).

* Config: YaRN's frequencies and attention factor are transformers' (``rotary_emb.inv_freq``,
  ``attention_scaling``); the sliding layers and window are the config's.
* 1, 2 and 3 stages chained in this process (f32 inference), the 64 tokens fed as a prefill and chunks with
  rejected draft tokens between them (test_architectures.chained_logits): transformers' logits within ``ATOL``,
  the same argmax everywhere; each layer's TopK picks for every token are the top 4 of transformers' router.
* 2 stages through a real fleet (worker processes in f32, coordinator): transformers' greedy tokens, id for id.
* ``fleet-compiler inspect`` passes the build: each layer's attention, sinks included, one fused stateful SDPA.
* GGUF: the same model written as llama.cpp's converter writes ``gpt-oss`` (convert_hf_to_gguf.py ``GptOssModel``:
  ``gate_up_proj`` split into ``ffn_gate_exps`` (even rows) and ``ffn_up_exps`` (odd), transposed as [E, I, H], its
  bias likewise, ``attn_sinks.weight``, ``post_attention_norm``, router ``ffn_gate_inp`` with bias; YaRN as
  ``rope.scaling.*``), experts MXFP4 (gguf-py's quantizer), attention, embedding and head Q8_0, the rest F32; the
  reference is transformers' model with the file's values (gguf-py's dequantization, gate and up interleaved back):
  one stage's logits within ``ATOL`` and a 2-stage fleet's greedy tokens.

Measured (2 stages): max |error| 5.2e-6 on logits |max| 6.2 (smallest top-2 gap of the reference 3.3e-4);
``ATOL`` is ~20x that. Setting the sinks to 0 in the reference moves its logits by 1.47. The HF folder's experts
run as the CPU plugin's GatherMatmul nodes (two a layer: gate_up and down), the GGUF's as fleet's ``GgufMoeMatMul``
over the file's MXFP4 bytes (three a layer: gate, up, down).
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from .test_gguf import add_demo_tokenizer, demo_gguf, demo_vocabulary, save_gguf  # noqa: F401
from .test_architectures import (
    COMMON,
    MAX_POSITIONS,
    NEW_TOKENS,
    PROMPT,
    SEED,
    SEQ,
    STAGE_SPECS,
    TOKENIZER,
    WEIGHT_STD,
    chained_logits,
    fleet_greedy,
    hf_greedy,
    reference_model,
)

pytestmark = pytest.mark.integration

ATOL = 1e-4
EXPERTS, TOP_K, WINDOW = 8, 4, 16
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}  # gpt-oss-20b's


def make_gpt_oss(folder: Path, demo_hf: Path) -> Path:
    """The tiny random gpt-oss of the module docstring, saved in bf16 as ``folder/gpt-oss-bf16``."""
    import torch
    import transformers

    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32, "head_dim": 16,
                                          "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                          "sliding_window": WINDOW, "rope_parameters": YARN})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1 and not name.endswith("_bias"):
                p.normal_(0.0, WEIGHT_STD)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # biases (the experts' [E, n] too) and sinks
                p.copy_(0.5 * torch.randn_like(p))
    path = folder / "gpt-oss-bf16"
    model.to(torch.bfloat16).save_pretrained(path)
    for file in TOKENIZER:
        shutil.copy(demo_hf / file, path / file)
    return path


class Zoo:
    """The module's model, reference and builds, each made once, on first use."""

    def __init__(self, root: Path, demo_hf: Path, demo: Path) -> None:
        self.root, self.demo_hf, self.demo = root, demo_hf, demo
        rng = np.random.default_rng(SEED)
        self.ids = rng.integers(3, COMMON["vocab_size"], SEQ)
        self.garbage = rng.integers(3, COMMON["vocab_size"], 8)

    @cache  # noqa: B019 - one Zoo per module
    def source(self) -> Path:
        return make_gpt_oss(self.root / "hf", self.demo_hf)

    @cache  # noqa: B019
    def reference(self):  # noqa: ANN201 - a transformers model
        return reference_model(self.source())

    @cache  # noqa: B019
    def gguf(self) -> Path:
        path = self.root / "gguf" / "gpt-oss.gguf"
        path.parent.mkdir()
        write_gguf(self.reference(), path, self.demo)
        return path

    @cache  # noqa: B019
    def gguf_reference(self):  # noqa: ANN201 - a transformers model
        return gguf_reference(self.source(), self.gguf())

    @cache  # noqa: B019
    def build(self, stages: int) -> Path:
        from compiler.build import build

        out = self.root / "builds" / f"gpt-oss-{stages}"
        build(self.source(), out, **STAGE_SPECS[stages])
        return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf, demo_gguf) -> Zoo:  # noqa: F811 - demo_gguf is a fixture
    return Zoo(tmp_path_factory.mktemp("gpt-oss"), demo_hf, demo_gguf)


GGUF_KINDS = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
              "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"}
GGUF_ATTENTION = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}


def write_gguf(model, path: Path, demo: Path) -> None:  # noqa: ANN001 - a transformers GptOssForCausalLM
    """``model`` (its f32 parameters) as llama.cpp's converter writes a gpt-oss GGUF (module docstring)."""
    import gguf

    config = model.config
    w = {name: p.detach().numpy().astype(np.float32) for name, p in model.named_parameters()}
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(YARN["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(YARN["factor"])
    writer.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    add_demo_tokenizer(writer, demo_vocabulary(str(demo)))

    def add(name: str, value: np.ndarray, kind: str = "F32") -> None:
        if kind == "F32":
            writer.add_tensor(name, value.astype(np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            flat = value.reshape(-1, value.shape[-1])
            writer.add_tensor(name, gguf.quants.quantize(flat, qtype).reshape(*value.shape[:-1], -1), raw_dtype=qtype)

    add("token_embd.weight", w["model.embed_tokens.weight"], "Q8_0")
    add("output_norm.weight", w["model.norm.weight"])
    add("output.weight", w["lm_head.weight"], "Q8_0")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", w[p + "input_layernorm.weight"])
        add(f"blk.{i}.post_attention_norm.weight", w[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_sinks.weight", w[p + "self_attn.sinks"])
        for role, hf in GGUF_ATTENTION.items():
            add(f"blk.{i}.{role}.weight", w[f"{p}self_attn.{hf}.weight"], GGUF_KINDS[role])
            add(f"blk.{i}.{role}.bias", w[f"{p}self_attn.{hf}.bias"])
        add(f"blk.{i}.ffn_gate_inp.weight", w[p + "mlp.router.weight"])
        add(f"blk.{i}.ffn_gate_inp.bias", w[p + "mlp.router.bias"])
        gate_up = w[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, H], rows gate, up, gate, ...
        bias = w[p + "mlp.experts.gate_up_proj_bias"]
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, ::2], GGUF_KINDS["ffn_gate_exps"])
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2], GGUF_KINDS["ffn_up_exps"])
        add(f"blk.{i}.ffn_gate_exps.bias", bias[:, ::2])
        add(f"blk.{i}.ffn_up_exps.bias", bias[:, 1::2])
        down = w[p + "mlp.experts.down_proj"].transpose(0, 2, 1)  # [E, H, I]
        add(f"blk.{i}.ffn_down_exps.weight", down, GGUF_KINDS["ffn_down_exps"])
        add(f"blk.{i}.ffn_down_exps.bias", w[p + "mlp.experts.down_proj_bias"])
    save_gguf(writer)


def gguf_reference(hf: Path, path: Path):  # noqa: ANN201 - a transformers model
    """transformers' model of ``hf``'s config in f32 (eager attention), every parameter the GGUF ``path``'s value as
    gguf-py dequantizes it (gate and up rows interleaved back into ``gate_up_proj``, transposed back to x @ W), and
    YaRN's ramp ends rounded (``truncate``), as llama.cpp runs a GGUF (compiler/gguf_gpt_oss.py)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    config.rope_parameters = dict(config.rope_parameters) | {"truncate": True}
    model = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    values = {}
    for t in read_gguf_file(str(path)).tensors:
        v = np.array(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type)), np.float32)
        values[t.name] = v.reshape([int(d) for d in reversed(t.shape)])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in top:
                v = values[top[name]]
            else:
                _, _, i, rest = name.split(".", 3)
                b = f"blk.{i}."
                hf_roles = {f"self_attn.{hf}.{s}": f"{role}.{s}" for role, hf in GGUF_ATTENTION.items()
                            for s in ("weight", "bias")}
                hf_roles |= {"input_layernorm.weight": "attn_norm.weight", "self_attn.sinks": "attn_sinks.weight",
                             "post_attention_layernorm.weight": "post_attention_norm.weight",
                             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                             "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
                if rest == "mlp.experts.gate_up_proj":
                    v = np.stack([values[b + "ffn_gate_exps.weight"], values[b + "ffn_up_exps.weight"]], axis=2)
                    v = v.reshape(v.shape[0], -1, v.shape[-1]).transpose(0, 2, 1)  # [E, H, 2I]
                elif rest == "mlp.experts.gate_up_proj_bias":
                    v = np.stack([values[b + "ffn_gate_exps.bias"], values[b + "ffn_up_exps.bias"]], axis=-1)
                elif rest == "mlp.experts.down_proj":
                    v = values[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
                else:
                    v = values[b + hf_roles[rest]]
            p.copy_(torch.from_numpy(np.ascontiguousarray(v).reshape(p.shape)))
    return model


def test_config_is_transformers(zoo):
    """YaRN's frequencies and attention factor, the sliding layers and their window, as transformers has them."""
    from compiler.arch import ModelConfig

    cfg = ModelConfig.from_folder(zoo.source())
    rotary = zoo.reference().model.rotary_emb
    np.testing.assert_allclose(cfg.inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert cfg.rope_scale == pytest.approx(rotary.attention_scaling, rel=1e-12) and cfg.rope_scale > 1.3
    plain = 1 / 150000.0 ** (np.arange(0, 16, 2) / 16)
    assert (np.abs(np.asarray(cfg.inv_freq) / plain - 1) > 0.1).sum() >= 2  # YaRN moved some, kept others
    assert (np.abs(np.asarray(cfg.inv_freq) / plain - 1) < 1e-6).sum() >= 2
    assert cfg.sliding_layers == (True, False, True, False) and cfg.sliding_window == WINDOW < SEQ
    assert (cfg.gpt_oss, cfg.moe_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size,
            cfg.max_context) == (True, (0, 1, 2, 3), EXPERTS, TOP_K, 32, MAX_POSITIONS)


@pytest.mark.parametrize("rope", [
    YARN, YARN | {"truncate": True}, YARN | {"factor": 4.0, "beta_fast": 16.0, "original_max_position_embeddings": 64},
    YARN | {"attention_factor": 1.1}, YARN | {"mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_yarn_is_transformers(rope):
    """compiler/rope.py's YaRN frequencies and attention factor are transformers' ``_compute_yarn_parameters`` for
    gpt-oss's parameters and variants of them (truncated ramp, other factor, beta and original context, an explicit
    attention factor, mscale / mscale_all_dim)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from compiler.rope import rope_parameters

    config = transformers.GptOssConfig(**{**COMMON, "head_dim": 16, "rope_parameters": dict(rope)})
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours, our_scale, context = rope_parameters(config.to_dict() | {"model_type": "gpt_oss"}, 16)
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6)
    assert our_scale == pytest.approx(scale, rel=1e-12) and context == MAX_POSITIONS


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stage_logits_match_transformers(stages, zoo):
    """Logits at all 64 positions through the chained stages, with rejected slots between chunks: transformers'
    f32 logits within ``ATOL``, the same argmax at every position."""
    import torch

    with torch.no_grad():
        expected = zoo.reference()(torch.from_numpy(zoo.ids)[None]).logits[0].numpy()
    got = chained_logits(zoo.build(stages), zoo.ids, zoo.garbage)
    err = np.abs(got - expected).max(axis=-1)
    assert err.max() < ATOL, f"{stages} stage(s): max |error| {err.max():.3g} at position {int(err.argmax())} " \
                             f"(logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_router_picks_match_transformers(zoo):
    """The experts each layer's TopK picks (the whole model as one stage, f32 inference) are, for every token, the
    top 4 of transformers' router logits; every expert is picked somewhere."""
    import openvino as ov
    import torch

    from compiler.export import StageSpec, export_stage
    from compiler.source import open_source
    from fleet_common.runtime import compile_config

    source = open_source(zoo.source(), zoo.root / "work")
    cfg = source.config
    model = export_stage(cfg, source.weights, StageSpec(0, 0, cfg.num_layers, cfg.num_layers))
    topks = [node for node in model.get_ordered_ops() if node.get_type_name() == "TopK"]
    assert len(topks) == cfg.num_layers
    model.add_outputs([node.output(1) for node in topks])
    compiled = ov.Core().compile_model(model, "CPU", compile_config(threads=1, inference_precision="f32"))
    batch = zoo.ids[None].astype(np.int64)
    out = compiled.create_infer_request().infer({
        "input_ids": batch, "attention_mask": np.ones_like(batch), "position_ids": np.arange(SEQ)[None],
        "beam_idx": np.zeros(1, np.int32), "logits_index": np.arange(SEQ)})
    with torch.no_grad():
        ref = zoo.reference()(torch.from_numpy(zoo.ids)[None], output_router_logits=True)
    used: set[int] = set()
    for layer, logits in enumerate(ref.router_logits):
        picked = np.sort(out[compiled.outputs[1 + layer]], axis=-1)
        want = np.sort(torch.topk(logits.float(), TOP_K, dim=-1).indices.numpy(), axis=-1)
        wrong = np.flatnonzero((picked != want).any(-1))
        assert not wrong.size, f"layer {layer}: other experts at positions {wrong.tolist()}"
        used.update(np.unique(picked).tolist())
    assert used == set(range(EXPERTS))


def test_fleet_greedy_matches_transformers(zoo, tmp_path):
    """A real 2-stage fleet (worker processes in f32, coordinator) answers the chat prompt with transformers'
    greedy tokens, id for id."""
    from coordinator.tokenizer import ChatTokenizer

    build = zoo.build(2)
    prompt = ChatTokenizer(build).encode_chat([{"role": "user", "content": PROMPT}])
    assert len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference(), prompt, NEW_TOKENS)
    assert fleet_greedy(build, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)


def test_inspect_finds_every_layer_one_fused_sdpa_with_its_sinks(zoo):
    """``fleet-compiler inspect`` passes both stages of the 2-stage build: every layer's attention, sinks included,
    is one SDPA reading its KV from the state (3 and 1 layers), and no Softmax is left (the routers' are named as
    theirs)."""
    import subprocess

    from tests.conftest import BIN

    out = subprocess.run([str(BIN / "fleet-compiler"), "inspect", str(zoo.build(2))], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and [row.split()[-1] for row in rows] == ["ok", "ok"], out.stdout
    assert [int(row.split()[3]) for row in rows] == [3, 1], out.stdout  # fused SDPA+KV per stage: every layer
    assert "inspect: OK" in out.stdout


def test_gguf_logits_match_transformers(zoo):
    """The gpt-oss GGUF as one CPU stage (its MXFP4 experts and Q8_0 matrices as the file's bytes for fleet's
    kernels, f32 inference): transformers' logits on the file's values within ``ATOL``, the same argmax; the manifest
    records every expert kept, nothing dequantized; three ``GgufMoeMatMul`` a layer (gate, up, down) in MXFP4 run the
    experts, no OpenVINO expert form is left (no GatherMatmul)."""
    import torch
    from collections import Counter

    from fleet_common.runtime import compile_ir

    from .test_gguf import build

    out = zoo.root / "gguf-build-1"
    manifest = build(zoo.gguf(), out, "--shards", "1")
    compression = manifest["stages"][0]["compression"]
    assert compression["dequantized_to_f16"] == {} and compression["tensors"]["MXFP4/i8"] == 4 * 2 * EXPERTS, \
        compression
    with torch.no_grad():
        expected = zoo.gguf_reference()(torch.from_numpy(zoo.ids)[None]).logits[0].numpy()
    got = chained_logits(out, zoo.ids, zoo.garbage)
    err = np.abs(got - expected).max()
    assert err < ATOL, f"max |error| {err:.3g} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    xml = (out / manifest["stages"][0]["xml"]).read_text()
    assert xml.count('type="GgufMoeMatMul"') == xml.count('block_type="MXFP4"') == 3 * 4, "three MXFP4 products a layer"
    compiled = compile_ir(out / manifest["stages"][0]["xml"], threads=1, inference_precision="f32")[0]
    kinds = Counter(n.get_rt_info()["layerType"].astype(str) for n in compiled.get_runtime_model().get_ordered_ops())
    assert not kinds["GatherMatmul"], kinds


def test_gguf_fleet_greedy_matches_transformers(zoo, tmp_path):
    """A 2-stage build of the gpt-oss GGUF through a real fleet (worker processes in f32, coordinator) answers
    the chat prompt with transformers' greedy tokens on the file's values, id for id."""
    from coordinator.tokenizer import ChatTokenizer

    from .test_gguf import build

    out = tmp_path / "build"
    build(zoo.gguf(), out, "--shards", "2")
    prompt = ChatTokenizer(out).encode_chat([{"role": "user", "content": PROMPT}])
    assert len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.gguf_reference(), prompt, NEW_TOKENS)
    assert fleet_greedy(out, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)
