"""What the stage builder needs to know of a model: its dimensions and its architecture's differences,
as data (no torch, no transformers).

Every supported architecture is the Llama decoder (pre-norm RMSNorm, rotary attention with grouped KV
heads, SwiGLU MLP) with a few switches:

=========  ==========  ==============  =======================================================
family     qkv bias    q/k RMSNorm     notes
=========  ==========  ==============  =======================================================
llama      no          no              Llama 2/3/3.1/3.2; ``rope_scaling`` ``llama3``; tied or untied head
mistral    no          no              the Llama graph; ``sliding_window`` is refused past the window
qwen2      yes         no              Qwen2/2.5 (q/k/v biases, o_proj none)
qwen3      no          yes             per-head RMSNorm on q and k before RoPE; explicit ``head_dim``
=========  ==========  ==============  =======================================================

Sources: transformers' ``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py`` and ``modeling_rope_utils.py`` (``_compute_llama3_parameters``,
``_compute_linear_scaling_rope_parameters``); for GGUF files, llama.cpp's ``convert_hf_to_gguf.py``
(compiler/gguf.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
QKV_BIAS = {"qwen2"}
QK_NORM = {"qwen3"}
ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModel(ValueError):
    """The model's architecture or one of its options is not one the builder makes."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's dimensions and switches, read from an HF ``config.json`` (``from_hf``).

    ``inv_freq`` [head_dim / 2] float64: RoPE's inverse frequencies with the model's scaling applied
    (the graph multiplies them by logical positions).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_context: int
    inv_freq: tuple[float, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head (GQA; 1 = plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: dict, where: str = "config.json") -> ModelConfig:
        """Read ``config`` (an HF ``config.json`` as a dict; ``where`` names it in errors).

        Raises ``UnsupportedModel`` naming the architecture (and the supported list) or the option the
        builder does not implement, before any weight is read; ``ValueError`` for a missing field.
        """
        if not isinstance(config, dict):
            raise ValueError(f"{where}: not a model config (a JSON object), but a {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ", ".join(config.get("architectures") or []) or "no 'architectures' given"
            raise UnsupportedModel(f"{where}: architecture {model_type!r} ({archs}) is not supported; the builder "
                                   f"makes {', '.join(SUPPORTED_ARCHITECTURES)}")
        def positive(name: str) -> int:
            if name not in config:
                raise ValueError(f"{where}: field {name!r} missing")
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: field {name!r} must be a positive integer, not {value!r}")
            return value

        hidden, heads = positive("hidden_size"), positive("num_attention_heads")
        head_dim = positive("head_dim") if config.get("head_dim") is not None else hidden // heads
        kv_heads = positive("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
        eps = config.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ValueError(f"{where}: field 'rms_norm_eps' must be a small number, not {eps!r}")
        dims = dict(num_layers=positive("num_hidden_layers"), hidden_size=hidden, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=positive("intermediate_size"),
                    vocab_size=positive("vocab_size"), rms_norm_eps=float(eps))
        if heads % kv_heads:
            raise ValueError(f"{where}: {heads} attention heads do not split into {kv_heads} KV heads")
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"{where}: head_dim {head_dim} must be even (rotary embeddings rotate pairs)")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"{where}: MLP activation {act!r} is not supported (silu only)")
        if config.get("mlp_bias"):
            raise UnsupportedModel(f"{where}: MLP biases (mlp_bias) are not supported")
        attention_bias = bool(config.get("attention_bias", False))
        if attention_bias and model_type not in QKV_BIAS:
            raise UnsupportedModel(f"{where}: attention_bias is not supported for {model_type}")
        max_context = int(config.get("max_position_embeddings") or 2048)
        window = config.get("sliding_window")
        if window and (model_type == "mistral" or config.get("use_sliding_window")) and window < max_context:
            # exact only while the context fits the window: serve no more than that
            max_context = int(window)
        eos = config.get("eos_token_id")
        return cls(model_type=model_type, **dims, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   max_context=max_context, inv_freq=tuple(rope_inv_freq(config, head_dim, where)),
                   qkv_bias=model_type in QKV_BIAS, qk_norm=model_type in QK_NORM,
                   bos_token_id=config.get("bos_token_id"),
                   eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """``from_hf`` on ``folder/config.json``; ``FileNotFoundError`` when there is none."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is neither a .gguf file nor a Hugging Face model folder "
                                    "(no config.json)")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_hf(config, str(path))

    def parameters(self) -> int:
        """Weights in the model (embedding, layers, norms, untied head): its size class (compress.py)."""
        d, kv = self.head_dim, self.num_kv_heads * self.head_dim
        layer = self.hidden_size * (self.num_heads * d * 2 + kv * 2) + 3 * self.hidden_size * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * layer + head


def rope_inv_freq(config: dict, head_dim: int, where: str = "config.json") -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] float64 for ``config``'s ``rope_theta`` and scaling.

    Reads transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``. Scalings:
    none (``default``), ``linear`` (positions / factor) and ``llama3`` (Llama 3.1's: low frequencies
    / factor, high kept, a smooth ramp between; transformers ``_compute_llama3_parameters``). Others
    (yarn, longrope, dynamic) raise ``UnsupportedModel``.
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel(f"{where}: partial rotary embeddings are not supported")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    inv = inv.astype(np.float64)
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / float(params["factor"])
    if rope_type == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_context = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    raise UnsupportedModel(f"{where}: rope scaling {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def hf_weight_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """HF tensor names of decoder layer ``layer``, by role (the same for every supported family)."""
    p = f"model.layers.{layer}."
    names = {
        "input_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
    }
    if cfg.qkv_bias:
        names |= {"q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias",
                  "v_bias": p + "self_attn.v_proj.bias"}
    if cfg.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return names


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The shape each tensor of ``hf_weight_names(cfg, layer)`` must have, by HF name."""
    h, d, q, kv, i = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"input_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "post_norm": (h,),
              "gate": (i, h), "up": (i, h), "down": (h, i), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
              "q_norm": (d,), "k_norm": (d,)}
    return {name: shapes[role] for role, name in hf_weight_names(cfg, layer).items()}


EMBEDDING, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
