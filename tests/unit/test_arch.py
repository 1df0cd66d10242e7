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
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
])
def test_unsupported_option_is_named(changes, pattern):
    with pytest.raises(UnsupportedModel, match=pattern) as exc:
        ModelConfig.from_hf(llama(**changes), WHERE)
    assert str(exc.value).startswith(WHERE)


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
