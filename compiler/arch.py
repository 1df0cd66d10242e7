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
phi3       no          no              Phi-3/3.5, Phi-4-mini: fused ``qkv_proj`` and ``gate_up_proj`` (split at
                                       build: compiler/source.py), partial rotary, LongRoPE; ``sliding_window``
                                       as mistral
qwen3_moe  no          yes             Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): qwen3's attention; the MLP of
                                       each sparse layer (``decoder_sparse_step``, ``mlp_only_layers``) a
                                       router and ``num_experts`` SwiGLU experts, top-k per token
mixtral    no          no              Mixtral 8x7B/8x22B: llama's attention; every layer's MLP a router
                                       (``block_sparse_moe.gate``) and ``num_local_experts`` SwiGLU experts
                                       (``w1`` gate, ``w3`` up, ``w2`` down) of ``intermediate_size``, top-k
                                       renormalised (transformers' ``MixtralSparseMoeBlock``)
gpt_oss    q/k/v/o     no              gpt-oss (20b, 120b): attention sinks (a learned logit per head beside the
                                       keys), ``layer_types`` alternating sliding-window and full layers, YaRN
                                       RoPE; every MLP a biased router (top-k of its logits, then softmax
                                       over those) and experts with biases and the clamped SwiGLU
                                       (compiler/gpt_oss.py)
=========  ==========  ==============  =======================================================

RoPE scalings (``rope_parameters``: linear, llama3, LongRoPE, YaRN): compiler/rope.py.

Gemma 3 (``gemma3_text``, ``GEMMA``; transformers ``modeling_gemma3.py``) is the same decoder with: embeddings
times sqrt(hidden) (f32: the graph's dtype), RMSNorm as x (1 + w) (``norm_offset``: HF stores w; llama.cpp's
GGUF converter stores 1 + w), four norms a layer (the attention's output and the MLP's input and output have
their own), q/k RMSNorm per head, GeGLU with tanh GELU, softmax scale ``query_pre_attn_scalar ** -0.5``, and
local (``sliding_attention``) layers interleaved with global ones: a local layer sees keys fewer than
``sliding_window`` logical positions back (from the visibility mask, compiler/export.py) and has its own RoPE
base (``rope_local_base_freq``), the global ones ``rope_theta`` and ``rope_scaling``. Logit softcapping (Gemma 2)
is refused. A GGUF's norms are 1 + w already (compiler/gguf_families.py ``gemma3_config``).

Refused, naming what is missing (``UnsupportedModel``): a vision or audio tower (``vision_config``, ...),
layers that are not attention (``layer_types`` with ``linear_attention``: Qwen3-Next/Qwen3.5's gated delta
net; recurrent or state-space blocks), a rope type not in compiler/rope.py ``ROPE_TYPES``, partial rotary outside
phi3.

Sources: transformers' ``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py``, ``modeling_phi3.py`` and ``modeling_rope_utils.py`` (``_compute_llama3_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_longrope_parameters``); for GGUF files, llama.cpp's ``convert_hf_to_gguf.py``
(compiler/gguf.py).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .rope import UnsupportedModel, rope_parameters

__all__ = ["UnsupportedModel"]  # raised here and by compiler/rope.py; callers catch it from here

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral", "gpt_oss")
QKV_BIAS = {"qwen2", "gpt_oss"}
GPT_OSS = {"gpt_oss"}  # o_proj bias, attention sinks, sliding layers, its own router and experts (compiler/gpt_oss.py)
QK_NORM = {"qwen3", "qwen3_moe"}
# sparse layers: router mlp.gate [E, H], experts mlp.experts.{e}.{gate,up,down}_proj
MOE = {"qwen3_moe", "mixtral", "gpt_oss"}
MLP_ACTS = ("silu", "relu")  # a dense model's gated MLP: SwiGLU, or ReGLU (the ReLU-family sparse models)
MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}  # mixtral's names: block_sparse_moe.experts.{e}.w1 ...
FUSED = {"phi3"}  # one qkv_proj [q + 2 kv, H] and one gate_up_proj [2 I, H] per layer (source.py splits them)
SLIDING = {"mistral", "phi3"}  # sliding_window applies without use_sliding_window
ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # layer_types the Llama decoder's attention covers
GEMMA = {"gemma3_text"}  # Gemma 3's text decoder (module docstring; ModelConfig.from_hf: _gemma3)
SUPPORTED_ARCHITECTURES += tuple(sorted(GEMMA))
QK_NORM |= GEMMA
NOT_BUILT = {  # config keys of parts the builder does not make -> what they are
    "vision_config": "a vision tower", "vision_tower": "a vision tower", "mm_vision_tower": "a vision tower",
    "audio_config": "an audio tower", "speech_config": "an audio tower",
    "linear_attn_config": "linear-attention layers", "block_types": "recurrent blocks",
    "hybrid_override_pattern": "state-space (Mamba) layers", "mamba_d_state": "state-space (Mamba) layers",
    "attn_layer_period": "state-space (Mamba) layers", "ssm_cfg": "state-space (Mamba) layers",
}
NOT_ATTENTION = {"linear_attention": "linear-attention layers (gated delta net, as Qwen3-Next/Qwen3.5)",
                 "mamba": "state-space (Mamba) layers", "recurrent": "recurrent layers", "conv": "convolution layers"}


def refuse_parts(config: dict, where: str = "config.json") -> None:
    """Raise ``UnsupportedModel`` naming the part of ``config`` (an HF ``config.json`` dict, its ``text_config``
    too) that the builder does not make: a vision or audio tower (``NOT_BUILT``), or ``layer_types`` other than
    attention (``NOT_ATTENTION``: e.g. Qwen3.5's ``linear_attention``, gated delta net layers)."""
    arch = config.get("model_type")
    archs = ", ".join(config.get("architectures") or []) or "no 'architectures' given"
    for part in (config, config.get("text_config") or {}):
        if not isinstance(part, dict):
            continue
        for key, what in NOT_BUILT.items():
            if part.get(key):
                raise UnsupportedModel(f"{where}: {arch!r} ({archs}) has {what} ({key!r}), which the builder does "
                                       "not make: it builds text decoders of attention layers only")
        kinds = sorted({k for k in part.get("layer_types") or [] if k not in ATTENTION_LAYERS}, key=str)
        if kinds:
            what = "; ".join(f"{k!r}: {NOT_ATTENTION.get(k, 'layers that are not attention')}" for k in kinds)
            raise UnsupportedModel(f"{where}: {arch!r} ({archs}) has layer_types the builder does not make ({what});"
                                   f" it builds {' and '.join(ATTENTION_LAYERS)} layers only")


GGUF_NOT_BUILT = {  # GGUF general.architecture (llama.cpp's names) of models with parts the builder does not make
    **dict.fromkeys(("qwen3next", "qwen35", "qwen35moe"), NOT_ATTENTION["linear_attention"]),
    "kimi-linear": "linear-attention layers (Kimi delta attention)",
    **dict.fromkeys(("mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                     "plamo2"), NOT_ATTENTION["mamba"]),
    **dict.fromkeys(("rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"), "recurrent (RWKV) layers"),
    **dict.fromkeys(("lfm2", "lfm2moe"), "short-convolution layers"),
    "clip": "only a vision or audio tower (an mmproj file, llama.cpp's projector beside a language model's GGUF)",
    **dict.fromkeys(("qwen2vl", "qwen3vl", "qwen3vlmoe"), "a vision-language decoder's multimodal RoPE (M-RoPE)"),
}


def refuse_gguf_architecture(arch: str, where: str) -> None:
    """Raise ``UnsupportedModel`` naming what a GGUF of architecture ``arch`` has that the builder does not make
    (``GGUF_NOT_BUILT``: Qwen3.5's gated delta net, Mamba, RWKV, a vision tower's mmproj file ...)."""
    if arch in GGUF_NOT_BUILT:
        raise UnsupportedModel(f"{where}: GGUF architecture {arch!r} has {GGUF_NOT_BUILT[arch]}, which the builder "
                               "does not make: it builds text decoders of attention layers only")


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
    fused: bool = False  # phi3: qkv_proj and gate_up_proj in the source, split into q/k/v, gate/up at build
    rope_scale: float = 1.0  # cos and sin times this (LongRoPE's attention_factor)
    # Mixture-of-Experts (qwen3_moe): the sparse layers, their experts (each SwiGLU of moe_intermediate_size),
    # experts_per_token chosen per token by softmax + top-k of the router, their weights renormalised to sum 1
    # when norm_topk_prob (transformers' Qwen3MoeTopKRouter)
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 (module docstring; the defaults leave every other graph as it was)
    norm_offset: float = 0.0  # RMSNorm x (w + norm_offset): 1 for Gemma's HF weights (llama.cpp's GGUF adds it)
    embed_scale: float = 1.0  # embeddings x this (Gemma: sqrt(hidden), f32)
    mlp_act: str = "silu"  # "relu": ReGLU (ReLU-family sparse models); "gelu_tanh": GeGLU (Gemma)
    sandwich_norms: bool = False  # post-attention, pre- and post-feedforward norms (four a layer)
    attn_scale: float | None = None  # softmax scale (None: head_dim ** -0.5); Gemma query_pre_attn_scalar ** -0.5
    sliding_window: int = 0  # local layers see keys fewer than this many logical positions back (0: none)
    sliding_layers: tuple[bool, ...] = ()  # per layer: a local (sliding-window) layer
    local_inv_freq: tuple[float, ...] = ()  # the local layers' RoPE frequencies (their own base, no scaling)
    # gpt-oss (compiler/gpt_oss.py): o_proj's bias, a sink logit per head, its MoE (biased router, top-k then
    # softmax, experts of one interleaved gate_up and down with biases, clamped SwiGLU)
    gpt_oss: bool = False

    @property
    def read_intermediate_size(self) -> int:
        """The MLP width a decoded token reads per layer, on average over the layers: ``intermediate_size``, or
        for a Mixture-of-Experts its chosen experts' (``moe_widths``). The build's default split balances
        weight reads with it, as the planner does."""
        if not self.moe_layers:
            return self.intermediate_size
        moe = dict(moe_layers=self.moe_layers, num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                   moe_intermediate_size=self.moe_intermediate_size)
        return moe_widths(self.num_layers, self.hidden_size, self.intermediate_size, moe)[0]

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones; ``head_dim`` unless partial rotary)."""
        return 2 * len(self.inv_freq)

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
        refuse_parts(config, where)
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
        gemma = _gemma3(config, head_dim, where) if model_type in GEMMA else {}
        if model_type in GPT_OSS:
            gemma = _gpt_oss(config, where)
        act = "silu" if gemma else config.get("hidden_act", "silu")  # _gemma3 checks Gemma's GELU
        if act not in MLP_ACTS or (act != "silu" and (model_type in MOE or model_type in GPT_OSS)):
            raise UnsupportedModel(f"{where}: MLP activation {act!r} is not supported (silu; relu for dense "
                                   "models: ReGLU, as ReluLLaMA, ProSparse and MiniCPM-S)")
        if act != "silu":
            dims |= dict(mlp_act=act)
        if config.get("mlp_bias"):
            raise UnsupportedModel(f"{where}: MLP biases (mlp_bias) are not supported")
        attention_bias = bool(config.get("attention_bias", False))
        if attention_bias and model_type not in QKV_BIAS:
            raise UnsupportedModel(f"{where}: attention_bias is not supported for {model_type}")
        max_context = int(config.get("max_position_embeddings") or 2048)
        window = config.get("sliding_window")
        if window and (model_type in SLIDING or config.get("use_sliding_window")) and window < max_context:
            # exact only while the context fits the window: serve no more than that
            max_context = int(window)
        inv_freq, rope_scale, rope_context = rope_parameters(gemma.pop("global_rope", config), head_dim, where)
        dims |= gemma
        if model_type in GPT_OSS:  # one RoPE for both kinds of layer
            dims |= dict(local_inv_freq=tuple(inv_freq))
        if rope_context < max_context:  # LongRoPE: exact up to the original context (module docstring)
            log.warning("%s: LongRoPE built with its short factors: context %d tokens (original_max_position_"
                        "embeddings), not %d", where, rope_context, max_context)
            max_context = rope_context
        eos = config.get("eos_token_id")
        if model_type in MOE:
            dims |= moe_dims(config | ({"moe_intermediate_size": config["intermediate_size"]} if model_type in GPT_OSS
                                       else {}), dims["num_layers"], where)
        return cls(model_type=model_type, **dims, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   max_context=max_context, inv_freq=tuple(inv_freq), rope_scale=rope_scale,
                   qkv_bias=model_type in QKV_BIAS, qk_norm=model_type in QK_NORM, fused=model_type in FUSED,
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
        """Weights in the model (embedding, layers, norms, untied head): its size class (compress.py); a
        Mixture-of-Experts counts every expert and router."""
        d, kv = self.head_dim, self.num_kv_heads * self.head_dim
        layer = self.hidden_size * (self.num_heads * d * 2 + kv * 2) + 3 * self.hidden_size * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        moe = len(self.moe_layers) * (self.hidden_size * self.num_experts * (3 * self.moe_intermediate_size + 1)
                                      - 3 * self.hidden_size * self.intermediate_size)
        return self.vocab_size * self.hidden_size + self.num_layers * layer + head + moe


def moe_dims(config: dict, num_layers: int, where: str = "config.json") -> dict:
    """The Mixture-of-Experts fields of ``ModelConfig`` from a qwen3_moe or mixtral ``config.json``: layer ``i``
    is sparse unless in ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0`` (transformers'
    ``Qwen3MoeDecoderLayer``); ``num_experts`` (saved as ``num_local_experts`` by transformers 5). mixtral: every
    layer sparse, experts of ``intermediate_size``, top-k weights renormalised (``MixtralSparseMoeBlock``)."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    top_k, inter = config.get("num_experts_per_tok"), config.get("moe_intermediate_size")
    if config.get("model_type") == "mixtral":
        inter, config = config.get("intermediate_size"), {k: v for k, v in config.items() if k != "mlp_only_layers"}
        config |= {"decoder_sparse_step": 1, "norm_topk_prob": True}
    step = config.get("decoder_sparse_step", 1)
    for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("moe_intermediate_size", inter),
                        ("decoder_sparse_step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: field {name!r} must be a positive integer, not {value!r}")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} is more than the {experts} experts")
    dense = set(config.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(moe_layers=layers, num_experts=experts, experts_per_token=top_k, moe_intermediate_size=inter,
                norm_topk_prob=bool(config.get("norm_topk_prob", False)))


def moe_widths(num_layers: int, hidden: int, dense_intermediate: int, moe: dict) -> tuple[int, int]:
    """(the MLP width a decoded token reads, the weights a layer stores but a token does not read), each the mean
    over the ``num_layers`` layers, of a model whose sparse layers are ``moe`` (``moe_dims``' fields): a sparse
    layer reads its ``experts_per_token`` experts of ``moe_intermediate_size`` and stores all ``num_experts`` and
    the router [E, hidden] too; a dense one reads and stores a SwiGLU of ``dense_intermediate``. The planner
    counts the first for speed and both for memory (compiler/planner.py ``ModelDims``). The router, read in full
    by every token (E x hidden, 0.5% of a Qwen3-30B-A3B layer's reads), counts as stored only."""
    sparse, k, e = len(moe["moe_layers"]), moe["experts_per_token"], moe["num_experts"]
    inter = moe["moe_intermediate_size"]
    active = (sparse * k * inter + (num_layers - sparse) * dense_intermediate) // num_layers
    idle = sparse * hidden * ((e - k) * 3 * inter + e) // num_layers
    return active, idle


def _gpt_oss(config: dict, where: str) -> dict:
    """The gpt-oss fields of ``ModelConfig`` from its HF config (transformers ``GptOssConfig``): the sliding
    (``sliding_attention``) layers of ``layer_types`` (default: every other one from layer 0, as ``GptOssConfig``
    makes them) and their ``sliding_window``, the flag for its attention and MLP. ``ValueError`` for sliding
    layers without a positive window."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    sliding = tuple(t == "sliding_attention" for t in types)
    window = config.get("sliding_window")
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_attention layers need a positive sliding_window, not {window!r}")
    return dict(gpt_oss=True, sliding_window=int(window) if any(sliding) else 0, sliding_layers=sliding)


def _gemma3(config: dict, head_dim: int, where: str) -> dict:
    """Gemma 3's ``ModelConfig`` fields (transformers ``modeling_gemma3.py``), plus ``global_rope``: a config
    dict whose ``rope_parameters`` are the global layers' RoPE.

    Local (``sliding_attention``) layers from ``layer_types``, or all but every ``sliding_window_pattern``-th
    (transformers' default 6); the global layers' RoPE is ``rope_parameters["full_attention"]`` or
    ``rope_theta`` with ``rope_scaling`` (as ``Gemma3TextConfig.convert_rope_params_to_dict``), the local
    layers' ``rope_parameters["sliding_attention"]`` or ``rope_local_base_freq``, unscaled. Refused:
    softcapping (Gemma 2's; None in Gemma 3), bidirectional attention, an activation other than tanh GELU."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise UnsupportedModel(f"{where}: {key} {config[key]!r} is not supported (Gemma 3 sets it None)")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{where}: use_bidirectional_attention is not supported (causal decoders only)")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModel(f"{where}: MLP activation {act!r} is not supported for gemma3 (gelu_pytorch_tanh)")
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if not types:
        pattern = int(config.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"{where}: {len(types)} layer_types for {layers} layers")
    sliding = tuple(t == "sliding_attention" for t in types)
    window = config.get("sliding_window")
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_attention layers need a positive sliding_window, not {window!r}")
    params = dict(config.get("rope_parameters") or {})
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    full |= dict(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    base = {"model_type": config.get("model_type"), "max_position_embeddings": config.get("max_position_embeddings")}
    local_inv, local_scale, _ = rope_parameters(base | {"rope_parameters": local}, head_dim, where)
    if local_scale != 1.0:
        raise UnsupportedModel(f"{where}: the sliding layers' rope {local!r} is not supported")
    # transformers multiplies in the embedding's dtype at run time: f32 here (the graph's), as llama.cpp does
    embed_scale = float(np.float32(math.sqrt(int(config["hidden_size"]))))
    # a GGUF's norms are 1 + w already (llama.cpp's converter adds the 1: compiler/gguf_families.py gemma3_config)
    offset = 0.0 if config.get("gguf_norms_plus_one") else 1.0
    return dict(global_rope=base | {"rope_parameters": full}, norm_offset=offset, embed_scale=embed_scale,
                mlp_act="gelu_tanh", sandwich_norms=True, attn_scale=float(config.get("query_pre_attn_scalar", 256))
                ** -0.5, sliding_window=int(window) if any(sliding) else 0, sliding_layers=sliding,
                local_inv_freq=tuple(local_inv))


def _gpt_oss_names(cfg: ModelConfig, p: str) -> dict[str, str]:
    """The gpt-oss roles of decoder layer prefix ``p`` ("model.layers.3."): o_proj's bias, the sinks, the router
    and its bias, each expert's ``gate_up`` and ``down`` (compiler/gpt_oss.py ``GptOssWeights``' views) and the experts' biases."""
    names = {"o_bias": p + "self_attn.o_proj.bias", "sinks": p + "self_attn.sinks",
             "router": p + "mlp.router.weight", "router_bias": p + "mlp.router.bias",
             "experts.gate_up_bias": p + "mlp.experts.gate_up_proj.bias",
             "experts.down_bias": p + "mlp.experts.down_proj.bias"}
    for e in range(cfg.num_experts):
        names |= {f"expert.{e}.gate_up": p + f"mlp.experts.{e}.gate_up_proj.weight",
                  f"expert.{e}.down": p + f"mlp.experts.{e}.down_proj.weight"}
    return names



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
    if layer in cfg.moe_layers:  # a router and experts instead of the MLP: roles "router", "expert.{e}.{gate,up,down}"
        del names["gate"], names["up"], names["down"]
        if cfg.gpt_oss:  # experts.{e}.gate_up_proj/down_proj: compiler/gpt_oss.py's views of the stacked tensors
            names |= _gpt_oss_names(cfg, p)
        elif cfg.model_type == "mixtral":
            names["router"] = p + "block_sparse_moe.gate.weight"
            for e in range(cfg.num_experts):
                names |= {f"expert.{e}.{part}": p + f"block_sparse_moe.experts.{e}.{w}.weight"
                          for part, w in MIXTRAL_EXPERT.items()}
        else:
            names["router"] = p + "mlp.gate.weight"
            for e in range(cfg.num_experts):
                names |= {f"expert.{e}.{part}": p + f"mlp.experts.{e}.{part}_proj.weight"
                          for part in ("gate", "up", "down")}
    if cfg.qkv_bias:
        names |= {"q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias",
                  "v_bias": p + "self_attn.v_proj.bias"}
    if cfg.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    if cfg.sandwich_norms:  # Gemma: post_norm is the attention output's; the MLP's input and output have theirs
        names |= {"pre_ff_norm": p + "pre_feedforward_layernorm.weight",
                  "post_ff_norm": p + "post_feedforward_layernorm.weight"}
    return names


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The shape each tensor of ``hf_weight_names(cfg, layer)`` must have, by HF name."""
    h, d, q, kv, i = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"input_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "post_norm": (h,),
              "gate": (i, h), "up": (i, h), "down": (h, i), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
              "q_norm": (d,), "k_norm": (d,), "pre_ff_norm": (h,), "post_ff_norm": (h,), "router": (cfg.num_experts, h)}
    e = cfg.moe_intermediate_size
    expert = {"gate": (e, h), "up": (e, h), "down": (h, e), "gate_up": (2 * e, h)}
    shapes |= {"o_bias": (h,), "sinks": (cfg.num_heads,), "router_bias": (cfg.num_experts,),
               "experts.gate_up_bias": (cfg.num_experts, 1, 2 * e), "experts.down_bias": (cfg.num_experts, 1, h)}
    return {name: shapes[role] if role in shapes else expert[role.rsplit(".", 1)[1]]
            for role, name in hf_weight_names(cfg, layer).items()}


EMBEDDING, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
