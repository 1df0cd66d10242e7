"""gpt-oss (OpenAI's gpt-oss-20b and -120b; transformers ``modeling_gpt_oss.py``, HF ``model_type`` ``gpt_oss``) as
the stage builder makes it: what differs from the Llama decoder of compiler/layers.py.

* Attention: q/k/v/o biases, and a learned "sink" logit per head (``self_attn.sinks`` [heads]) that joins every
  query's softmax as one more column and is dropped after it (``sdpa_with_sinks``): the weights of the real keys
  sum to less than 1. OpenVINO's ScaledDotProductAttention takes the sinks as an input, so these layers stay one
  fused stateful SDPA on the CPU plugin (the KV state's ReadValue -> Gather -> Concat chain is kept).
* ``layer_types`` alternates sliding-window (``sliding_window``, 128) and full layers: a sliding layer's keys
  ``sliding_window`` or more logical positions back are hidden (compiler/layers.py ``window_mask``, as Gemma 3's).
* YaRN RoPE (compiler/rope.py ``_yarn``): fixed frequencies and an attention factor on cos and sin.
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

from .layers import ROUTER_SOFTMAX, f32, i64
from .weights import WeightsError, check_shapes

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # transformers' GptOssExperts.alpha, .limit
VIEWS = ("gate_up_proj", "down_proj")  # the stacked expert matrices, each expert's slice a view


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

    def kernel_type(self, name: str) -> str | None:
        """``inner``'s (``SafetensorsWeights.kernel_type``), None for an expert's view (experts keep their
        forms)."""
        return None if isinstance(self.tensors[name], View) else self.inner.kernel_type(name)

    def block_bytes(self, name: str) -> np.ndarray:
        """``inner``'s bytes of matrix ``name`` (``SafetensorsWeights.block_bytes``)."""
        return self.inner.block_bytes(name)

    def row_bytes(self, name: str) -> int:
        """``inner``'s bytes per row of matrix ``name`` (``SafetensorsWeights.row_bytes``)."""
        return self.inner.row_bytes(name)

    def row_order(self, name: str) -> None:
        """None: HF's rows."""
        return None

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
    hidden, e = cfg.hidden_size, cfg.num_experts
    flat, weights, chosen = gpt_oss_routing(x, w, cfg, layer)
    tiled = op.reshape(op.tile(flat, i64([e, 1])), i64([e, -1, hidden]), special_zero=False)  # [E, N, H]
    gate_up = op.add(op.matmul(tiled, experts["gate_up"], transpose_a=False, transpose_b=True),
                     w["experts.gate_up_bias"])  # [E, N, 2I]
    end = i64([np.iinfo(np.int64).max])
    act = clamped_swiglu(op.slice(gate_up, i64([0]), end, i64([2]), i64([2])).output(0),
                         op.slice(gate_up, i64([1]), end, i64([2]), i64([2])).output(0))
    down = op.add(op.matmul(act, experts["down"], transpose_a=False, transpose_b=True), w["experts.down_bias"])
    down = op.reshape(down, i64([e, 0, hidden]), special_zero=True)  # [E, N, H]
    rows = op.gather(op.shape_of(chosen, output_type="i64"), i64([0]), i64(0))  # [1]: N
    zeros = op.broadcast(f32(0.0), op.concat([rows, i64([e])], axis=0))  # [N, E]
    routing = op.scatter_elements_update(zeros, chosen, weights, i64(1))  # [N, E]
    routing = op.unsqueeze(op.reshape(op.transpose(routing, i64([1, 0])), i64([e, 0]), special_zero=True), i64([2]))
    out = op.reduce_sum(op.multiply(down, routing), i64([0]), keep_dims=False)  # [N, H]
    return op.reshape(out, op.shape_of(x, output_type="i64"), special_zero=False).output(0)


def gpt_oss_routing(x: ov.Output, w: dict[str, ov.Output], cfg,  # noqa: ANN001
                    layer: int) -> tuple[ov.Output, ov.Output, ov.Output]:
    """gpt-oss's router (transformers ``GptOssTopKRouter``) for x [B, S, H]: (x flattened [N, H], the weights [N, k]
    f32, the chosen experts [N, k] i64): logits ``x W^T + b`` [N, E], their top ``experts_per_token`` softmaxed
    among themselves. The Softmax is named as compiler/layers.py ``moe_routing`` names Qwen3-MoE's
    (``ROUTER_SOFTMAX``)."""
    flat = op.reshape(x, i64([-1, cfg.hidden_size]), special_zero=False)  # [N, H]
    logits = op.add(op.matmul(flat, w["router"], transpose_a=False, transpose_b=True), w["router_bias"])  # [N, E]
    top = op.topk(logits, i64(cfg.experts_per_token), axis=-1, mode="max", sort="value",
                  index_element_type=ov.Type.i64)
    weights = op.softmax(top.output(0), -1, name=f"model.layers.{layer}.mlp.router{ROUTER_SOFTMAX}").output(0)
    return flat.output(0), weights, top.output(1)


def clamped_swiglu(gate: ov.Output, up: ov.Output) -> ov.Output:
    """gpt-oss's activation of an expert's gate and up outputs (transformers ``GptOssExperts._apply_gate``):
    ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, g = min(gate, 7); any shape, f32."""
    up = op.add(op.clamp(up, -SWIGLU_LIMIT, SWIGLU_LIMIT), f32(1.0))
    gate = op.minimum(gate, f32(SWIGLU_LIMIT))
    return op.multiply(up, op.swish(gate, f32(SWIGLU_ALPHA))).output(0)
