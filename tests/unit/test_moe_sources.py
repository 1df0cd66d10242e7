"""Mixtral's HF config and Mixture-of-Experts GGUF metadata (compiler/arch.py, compiler/gguf_moe.py): what they
read, and the bad files they refuse by name. The GGUF files are written here with gguf-py's ``GGUFWriter``, tiny
(metadata and tensor headers are what is read; no weight is)."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.arch import ModelConfig, expected_shapes
from compiler.planner import ModelDims
from compiler.weights import WeightsError

WHERE = "test/config.json"
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2,
           "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def test_mixtral_config_every_layer_sparse_renormalised_with_its_names():
    """Mixtral: every layer sparse, experts of intermediate_size, top-k renormalised (MixtralSparseMoeBlock has no
    switch), weights under block_sparse_moe (w1 gate, w3 up, w2 down); the planner counts the 2 chosen experts
    for speed and the other 6 and the router for memory."""
    cfg = ModelConfig.from_hf(MIXTRAL, WHERE)
    assert (cfg.moe_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.norm_topk_prob) \
        == ((0, 1), 8, 2, 32, True)
    assert not cfg.qk_norm and not cfg.qkv_bias
    shapes = expected_shapes(cfg, 1)
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (8, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.7.w1.weight"] == (32, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.0.w3.weight"] == (32, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (64, 32)
    assert len(shapes) == 6 + 1 + 3 * 8
    dims = ModelDims.from_config(MIXTRAL, "tiny-mixtral")
    assert dims.intermediate_size == 2 * 32 and dims.idle_params == 64 * (6 * 3 * 32 + 8)


def write_moe(path, arch: str = "qwen3moe", experts: int | None = 8, used: int = 2, width: int | None = 32,
              down: tuple[int, ...] = (8, 64, 32), layers_with_experts: int = 2,
              legacy: int = 0) -> None:  # noqa: ANN001
    """A 2-layer MoE GGUF's metadata and tensors (hidden 64, 4 heads), zeros: ``experts`` / ``used`` / ``width``
    the metadata written (None: left out), ``down`` the stacked down tensor's numpy shape, experts in the first
    ``layers_with_experts`` layers; ``legacy`` experts a layer as one tensor each (``blk.N.ffn_gate.E.weight``)
    instead of stacked."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(32)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    if experts is not None:
        writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    if width is not None:
        writer.add_expert_feed_forward_length(width)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    for i in range(layers_with_experts):
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.zeros((8, 64), np.float32))
        if legacy:
            for e in range(legacy):
                for role, shape in (("ffn_gate", (32, 64)), ("ffn_up", (32, 64)), ("ffn_down", down[1:])):
                    writer.add_tensor(f"blk.{i}.{role}.{e}.weight", np.zeros(shape, np.float16))
            continue
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.zeros((8, 32, 64), np.float16))
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.zeros((8, 32, 64), np.float16))
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", np.zeros(down, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def config_of(path) -> dict:  # noqa: ANN001
    from compiler.gguf import gguf_config, open_reader

    return gguf_config(open_reader(path), str(path))


def test_qwen3moe_and_mixtral_gguf_metadata_read_as_hf_configs(tmp_path):
    """A qwen3moe file reads as qwen3_moe (experts, top-k, expert width, every layer sparse, renormalised as
    llama.cpp); a llama file with expert_count as mixtral, its experts feed_forward_length wide."""
    write_moe(tmp_path / "q.gguf")
    q = config_of(tmp_path / "q.gguf")
    assert {k: q[k] for k in ("model_type", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                              "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")} == \
        {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    write_moe(tmp_path / "m.gguf", arch="llama", width=None)
    m = config_of(tmp_path / "m.gguf")
    assert (m["model_type"], m["num_local_experts"], m["intermediate_size"], m["architectures"]) == \
        ("mixtral", 8, 32, ["MixtralForCausalLM"])


@pytest.mark.parametrize(("options", "error", "match"), [
    (dict(experts=None), ValueError, r"metadata qwen3moe\.expert_count missing"),
    (dict(used=9), ValueError, r"expert_used_count 9 is more than qwen3moe\.expert_count 8"),
    (dict(width=None), ValueError, r"metadata qwen3moe\.expert_feed_forward_length missing"),
    (dict(down=(8, 64, 48)), WeightsError, (r"tensor blk\.0\.ffn_down_exps\.weight has shape \[8, 64, 48\], but "
                                            r"the metadata \(expert_count 8, expert width 32, embedding_length 64\) "
                                            r"gives \[8, 64, 32\]")),
    (dict(experts=16), WeightsError, r"tensor blk\.0\.ffn_gate_inp\.weight has shape \[8, 64\].*gives \[16, 64\]"),
    (dict(layers_with_experts=1), WeightsError, r"tensor blk\.1\.ffn_gate_inp\.weight missing"),
])
def test_moe_gguf_metadata_that_contradicts_its_tensors_is_refused(options, error, match, tmp_path):
    """Missing or contradicting MoE metadata, a stacked tensor of another shape, a layer without experts: one error
    naming the file and what is wrong, before any weight is read."""
    path = tmp_path / "bad.gguf"
    write_moe(path, **options)
    with pytest.raises(error, match=f"^{path}: .*{match}"):
        config_of(path)


def test_moe_gguf_of_one_tensor_per_expert_reads_and_refuses_a_count_mismatch(tmp_path):
    """A Mixtral file of the older layout (one tensor per expert) reads as the stacked one, each expert under its HF
    name; one expert more than expert_count, one fewer or one of another shape is refused by name."""
    from compiler.gguf import GGUFWeights, open_reader

    path = tmp_path / "m.gguf"
    write_moe(path, arch="llama", width=None, legacy=8)
    config = config_of(path)
    assert (config["model_type"], config["num_local_experts"]) == ("mixtral", 8)
    weights = GGUFWeights(path, open_reader(path), config)
    assert weights.shape("model.layers.1.block_sparse_moe.experts.7.w2.weight") == (64, 32)
    assert weights.kind("model.layers.1.block_sparse_moe.experts.7.w2.weight") == "f16"
    for legacy, down, match in ((9, (8, 64, 32), r"tensor blk\.0\.ffn_gate\.8\.weight is an expert beyond the "
                                                 r"metadata's expert_count 8"),
                                (7, (8, 64, 32), r"tensor blk\.0\.ffn_gate\.7\.weight missing"),
                                (8, (8, 64, 16), r"tensor blk\.0\.ffn_down\.0\.weight has shape \[64, 16\]")):
        write_moe(path, arch="llama", width=None, legacy=legacy, down=down)
        with pytest.raises(WeightsError, match=f"^{path}: {match}"):
            config_of(path)
