"""compiler/arch.py's config reader on bad config.json: each problem is one ``ValueError`` (or
``UnsupportedModel``) naming the file and the problem, before any weight is read. No torch, no files
but the ones written here."""

from __future__ import annotations

import json

import pytest

from compiler.arch import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModel

WHERE = "/models/x/config.json"


def llama(**changes) -> dict:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 128,
              "vocab_size": 1000, "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "hidden_act": "silu"}
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


def test_the_tiny_llama_reads():
    cfg = ModelConfig.from_hf(llama(), WHERE)
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.kv_groups) == (4, 64, 16, 2)
    assert len(cfg.inv_freq) == 8


@pytest.mark.parametrize(("model_type", "archs"), [("gpt2", ["GPT2LMHeadModel"]), ("gpt_neox", None), (None, None)])
def test_unsupported_architecture_names_it_and_the_supported_list(model_type, archs):
    with pytest.raises(UnsupportedModel) as exc:
        ModelConfig.from_hf(llama(model_type=model_type, architectures=archs), WHERE)
    message = str(exc.value)
    assert message.startswith(WHERE) and repr(model_type) in message
    assert ", ".join(SUPPORTED_ARCHITECTURES) in message
    assert (archs[0] if archs else "no 'architectures' given") in message


def test_unsupported_architecture_is_refused_whatever_else_is_missing():
    """The architecture comes first: a GPT-2 config has none of the Llama fields."""
    with pytest.raises(UnsupportedModel, match="'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2", "n_embd": 32, "n_layer": 2}, WHERE)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                   "vocab_size"])
def test_missing_field_names_it_and_the_file(field):
    with pytest.raises(ValueError, match=f"^{WHERE}: field '{field}' missing"):
        ModelConfig.from_hf(llama(**{field: ...}), WHERE)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"hidden_act": "relu", "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
     "activation 'relu'"),  # ReGLU for dense models only
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
])
def test_unsupported_option_is_named(changes, pattern):
    with pytest.raises(UnsupportedModel, match=pattern) as exc:
        ModelConfig.from_hf(llama(**changes), WHERE)
    assert str(exc.value).startswith(WHERE)


def test_a_relu_mlp_reads_as_reglu():
    assert ModelConfig.from_hf(llama(hidden_act="relu"), WHERE).mlp_act == "relu"
    assert ModelConfig.from_hf(llama(), WHERE).mlp_act == "silu"


def test_heads_not_splitting_into_kv_heads():
    with pytest.raises(ValueError, match=f"^{WHERE}: 3 attention heads do not split into 2 KV heads"):
        ModelConfig.from_hf(llama(num_attention_heads=3), WHERE)


@pytest.mark.parametrize("value", [None, "abc", [64]], ids=["null", "text", "list"])
def test_non_integer_field_names_it_and_the_file(value):
    with pytest.raises(ValueError, match=f"^{WHERE}: .*hidden_size"):
        ModelConfig.from_hf(llama(hidden_size=value), WHERE)


@pytest.mark.parametrize("layers", [0, -1])
def test_non_positive_layer_count_names_it_and_the_file(layers):
    with pytest.raises(ValueError, match=f"^{WHERE}: .*num_hidden_layers"):
        ModelConfig.from_hf(llama(num_hidden_layers=layers), WHERE)


def test_from_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_folder(tmp_path)


def test_from_folder_with_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: not valid JSON"):
        ModelConfig.from_folder(tmp_path)


def test_from_folder_reads_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama()))
    assert ModelConfig.from_folder(tmp_path).num_layers == 4


def test_from_folder_with_json_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: "):
        ModelConfig.from_folder(tmp_path)


# Phi-3 / Phi-4-mini (issue 28 item 2): what the reader takes of their configs

def phi3(**changes) -> dict:
    return llama(model_type="phi3", architectures=["Phi3ForCausalLM"], **changes)


LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 4.0, 8.0]}  # 6 of 16 dims


def test_phi3_reads_fused_and_keeps_its_context():
    cfg = ModelConfig.from_hf(phi3(), WHERE)
    assert cfg.fused and (cfg.rotary_dim, cfg.rope_scale, cfg.max_context) == (16, 1.0, 256)
    assert not ModelConfig.from_hf(llama(), WHERE).fused


def test_phi3_sliding_window_cuts_the_context():
    """Phi-3-mini-4k's sliding_window (2047 of 4096) applies without use_sliding_window, as in transformers."""
    assert ModelConfig.from_hf(phi3(sliding_window=100), WHERE).max_context == 100


def test_phi3_partial_rotary_and_longrope_short_factors():
    """Phi-4-mini's shape: int(16 * 0.375) = 6 rotated dims, LongRoPE's short factors divide their frequencies,
    the attention factor is sqrt(1 + ln(1024 / 256) / ln 256), and the context is the original one."""
    import math

    import numpy as np

    cfg = ModelConfig.from_hf(phi3(partial_rotary_factor=0.375, rope_scaling=LONGROPE, max_position_embeddings=1024,
                                   original_max_position_embeddings=256), WHERE)
    plain = 1.0 / 10000.0 ** (np.arange(0, 6, 2) / 6)
    np.testing.assert_allclose(cfg.inv_freq, plain / np.array(LONGROPE["short_factor"]), rtol=1e-6)
    assert cfg.rotary_dim == 6 and cfg.max_context == 256
    assert cfg.rope_scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


def test_longrope_long_factors_serve_the_whole_context():
    """A GGUF's LongRoPE (``"factors": "long"``, as llama-server runs it at its default context): the long factors
    divide the frequencies, the same attention factor, the context max_position_embeddings; another value is named."""
    import numpy as np

    long = ModelConfig.from_hf(phi3(partial_rotary_factor=0.375, max_position_embeddings=1024,
                                    original_max_position_embeddings=256,
                                    rope_scaling={**LONGROPE, "factors": "long"}), WHERE)
    short = ModelConfig.from_hf(phi3(partial_rotary_factor=0.375, max_position_embeddings=1024,
                                     original_max_position_embeddings=256, rope_scaling=LONGROPE), WHERE)
    plain = 1.0 / 10000.0 ** (np.arange(0, 6, 2) / 6)
    np.testing.assert_allclose(long.inv_freq, plain / np.array(LONGROPE["long_factor"]), rtol=1e-6)
    assert (long.max_context, long.rope_scale) == (1024, short.rope_scale)
    with pytest.raises(ValueError, match="factors must be 'short' or 'long', not 'medium'"):
        ModelConfig.from_hf(phi3(partial_rotary_factor=0.375, rope_scaling={**LONGROPE, "factors": "medium"}), WHERE)


def test_phi3_legacy_su_type_is_longrope_and_attention_factor_is_read():
    cfg = ModelConfig.from_hf(phi3(partial_rotary_factor=0.375, max_position_embeddings=1024,
                                   original_max_position_embeddings=256,
                                   rope_scaling={**LONGROPE, "type": "su", "attention_factor": 1.25}), WHERE)
    assert (cfg.rope_scale, cfg.max_context) == (1.25, 256)


def test_longrope_factors_of_the_wrong_length_are_named():
    with pytest.raises(ValueError, match="short_factor must be a list of 8 numbers"):
        ModelConfig.from_hf(phi3(rope_scaling=LONGROPE), WHERE)


def test_partial_rotary_with_an_odd_dim_count_is_refused():
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor 0.3125 gives 5 rotary dims"):
        ModelConfig.from_hf(phi3(partial_rotary_factor=0.3125), WHERE)


# Bad input (issue 28 item 7): a part or feature the builder does not make is refused, naming it

@pytest.mark.parametrize(("changes", "pattern"), [
    ({"vision_config": {"hidden_size": 32}}, "has a vision tower \\('vision_config'\\)"),
    ({"audio_config": {"d_model": 32}}, "has an audio tower"),
    ({"text_config": {"vision_tower": "clip"}}, "vision tower"),
    ({"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
     "'linear_attention': linear-attention layers \\(gated delta net"),
    ({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}, "gated delta net"),
    ({"layer_types": ["mamba", "full_attention"]}, "'mamba': state-space"),
    ({"block_types": ["recurrent", "recurrent", "attention"]}, "recurrent blocks"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling 'yarn'"),
])
def test_unbuilt_part_or_feature_is_named(changes, pattern):
    with pytest.raises(UnsupportedModel, match=pattern) as exc:
        ModelConfig.from_hf(llama(**changes), WHERE)
    assert str(exc.value).startswith(WHERE)


def test_qwen3_5_is_refused_for_its_gated_delta_net_and_its_vision_tower():
    """A Qwen3.5 config (a vision tower beside a text model of gated delta net and attention layers) names what
    the builder lacks, not only that the architecture is unknown."""
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "vision_config": {"depth": 2},
              "text_config": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 3 +
                              ["full_attention"]}}
    with pytest.raises(UnsupportedModel, match="vision tower"):
        ModelConfig.from_hf(config, WHERE)
    del config["vision_config"]
    with pytest.raises(UnsupportedModel, match="'qwen3_5'.*linear_attention.*gated delta net"):
        ModelConfig.from_hf(config, WHERE)


def test_attention_layer_types_are_not_refused():
    cfg = ModelConfig.from_hf(llama(layer_types=["full_attention"] * 4), WHERE)
    assert cfg.num_layers == 4


def test_rope_scaling_replaces_rope_parameters_as_in_transformers():
    """A config saved by transformers 5 has ``rope_parameters`` (default); a ``rope_scaling`` added beside it is what
    transformers loads (``convert_rope_params_to_dict``), so a yarn one is refused, not read as default."""
    with pytest.raises(UnsupportedModel, match="rope scaling 'yarn'"):
        ModelConfig.from_hf(llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0}), WHERE)


def qwen3_moe(**changes) -> dict:
    return llama(**{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32,
                    "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **changes})


def test_qwen3_moe_sparse_layers_experts_and_names():
    """Layer i is sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0; transformers 5
    saves num_experts as num_local_experts; a sparse layer's weights are its router and every expert's three
    matrices (all counted in the size), a dense one's the MLP."""
    from compiler.arch import expected_shapes

    cfg = ModelConfig.from_hf(qwen3_moe(mlp_only_layers=[1], norm_topk_prob=True), WHERE)
    assert (cfg.moe_layers, cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob) == ((0, 2, 3), 8, 2, True)
    assert cfg.qk_norm and not cfg.fused
    assert ModelConfig.from_hf(qwen3_moe(decoder_sparse_step=2), WHERE).moe_layers == (1, 3)
    sparse, dense = expected_shapes(cfg, 0), expected_shapes(cfg, 1)
    assert sparse["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert sparse["model.layers.0.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert sparse["model.layers.0.mlp.experts.0.up_proj.weight"] == (32, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in sparse and len(sparse) == 6 + 2 + 1 + 3 * 8
    assert dense["model.layers.1.mlp.gate_proj.weight"] == (128, 64)
    plain = ModelConfig.from_hf(llama(model_type="qwen3", head_dim=32), WHERE)
    assert cfg.parameters() - plain.parameters() == 3 * (64 * 8 * (3 * 32 + 1) - 3 * 64 * 128)  # 3 sparse layers


@pytest.mark.parametrize(("changes", "match"), [(dict(num_experts_per_tok=9), "more than the 8 experts"),
                                                (dict(moe_intermediate_size=None), "moe_intermediate_size")])
def test_qwen3_moe_bad_fields_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(qwen3_moe(**changes), WHERE)
