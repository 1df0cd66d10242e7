"""gpt-oss (OpenAI's gpt-oss-20b and -120b; transformers ``modeling_gpt_oss.py``, HF ``model_type`` ``gpt_oss``) as
the stage builder makes it: what differs from the Llama decoder of compiler/layers.py.

* Attention: q/k/v/o biases, and a learned "sink" logit per head (``self_attn.sinks`` [heads]) that joins every
  query's softmax as one more column and is dropped after it (``sdpa_with_sinks``): the weights of the real keys
  sum to less than 1. OpenVINO's ScaledDotProductAttention takes the sinks as an input, so these layers stay one
  fused stateful SDPA on the CPU plugin (the KV state's ReadValue -> Gather -> Concat chain is kept).
* ``layer_types`` alternates sliding-window (``sliding_window``, 128) and full layers: a sliding layer's keys
  ``sliding_window`` or more logical positions back are hidden (compiler/layers.py ``window_mask``, as Gemma 3's).
* YaRN RoPE (compiler/arch.py ``_yarn``): fixed frequencies and an attention factor on cos and sin.
* Every MLP is a Mixture-of-Experts (``gpt_oss_moe``): the router is a biased linear layer, its top
  ``num_experts_per_tok`` logits are chosen and softmaxed among themselves (transformers' ``GptOssTopKRouter``);
  each expert is one ``gate_up`` projection whose even outputs are the gate and odd ones the up (HF's
  ``gate_up_proj`` [E, H, 2I], interleaved), then the clamped SwiGLU ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702
  g)`` with g = min(gate, 7), then ``down``, each with its bias (``GptOssExperts._apply_gate``).

HF folders hold the experts stacked (``mlp.experts.gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H], as x @
W) with their biases ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H]. ``GptOssWeights`` presents them
as the builder's per-expert matrices (``mlp.experts.{e}.gate_up_proj.weight`` [2I, H], ``...down_proj.weight`` [H,
I]: each expert's slice transposed, read when written) and the biases as [E, 1, 2I] / [E, 1, H] f32 constants of
their fp16 values (the values the build stores every weight as), so the experts block is exactly the graph
OpenVINO's ``FuseVectorizedMOE2GEMM`` matches (openvino src/common/transformations, matmul_experts_fusion.cpp: the
form optimum-intel exports gpt-oss in), which the CPU plugin runs on the chosen experts only.

A checkpoint whose experts are stored in MXFP4 (``gate_up_proj_blocks`` / ``_scales``, as openai/gpt-oss-20b
is published) is refused naming them; its GGUF (llama.cpp's converter keeps MXFP4) is the way to build it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as op
from openvino.utils.node_factory import NodeFactory

from .layers import ROUTER_SOFTMAX, f32, i64
from .weights import WeightsError, check_shapes

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # transformers' GptOssExperts.alpha, .limit
VIEWS = ("gate_up_proj", "down_proj")  # the stacked expert matrices, each expert's slice a view


def weight_names(cfg, p: str) -> dict[str, str]:  # noqa: ANN001 - an arch.ModelConfig
    """The gpt-oss roles of decoder layer prefix ``p`` ("model.layers.3."): o_proj's bias, the sinks, the router
    and its bias, each expert's ``gate_up`` and ``down`` (``GptOssWeights``' views) and the experts' biases."""
    names = {"o_bias": p + "self_attn.o_proj.bias", "sinks": p + "self_attn.sinks",
             "router": p + "mlp.router.weight", "router_bias": p + "mlp.router.bias",
             "experts.gate_up_bias": p + "mlp.experts.gate_up_proj.bias",
             "experts.down_bias": p + "mlp.experts.down_proj.bias"}
    for e in range(cfg.num_experts):
        names |= {f"expert.{e}.gate_up": p + f"mlp.experts.{e}.gate_up_proj.weight",
                  f"expert.{e}.down": p + f"mlp.experts.{e}.down_proj.weight"}
    return names


@dataclass(frozen=True)
class View:
    """A tensor ``GptOssWeights`` makes of a stacked one: expert ``expert``'s slice of ``source`` transposed
    (``expert`` >= 0), or all of a bias [E, n] as [E, 1, n] (``expert`` -1); ``shape`` what it presents."""

    source: str
    expert: int
    shape: tuple[int, ...]


class GptOssWeights:
    """A gpt-oss HF folder's weights (``inner``: a ``weights.SafetensorsWeights``) with its stacked experts
    presented as the builder reads experts (module docstring); every other tensor as ``inner`` has it.

    Raises ``WeightsError`` naming the tensors of a checkpoint whose experts are MXFP4 blocks."""

    def __init__(self, inner, num_layers: int) -> None:  # noqa: ANN001
        self.inner, self.folder = inner, inner.folder
        blocks = sorted(n for n in inner.tensors if n.endswith(("_blocks", "_scales")))
        if blocks:
            raise WeightsError(f"{inner.folder}: experts stored as MXFP4 blocks ({', '.join(blocks[:2])}, ...) are "
                               "not read from HF folders; build the model's GGUF (llama.cpp keeps MXFP4)")
        self.tensors: dict[str, object] = dict(inner.tensors)
        for layer in range(num_layers):
            p = f"model.layers.{layer}.mlp.experts."
            for name in VIEWS:
                stacked = self.tensors.get(p + name)
                if stacked is not None and len(stacked.shape) == 3:
                    experts, rows, cols = stacked.shape
                    for e in range(experts):
                        self.tensors[f"{p}{e}.{name}.weight"] = View(p + name, e, (cols, rows))
                bias = self.tensors.get(f"{p}{name}_bias")
                if bias is not None and len(bias.shape) == 2:
                    self.tensors[f"{p}{name}.bias"] = View(f"{p}{name}_bias", -1, (bias.shape[0], 1, bias.shape[1]))

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` (a view's as presented)."""
        return tuple(self.tensors[name].shape)

    def kind(self, name: str) -> str:
        """``"f32"`` for the experts' biases (their fp16 values in f32 constants: OpenVINO's MoE pattern wants
        constants there), else ``"f16"``."""
        view = self.tensors[name]
        return "f32" if isinstance(view, View) and view.expert < 0 else "f16"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def check(self, expected: dict[str, tuple[int, ...]], where: str = "config.json") -> None:
        """Raise ``WeightsError`` unless every name in ``expected`` is here with that shape."""
        check_shapes(self.tensors, expected, self.folder, where)

    def tensor(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``name`` (rows ``[start, stop)`` of it) as float16 (``SafetensorsWeights.tensor``), a view made
        from its stacked tensor: an expert's slice transposed, a bias reshaped and held as float32 of its
        float16 values; into ``out`` when given."""
        view = self.tensors[name]
        if not isinstance(view, View):
            return self.inner.tensor(name, out=out, rows=rows)
        if view.expert < 0:
            values = self.inner.tensor(view.source).astype(np.float32).reshape(view.shape)
        else:
            values = self.inner.tensor(view.source, rows=(view.expert, view.expert + 1))[0].T
        if rows is not None:
            values = values[rows[0]:rows[1]]
        if out is None:
            return np.ascontiguousarray(values)
        out[...] = values
        return out


def sdpa_with_sinks(q: ov.Output, keys: ov.Output, values: ov.Output, mask: ov.Output, scale: float,
                    sinks: ov.Output) -> ov.Output:
    """Attention with a sink logit per head (transformers' gpt-oss ``eager_attention_forward``; Xiao et al. 2023,
    "Efficient Streaming Language Models with Attention Sinks"): q [B, heads, S, D], keys and values [B, heads, T,
    D] (KV heads repeated), mask [B, 1, S, T] additive, sinks [heads] f32 -> [B, heads, S, D]. OpenVINO's
    ``ScaledDotProductAttention`` (opset13) takes the sinks as its sixth input, [1, heads, 1, 1]: its spec
    concatenates the sink to each row of scores before the softmax and drops that column after, exactly
    ``softmax([q k^T scale + mask, sink])[..., :T] @ V``. The CPU plugin keeps it one fused stateful SDPA that reads
    the KV cache from its state, as for every other architecture (``fleet-compiler inspect`` counts it so)."""
    sink = op.reshape(sinks, i64([1, -1, 1, 1]), special_zero=False)
    return NodeFactory("opset13").create("ScaledDotProductAttention", [q, keys, values, mask, f32(scale),
                                                                       sink.output(0)], {"causal": False}).output(0)


def gpt_oss_moe(x: ov.Output, w: dict[str, ov.Output], experts: dict[str, ov.Output], cfg,  # noqa: ANN001
                layer: int) -> ov.Output:
    """gpt-oss's MLP (module docstring; transformers ``GptOssMLP``), x [B, S, H] f32 -> [B, S, H]: router logits
    ``x W^T + b`` [N, E], their top ``experts_per_token`` softmaxed among themselves, and the chosen experts'
    outputs summed with those weights. ``experts``: ``gate_up`` [E, 2I, H] (rows interleaved: gate, up, gate,
    ...) and ``down`` [E, H, I] f32; ``w``: ``router`` [E, H], ``router_bias`` [E], ``experts.gate_up_bias`` [E, 1,
    2I] and ``experts.down_bias`` [E, 1, H]. Written as OpenVINO's vectorized 2-GEMM MoE with bias and clamped
    SwiGLU, every expert run on the tokens tiled [E, N, H] and weighted by the routing map [E, N, 1] (zero for the
    experts not chosen), the form ``FuseVectorizedMOE2GEMM`` turns into one MoE op (the CPU plugin's GatherMatmul
    nodes: each token reads only its chosen experts). The router's Softmax is named as compiler/layers.py
    ``moe`` names Qwen3-MoE's (``ROUTER_SOFTMAX``)."""
    hidden, k, e = cfg.hidden_size, cfg.experts_per_token, cfg.num_experts
    flat = op.reshape(x, i64([-1, hidden]), special_zero=False)  # [N, H]
    logits = op.add(op.matmul(flat, w["router"], transpose_a=False, transpose_b=True), w["router_bias"])  # [N, E]
    top = op.topk(logits, i64(k), axis=-1, mode="max", sort="value", index_element_type=ov.Type.i64)
    weights = op.softmax(top.output(0), -1, name=f"model.layers.{layer}.mlp.router{ROUTER_SOFTMAX}").output(0)
    chosen = top.output(1)  # [N, k], as the weights
    tiled = op.reshape(op.tile(flat, i64([e, 1])), i64([e, -1, hidden]), special_zero=False)  # [E, N, H]
    gate_up = op.add(op.matmul(tiled, experts["gate_up"], transpose_a=False, transpose_b=True),
                     w["experts.gate_up_bias"])  # [E, N, 2I]
    end = i64([np.iinfo(np.int64).max])
    up = op.slice(gate_up, i64([1]), end, i64([2]), i64([2]))
    up = op.add(op.clamp(up, -SWIGLU_LIMIT, SWIGLU_LIMIT), f32(1.0))
    gate = op.minimum(op.slice(gate_up, i64([0]), end, i64([2]), i64([2])), f32(SWIGLU_LIMIT))
    act = op.multiply(up, op.swish(gate, f32(SWIGLU_ALPHA)))  # (up + 1) * gate * sigmoid(alpha * gate)
    down = op.add(op.matmul(act, experts["down"], transpose_a=False, transpose_b=True), w["experts.down_bias"])
    down = op.reshape(down, i64([e, 0, hidden]), special_zero=True)  # [E, N, H]
    rows = op.gather(op.shape_of(chosen, output_type="i64"), i64([0]), i64(0))  # [1]: N
    zeros = op.broadcast(f32(0.0), op.concat([rows, i64([e])], axis=0))  # [N, E]
    routing = op.scatter_elements_update(zeros, chosen, weights, i64(1))  # [N, E]
    routing = op.unsqueeze(op.reshape(op.transpose(routing, i64([1, 0])), i64([e, 0]), special_zero=True), i64([2]))
    out = op.reduce_sum(op.multiply(down, routing), i64([0]), keep_dims=False)  # [N, H]
    return op.reshape(out, op.shape_of(x, output_type="i64"), special_zero=False).output(0)


# ---------------------------------------------------------------- GGUF files (llama.cpp's ``gpt-oss``)

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
    ``.original_context_length`` with beta 32 / 1 and the ramp not truncated, as the HF config of gpt-oss has it
    (llama.cpp's ``ggml_rope_yarn_corr_dims`` rounds the ramp's ends: its frequencies differ slightly).
    ``ValueError`` naming the file and the key when one is missing."""
    from .gguf_moe import field

    def key(name: str) -> object:
        value = field(reader, f"{arch}.{name}")
        if value is None:
            raise ValueError(f"{where}: metadata {arch}.{name} missing")
        return value

    rope = dict(config["rope_parameters"]) | {
        "rope_type": "yarn", "factor": float(key("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")), "truncate": False}
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
    interleaved, ``Interleaved``) and ``down_proj.weight`` [H, I], the blocks as the file has them, and the biases
    ``mlp.experts.gate_up_proj.bias`` [E, 1, 2I] / ``down_proj.bias`` [E, 1, H] (F32). Nothing is read.
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
            out[f"{p}{e}.down_proj.weight"] = tensor(down.data[e], gguf.GGMLQuantizationType(down.tensor_type).name,
                                                     (hidden, inter), True)
        gate_bias, up_bias, down_bias = (get(role, "bias") for role in GGUF_EXPERTS)
        out[p + "gate_up_proj.bias"] = tensor(InterleavedBias(gate_bias.data, up_bias.data), "F32",
                                              (experts, 1, 2 * inter), False)
        out[p + "down_proj.bias"] = tensor(np.asarray(down_bias.data).reshape(experts, 1, hidden), "F32",
                                           (experts, 1, hidden), False)
    return out
