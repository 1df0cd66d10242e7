"""The family-specific parts of a GGUF file's HF config, as llama.cpp reads such files (llama-model.cpp) and its
converter writes them (convert_hf_to_gguf.py): Gemma 3's local and global layers and Phi-3's partial rotary and
LongRoPE factors. compiler/gguf.py ``gguf_config`` calls them.
"""

from __future__ import annotations

import numpy as np

from .gguf_moe import field

GEMMA3_SWA_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0  # what llama.cpp's llama-model.cpp fixes for gemma3 files
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # RoPE's, not weights


def gemma3_config(reader, config: dict, rope: dict, window: int | None) -> dict:  # noqa: ANN001
    """The Gemma 3 part of a gemma3 GGUF's HF config, as llama.cpp reads the file (llama-model.cpp): local layers
    ``GEMMA3_SWA_PATTERN`` (every 6th global) unless ``gemma3.attention.sliding_window_pattern`` says otherwise, the
    window ``gemma3.attention.sliding_window``, the local RoPE base ``GEMMA3_LOCAL_THETA`` unscaled, the global one
    the file's ``rope.freq_base`` and linear scaling; the softmax scale head_dim ** -0.5 (hidden / heads for the
    27B's 62 layers: llama.cpp's ``f_attention_scale``, the file has no query_pre_attn_scalar); tanh GELU; the norms
    stored as 1 + w (the converter adds the 1), so arch.py adds none (``gguf_norms_plus_one``)."""
    layers = config["num_hidden_layers"]
    pattern = field(reader, "gemma3.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, (list, tuple)):  # per layer: true for a local layer
        local = [bool(v) for v in pattern]
    else:
        local = [bool((i + 1) % int(pattern)) for i in range(layers)]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": int(window or 0) or None,
            "layer_types": ["sliding_attention" if v else "full_attention" for v in local],
            "rope_parameters": {"full_attention": rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA}},
            "query_pre_attn_scalar": scalar, "gguf_norms_plus_one": True,
            "architectures": ["Gemma3ForCausalLM"]}


def phi3_rope(reader, arch: str, head_dim: int, where: str) -> dict:  # noqa: ANN001
    """The HF ``rope_parameters`` of a phi3 GGUF beyond theta, as llama.cpp's converter writes them
    (convert_hf_to_gguf.py ``Phi3MiniModel``): ``partial_rotary_factor`` = ``{arch}.rope.dimension_count`` /
    head_dim, and for a LongRoPE model (Ding et al. 2024) ``rope_factors_short.weight`` and
    ``rope_factors_long.weight`` [rotary dims / 2] f32 with ``{arch}.rope.scaling.attn_factor`` and
    ``.original_context_length``: the ``longrope`` parameters compiler/arch.py reads, with the long factors chosen
    (``"factors": "long"``, as llama-server runs the file at its default context). ``ValueError`` naming the
    file when one of the two factor tensors or the original context is missing."""
    rope: dict = {}
    dims = field(reader, f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        rope["partial_rotary_factor"] = int(dims) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_TENSORS[1:]}
    if not factors:
        return rope
    if len(factors) != 2:
        raise ValueError(f"{where}: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight, "
                         f"the file has only {', '.join(factors)}")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{where}: metadata {arch}.rope.scaling.original_context_length missing (LongRoPE)")
    # "factors": "long": as llama-server at its default context (the model's full one) runs the file: its long
    # factors at every position once the context exceeds the original one (compiler/rope.py module docstring)
    rope |= {"rope_type": "longrope", "original_max_position_embeddings": int(original), "factors": "long",
             "short_factor": np.asarray(factors["rope_factors_short.weight"].data, np.float64).tolist(),
             "long_factor": np.asarray(factors["rope_factors_long.weight"].data, np.float64).tolist()}
    attention = field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        rope["attention_factor"] = float(attention)
    return rope
