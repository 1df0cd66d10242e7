"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture, as its converter writes them) as the stage builder reads
them: the names of gpt-oss's own layer tensors, the HF ``gpt_oss`` config from the file's metadata, and the experts
(``ffn_{gate,up,down}_exps`` with their biases) presented as the HF folder's interleaved ``gate_up_proj`` and
``down_proj`` per expert (compiler/gpt_oss.py builds the graph; compiler/gguf.py calls this module).
"""

from __future__ import annotations

import numpy as np

from .gguf_moe import field
from .weights import WeightsError

GGUF_LAYER_TO_HF = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                    "ffn_gate_inp": "mlp.router"}  # the rest as llama's (compiler/gguf.py GGUF_LAYER_TO_HF)
GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gguf_name(parts: list[str]) -> str | None:
    """The HF name of a gpt-oss GGUF layer tensor ``blk.N.part.suffix`` split at the dots, when it is one of
    gpt-oss's own (``GGUF_LAYER_TO_HF``; ``attn_sinks.weight`` is HF's ``self_attn.sinks``), else None."""
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LAYER_TO_HF:
        return None
    base = f"model.layers.{parts[1]}.{GGUF_LAYER_TO_HF[parts[2]]}"
    return base if parts[2] == "attn_sinks" else f"{base}.{parts[3]}"


def gguf_config(reader, arch: str, config: dict, where: str) -> dict:  # noqa: ANN001 - a GGUF reader
    """The HF ``gpt_oss`` config fields of a llama.cpp ``gpt-oss`` GGUF on top of ``config`` (compiler/gguf.py
    ``gguf_config``'s): experts, top-k and their width (``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``), the sliding window of every other layer from layer 0 (llama.cpp's
    ``set_swa_pattern(2)``, transformers' default ``layer_types``), and YaRN from ``rope.scaling.factor`` and
    ``.original_context_length`` with beta 32 / 1 and the ramp's ends rounded to whole dims (transformers'
    ``truncate``) as llama.cpp's ``ggml_rope_yarn_corr_dims`` rounds them: a GGUF is answered as llama.cpp answers
    it (the HF config of gpt-oss, like OpenAI's reference, does not round; its frequencies differ slightly).
    ``ValueError`` naming the file and the key when one is missing."""
    def key(name: str) -> object:
        value = field(reader, f"{arch}.{name}")
        if value is None:
            raise ValueError(f"{where}: metadata {arch}.{name} missing")
        return value

    rope = dict(config["rope_parameters"]) | {
        "rope_type": "yarn", "factor": float(key("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")), "truncate": True}
    layers = config["num_hidden_layers"]
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
            "num_local_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
            "intermediate_size": int(key("expert_feed_forward_length")), "rope_parameters": rope,
            "sliding_window": int(key("attention.sliding_window")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}


class Interleaved:
    """Rows of two [n, ...] arrays ``a`` and ``b`` taken in turn (a0, b0, a1, b1, ...), read only for the rows
    asked: llama.cpp's converter splits HF's interleaved ``gate_up_proj`` into ``ffn_gate_exps`` (even rows) and
    ``ffn_up_exps`` (odd rows); quantized rows are whole blocks, so interleaving them back moves no bits."""

    def __init__(self, a: np.ndarray, b: np.ndarray) -> None:
        self.a, self.b = a, b

    def __getitem__(self, rows: slice | np.ndarray) -> np.ndarray:
        index = np.arange(2 * len(self.a))[rows]
        out = np.empty((len(index), *self.a.shape[1:]), self.a.dtype)
        odd = index % 2 == 1
        out[~odd], out[odd] = self.a[index[~odd] // 2], self.b[index[odd] // 2]
        return out


class InterleavedBias:
    """gate and up biases [E, I] each as HF's ``gate_up_proj_bias`` [E, 1, 2I] (gate, up, gate, ...), read for the
    experts (rows) asked."""

    def __init__(self, gate: np.ndarray, up: np.ndarray) -> None:
        self.gate, self.up = gate, up

    def __getitem__(self, rows: slice) -> np.ndarray:
        gate, up = np.asarray(self.gate[rows]), np.asarray(self.up[rows])
        return np.stack([gate, up], axis=-1).reshape(len(gate), 1, -1)


def gguf_experts(stacked: dict[str, object], num_layers: int, tensor) -> dict[str, object]:  # noqa: ANN001
    """The builder's tensors of a gpt-oss GGUF's experts: ``stacked`` maps ``blk.N.ffn_{gate,up,down}_exps.{weight,
    bias}`` to gguf-py ``ReaderTensor``s; ``tensor(data, qtype, shape, expert)`` makes compiler/gguf.py's
    ``GGUFTensor``. Per layer and expert ``mlp.experts.{e}.gate_up_proj.weight`` [2I, H] (gate and up rows
    interleaved, ``Interleaved``: OpenVINO's form) and ``down_proj.weight`` [H, I], the blocks as the file has them,
    and the biases ``mlp.experts.gate_up_proj.bias`` [E, 1, 2I] / ``down_proj.bias`` [E, 1, H] (F32); for fleet's
    kernels (compiler/experts.py) gate and up apart as they lie, ``mlp.experts.{e}.gate_proj.weight`` /
    ``up_proj.weight`` [I, H], with their biases ``mlp.experts.gate_proj.bias`` / ``up_proj.bias`` [E, I]. Nothing
    is read.
    ``WeightsError`` naming a missing tensor, or gate and up of different types."""
    import gguf

    out: dict[str, object] = {}
    for layer in range(num_layers):
        def get(role: str, suffix: str):  # noqa: ANN202 - a ReaderTensor
            name = f"blk.{layer}.{role}.{suffix}"
            if name not in stacked:
                raise WeightsError(f"tensor {name} missing: a gpt-oss file has experts with biases in every layer")
            return stacked[name]

        gate, up, down = (get(role, "weight") for role in GGUF_EXPERTS)
        kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in (gate, up)}
        if len(kinds) != 1:
            raise WeightsError(f"blk.{layer}.ffn_gate_exps and ffn_up_exps are of types {sorted(kinds)}: gate_up "
                               "is kept as one matrix, of one type")
        qtype = kinds.pop()
        experts, inter, hidden = (int(d) for d in reversed(gate.shape))
        p = f"model.layers.{layer}.mlp.experts."
        for e in range(experts):
            out[f"{p}{e}.gate_up_proj.weight"] = tensor(Interleaved(gate.data[e], up.data[e]), qtype,
                                                         (2 * inter, hidden), True)
            out[f"{p}{e}.gate_proj.weight"] = tensor(gate.data[e], qtype, (inter, hidden), True)
            out[f"{p}{e}.up_proj.weight"] = tensor(up.data[e], qtype, (inter, hidden), True)
            out[f"{p}{e}.down_proj.weight"] = tensor(down.data[e], gguf.GGMLQuantizationType(down.tensor_type).name,
                                                     (hidden, inter), True)
        gate_bias, up_bias, down_bias = (get(role, "bias") for role in GGUF_EXPERTS)
        for role, bias in (("gate_proj", gate_bias), ("up_proj", up_bias)):
            out[f"{p}{role}.bias"] = tensor(np.asarray(bias.data).reshape(experts, inter), "F32", (experts, inter),
                                            False)
        out[p + "gate_up_proj.bias"] = tensor(InterleavedBias(gate_bias.data, up_bias.data), "F32",
                                              (experts, 1, 2 * inter), False)
        out[p + "down_proj.bias"] = tensor(np.asarray(down_bias.data).reshape(experts, 1, hidden), "F32",
                                           (experts, 1, hidden), False)
    return out
