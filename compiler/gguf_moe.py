"""Mixture-of-Experts GGUF files (``qwen3moe``, and Mixtral as ``llama`` with experts) as the stage builder reads
them: their metadata as an HF ``qwen3_moe`` / ``mixtral`` config, their stacked expert tensors as one tensor per
expert under HF's names, so the HF path (compiler/experts.py) builds them unchanged.

llama.cpp's converter (convert_hf_to_gguf.py: ``Qwen2MoeModel.modify_tensors``, which ``Qwen3MoeModel`` inherits,
and ``LlamaModel.modify_tensors`` for Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``) stacks each layer's
experts' same matrix along a new first axis: ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and
``ffn_down_exps`` [E, H, I] in gguf-py's numpy order (ggml lists [H, I, E]), and writes the router
``blk.N.ffn_gate_inp`` [E, H]. Metadata (gguf-py ``Keys.LLM``): ``{arch}.expert_count``, ``.expert_used_count``
and, for qwen3moe, ``.expert_feed_forward_length`` (a Mixtral expert is ``feed_forward_length`` wide). llama.cpp
renormalises the chosen experts' weights for both (``build_moe_ffn(..., norm_w = true, ...)`` in its qwen3moe and
llama graphs; Mixtral's rule, transformers' ``MixtralSparseMoeBlock``), and makes every layer sparse. Files
converted before llama.cpp stacked the experts (early 2024, e.g. the first published Mixtral GGUFs) hold one tensor
per expert, ``blk.N.ffn_gate.E.weight`` [I, H] and so on; llama.cpp still loads them, and so does the builder.

Each expert is the slice ``data[e]`` of the memory-mapped tensor: quantized rows stay whole blocks. On a CPU stage
the experts of a type fleet's kernels multiply are the stacked tensor's bytes as they lie, [E, rows, row bytes]
(compiler/export.py ``_Weights.experts``, fleet's ``GgufMoeMatMul``: only the chosen experts' blocks are read). On
a GPU/NPU stage experts of a kept type (``gguf.KEPT``) keep their blocks in one stacked constant per matrix
(``_Weights.stacked``: codes [E, rows, cols / g, g], scale and, for offset types, a zero point per group, which the
plugin's GatherMatmulCompressed reads for the chosen experts only); any other type (dequantized by gguf-py, with
the warning) and ``--weights int8`` builds stack them as the HF path does.
"""

from __future__ import annotations

import logging

import numpy as np

from .weights import WeightsError

log = logging.getLogger(__name__)

EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}  # llama.cpp -> role
LEGACY_EXPERTS = {"ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}  # blk.N.ffn_gate.E.weight: one per expert
ROUTER = "ffn_gate_inp"
MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "llama": "mixtral"}  # GGUF arch (with experts) -> HF model_type


def field(reader, key: str, default: object = None) -> object:  # noqa: ANN001
    """GGUF metadata ``key`` decoded (gguf-py ``ReaderField.contents``), ``default`` if absent (as gguf.py's)."""
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def is_moe(reader, arch: str) -> bool:  # noqa: ANN001 - a gguf.GGUFReader or SplitReader
    """Whether a GGUF of architecture ``arch`` is a Mixture-of-Experts: ``qwen3moe``, or a ``llama`` file with
    an ``expert_count`` or stacked expert tensors (Mixtral)."""
    if arch == "qwen3moe":
        return True
    return arch == "llama" and (bool(field(reader, f"{arch}.expert_count")) or
                                any(is_expert_tensor(t.name) for t in reader.tensors))


def is_expert_tensor(name: str) -> bool:
    """Whether GGUF tensor ``name`` holds experts: stacked (``blk.N.ffn_gate_exps.weight``) or one expert's
    (``blk.N.ffn_gate.E.weight``, the older layout)."""
    parts = name.split(".")
    return parts[0] == "blk" and ((len(parts) == 4 and parts[2] in EXPERTS) or
                                  (len(parts) == 5 and parts[2] in LEGACY_EXPERTS and parts[3].isdigit()))


def moe_config(reader, arch: str, config: dict, where: str) -> dict:  # noqa: ANN001
    """The HF config fields of a Mixture-of-Experts GGUF (``is_moe``) on top of ``config`` (compiler/gguf.py
    ``gguf_config``'s dense fields): model_type, experts, top-k, expert width, every layer sparse, renormalised.

    Raises ``ValueError`` naming the file and the key when the metadata is missing or not a positive count, or
    when it contradicts the tensors (``check_tensors``)."""
    def count(name: str, default: object = None) -> int:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{where}: metadata {arch}.{name} missing (a Mixture-of-Experts file has "
                             f"{arch}.expert_count and {arch}.expert_used_count)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: metadata {arch}.{name} must be a positive integer, not {value!r}")
        return int(value)

    experts, used = count("expert_count"), count("expert_used_count")
    if used > experts:
        raise ValueError(f"{where}: metadata {arch}.expert_used_count {used} is more than {arch}.expert_count "
                         f"{experts}")
    width = count("expert_feed_forward_length", config["intermediate_size"] if arch == "llama" else None)
    model_type = MOE_ARCHITECTURES[arch]
    check_tensors(reader, where, config["num_hidden_layers"], experts, width, config["hidden_size"])
    out = {"model_type": model_type, "num_local_experts": experts, "num_experts_per_tok": used,
           "architectures": ["MixtralForCausalLM" if model_type == "mixtral" else "Qwen3MoeForCausalLM"]}
    if model_type == "mixtral":
        return out | {"intermediate_size": width}
    # llama.cpp renormalises unless the file says otherwise (gguf-py Keys.LLM.EXPERT_WEIGHTS_NORM)
    return out | {"moe_intermediate_size": width, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": bool(field(reader, f"{arch}.expert_weights_norm", True))}


def check_tensors(reader, where: str, layers: int, experts: int, width: int, hidden: int) -> None:  # noqa: ANN001
    """Refuse (``WeightsError`` naming the file, the tensor, its shape and the metadata it contradicts) a layer's
    router or stacked experts whose shape is not [E, H] / [E, I, H] / [E, H, I] for E = expert_count, I = the
    expert width, H = embedding_length, or a layer without them (llama.cpp makes every layer sparse); in the older
    layout, each of its E experts' [I, H] / [H, I] tensors, and no more."""
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    want = {ROUTER: (experts, hidden), "ffn_gate_exps": (experts, width, hidden),
            "ffn_up_exps": (experts, width, hidden), "ffn_down_exps": (experts, hidden, width)}
    for layer in range(layers):
        layer_want = want
        if f"blk.{layer}.ffn_gate_exps.weight" not in shapes and f"blk.{layer}.ffn_gate.0.weight" in shapes:
            layer_want = {ROUTER: want[ROUTER]} | {f"{role[:-5]}.{e}": want[role][1:] for role in EXPERTS
                                                   for e in range(experts)}
            extra = f"blk.{layer}.ffn_gate.{experts}.weight"
            if extra in shapes:
                raise WeightsError(f"{where}: tensor {extra} is an expert beyond the metadata's expert_count "
                                   f"{experts}")
        for role, shape in layer_want.items():
            name = f"blk.{layer}.{role}.weight"
            if name not in shapes:
                raise WeightsError(f"{where}: tensor {name} missing: a Mixture-of-Experts file (expert_count "
                                   f"{experts}) has a router and stacked experts in every layer")
            if shapes[name] != shape:
                raise WeightsError(f"{where}: tensor {name} has shape {list(shapes[name])}, but the metadata "
                                   f"(expert_count {experts}, expert width {width}, embedding_length {hidden}) "
                                   f"gives {list(shape)}")


def router_name(model_type: str) -> str:
    """The HF module of a ``model_type`` layer's router (``blk.N.ffn_gate_inp``)."""
    return "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"


def expert_slices(name: str, data: np.ndarray, shape: tuple[int, ...], model_type: str) -> list[tuple]:
    """The experts of GGUF tensor ``name`` (``is_expert_tensor``; ``data`` the reader's memory-mapped view, ``shape``
    its numpy shape): of a stacked one (``blk.N.ffn_{gate,up,down}_exps.weight``, [E, rows, cols or bytes per row])
    (HF name, data[e], (rows, cols)) per expert; of one expert's (``blk.N.ffn_gate.E.weight``) that one. Named as
    compiler/arch.py ``hf_weight_names`` names them for ``model_type``. Nothing is read."""
    parts = name.split(".")
    layer, role = parts[1], parts[2]
    if len(parts) == 5:  # the older layout: one expert
        return [(expert_name(layer, LEGACY_EXPERTS[role], int(parts[3]), model_type), data, tuple(shape))]
    return [(expert_name(layer, EXPERTS[role], e, model_type), data[e], tuple(shape[1:])) for e in range(shape[0])]


def expert_name(layer: int | str, part: str, expert: int, model_type: str) -> str:
    """HF's name of expert ``expert``'s ``part`` ("gate", "up", "down") matrix in layer ``layer``: mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2``, qwen3_moe's ``mlp.experts.{e}.{part}_proj``."""
    from .arch import MIXTRAL_EXPERT

    if model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{MIXTRAL_EXPERT[part]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
