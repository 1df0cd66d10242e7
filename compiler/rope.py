"""RoPE's frequencies for each scaling the builder makes (``rope_parameters``), from an HF ``config.json`` dict, as
transformers' ``modeling_rope_utils.py`` computes them (``_compute_linear_scaling_rope_parameters``,
``_compute_llama3_parameters``, ``_compute_longrope_parameters``, ``_compute_yarn_parameters``).

YaRN (Peng et al. 2023, arXiv 2309.00071; transformers ``_compute_yarn_parameters``): each frequency a blend of
itself and itself / ``factor`` along a linear ramp between the dims that turn ``beta_fast`` and ``beta_slow``
times over ``original_max_position_embeddings``, cos and sin times ``attention_factor`` (default 0.1 ln(factor) +
1): fixed frequencies, so exact at every position.

LongRoPE (Ding et al. 2024, arXiv 2402.13753; transformers ``_compute_longrope_parameters``): each rotary
frequency divided by its own factor, one list for contexts up to ``original_max_position_embeddings`` (short)
and one past it (long), cos and sin times ``attention_factor``. transformers switches per forward call (long
factors once a call's largest position reaches the original context; the KV cache keeps keys rotated with the
short ones), which no fixed graph with chunked prefill can follow. The builder takes the short factors and
serves no more than ``original_max_position_embeddings``: exact against transformers at every position it
serves (llama.cpp makes the same choice for a context within the original one). Phi-3-mini-128k, Phi-3.5-mini
and Phi-4-mini so build with a 4096-token context from an HF folder. A GGUF's LongRoPE (``"factors": "long"``,
compiler/gguf_families.py ``phi3_rope``) runs as llama-server runs the same file at its default context, the
model's full one: llama.cpp takes the long factors for every position once its context exceeds the original one
(``llama_model::get_rope_factors``), so the build does, and serves ``max_position_embeddings``.
"""

from __future__ import annotations

import math

import numpy as np

PARTIAL_ROTARY = {"phi3"}  # partial_rotary_factor < 1: RoPE on the first dims of each head only
ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")  # yarn: gpt_oss only (tested there)
YARN = {"gpt_oss"}  # the model types whose yarn is built (compiler/arch.py GPT_OSS)


class UnsupportedModel(ValueError):
    """The model's architecture or one of its options is not one the builder makes (raised by compiler/arch.py
    and here)."""


def rope_inv_freq(config: dict, head_dim: int, where: str = "config.json") -> np.ndarray:
    """RoPE inverse frequencies [rotary_dim / 2] float64 for ``config``'s ``rope_theta`` and scaling
    (``rope_parameters``' first result)."""
    return rope_parameters(config, head_dim, where)[0]


def rope_parameters(config: dict, head_dim: int, where: str = "config.json") -> tuple[np.ndarray, float, int]:
    """RoPE of ``config`` (an HF ``config.json`` dict): (inverse frequencies [rotary_dim / 2] float64,
    cos/sin scale, the largest context these are exact for).

    Reads transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling`` (which wins when
    both are given, as ``PreTrainedConfig.convert_rope_params_to_dict`` has it). rotary_dim is
    ``int(head_dim * partial_rotary_factor)`` (phi3 only; Phi-4-mini 0.75). Scalings: none (``default``),
    ``linear`` (positions / factor), ``llama3`` (Llama 3.1's: low frequencies / factor, high kept, a smooth
    ramp between; transformers ``_compute_llama3_parameters``) and ``longrope`` (Ding et al. 2024, "LongRoPE:
    Extending LLM Context Window Beyond 2 Million Tokens", arXiv 2402.13753; transformers
    ``_compute_longrope_parameters``): frequencies / ``short_factor`` [rotary_dim / 2], cos and sin times
    ``attention_factor`` (default sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings /
    original_max_position_embeddings), exact up to ``original_max_position_embeddings`` (module docstring:
    why not the long factors); for gpt_oss ``yarn`` (module docstring, ``_yarn``). phi3's legacy ``su``/``yarn``
    types are longrope (transformers' ``Phi3Config``). Others (yarn elsewhere, dynamic, ...) raise
    ``UnsupportedModel`` naming the type.
    """
    scaling = dict(config.get("rope_scaling") or {})  # replaces rope_parameters when given, as in transformers 5
    params = scaling or dict(config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    model_type = config.get("model_type")
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and model_type not in PARTIAL_ROTARY:
        raise UnsupportedModel(f"{where}: partial rotary embeddings are not supported for {model_type} "
                               f"(only {', '.join(sorted(PARTIAL_ROTARY))})")
    if rope_type not in ROPE_TYPES or (rope_type == "yarn" and model_type not in YARN):
        raise UnsupportedModel(f"{where}: rope scaling {rope_type!r} is not supported (supported: "
                               f"{', '.join(ROPE_TYPES[:-1])}; yarn for gpt_oss)")
    dim = int(head_dim * float(partial))
    if dim < 2 or dim % 2 or dim > head_dim:
        raise UnsupportedModel(f"{where}: partial_rotary_factor {partial} gives {dim} rotary dims of head_dim "
                               f"{head_dim}: not an even number in 2..{head_dim}")
    powers = theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)  # f32, as transformers
    inv = (1.0 / powers).astype(np.float64)
    context = int(config.get("max_position_embeddings") or 2048)
    if rope_type == "default":
        return inv, 1.0, context
    if rope_type == "linear":
        return inv / float(params["factor"]), 1.0, context
    if rope_type == "longrope":
        return _longrope(config, params, powers, where)
    if rope_type == "yarn":
        return _yarn(config, params, powers, dim), _yarn_attention(params), context
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled), 1.0, context


def _longrope(config: dict, params: dict, powers: np.ndarray, where: str) -> tuple[np.ndarray, float, int]:
    """LongRoPE's frequencies, attention factor and the context they serve (``rope_parameters``; ``powers``
    [rotary_dim / 2] f32: theta ** (2i / rotary_dim)): the short factors up to the original context, or with
    ``params["factors"] == "long"`` (a GGUF's, module docstring) the long ones up to ``max_position_embeddings``."""
    short, long = params.get("short_factor"), params.get("long_factor")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if not isinstance(factors, list) or len(factors) != powers.size:
            raise ValueError(f"{where}: longrope {name} must be a list of {powers.size} numbers (rotary dims / 2), "
                             f"not {factors!r}")
    # Phi3Config's own field comes first (transformers standardize_rope_params); its default is 4096
    original = config.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if original is None:
        original = 4096 if config.get("model_type") == "phi3" else config.get("max_position_embeddings")
    original = int(original)
    max_positions = int(config.get("max_position_embeddings") or original)
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if params.get("factors", "short") not in ("short", "long"):
        raise ValueError(f"{where}: longrope factors must be 'short' or 'long', not {params['factors']!r}")
    if params.get("factors") == "long":
        return (1.0 / (np.asarray(long, np.float32) * powers)).astype(np.float64), float(attention), max_positions
    inv = (1.0 / (np.asarray(short, np.float32) * powers)).astype(np.float64)
    return inv, float(attention), min(original, max_positions)

def _yarn(config: dict, params: dict, powers: np.ndarray, dim: int) -> np.ndarray:
    """YaRN's frequencies (module docstring; transformers ``_compute_yarn_parameters``, in f32 as it computes them)
    [dim / 2] float64 from ``powers`` [dim / 2] f32 = theta ** (2i / dim)."""
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    # as transformers' standardize_rope_params: the config's own field first, else the max context
    original = float(config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                     or config["max_position_embeddings"])
    factor = params.get("factor") or config["max_position_embeddings"] / original
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times in original
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    inv = (np.float32(1) / powers).astype(np.float32)
    interpolation = (np.float32(1) / (np.float32(factor) * powers)).astype(np.float32)
    return (interpolation * (np.float32(1) - extrapolation) + inv * extrapolation).astype(np.float64)


def _yarn_attention(params: dict) -> float:
    """YaRN's cos/sin scale: ``attention_factor``, else from ``factor`` (and ``mscale``/``mscale_all_dim``) as
    transformers' ``get_mscale``: 0.1 m ln(factor) + 1 (1 for factor <= 1)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(params["mscale"]) / mscale(params["mscale_all_dim"]))
    return mscale()
