"""A Mixture-of-Experts layer's experts in a stage's graph: on a CPU stage of fleet's kernels each expert matrix is
its tensor's bytes as they lie (a GGUF's ``ffn_{gate,up,down}_exps`` [E, N, row bytes]; an HF folder's experts as
stored, F16/BF16), multiplied by ``GgufMoeMatMul`` for each token's chosen experts only (fleet_common/kernels.py);
elsewhere (GPU/NPU, int8/int4, types the kernels lack) OpenVINO's tiled expert block (compiler/layers.py ``moe``,
compiler/gpt_oss.py ``gpt_oss_moe``), which the CPU plugin runs as GatherMatmul.

The kernels' form, x [T, H] the layer's normed input flattened and ``chosen`` [T, k] the router's top k (the router
as in the tiled form, unchanged): gate and up ``GgufMoeMatMul(x, blocks, chosen)`` -> [T, k, I] each, the
activation, then down over the [T * k, I] rows each with its one expert -> [T, k, H], summed over k with the
routing weights. Each chosen expert's blocks are read once a call, whatever the number of tokens choosing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as op

from fleet_common import kernels

from .arch import ModelConfig
from .gpt_oss import clamped_swiglu, gpt_oss_moe, gpt_oss_routing
from .layers import i64, mlp, moe, moe_routing
from .sparse_ffn import sparse_mlp


@dataclass(frozen=True)
class GgufExperts:
    """One expert matrix of a layer, all E experts [E, N, K], as its tensor's bytes: a u8 Constant [E, N, row
    bytes] (GGUF's layout, expert e's N rows at e), multiplied by ``GgufMoeMatMul`` in type ``block_type``."""

    blocks: ov.Output
    block_type: str


def expert_rows(source, names: list[str],  # noqa: ANN001
                report: Callable[[str, np.ndarray], object] | None = None) -> Callable[[int, int], np.ndarray]:
    """``read(start, stop)``: rows ``[start, stop)`` float16 [stop - start, cols] of the experts ``names``
    ([rows, cols] each, read from ``source``) stacked and flattened to [E * rows, cols], each expert's share
    read on its own; ``report(name, rows)`` follows an expert's last row. ``read.shape``: (E * rows, cols)."""
    rows, cols = source.shape(names[0])

    def read(start: int, stop: int) -> np.ndarray:
        parts = []
        for e in range(start // rows, -(-stop // rows)):
            a, b = max(start, e * rows) - e * rows, min(stop, (e + 1) * rows) - e * rows
            parts.append(source.tensor(names[e], rows=(a, b)))
            if report is not None and b == rows:
                report(names[e], parts[-1])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    read.shape = (len(names) * rows, cols)
    return read


def stacked_name(names: list[str]) -> str:
    """The stacked constant's name for the experts ``names`` (HF names of one matrix, expert 0 first):
    ``model.layers.3.mlp.experts.gate_proj.weight``."""
    return names[0].replace(".experts.0.", ".experts.")


def feed_forward(x: ov.Output, w: dict[str, ov.Output], names: dict[str, str], weights,  # noqa: ANN001
                 cfg: ModelConfig, layer: int) -> ov.Output:
    """A layer's MLP on its normed input x [B, S, H] -> [B, S, H]: SwiGLU, or in a Mixture-of-Experts layer its
    router and experts: on fleet's kernels where ``weights`` (export.py ``_Weights``) gives every expert matrix of
    the layer as bytes (``_Weights.experts``), else each matrix stacked over the experts in OpenVINO's form
    (gpt-oss's biased ``gate_up``/``down``, or ``gate``/``up``/``down``)."""
    if layer not in cfg.moe_layers:
        if weights.sparse_ffn:
            return sparse_mlp(x, w, weights.down_t(names["down"]), cfg.mlp_act, weights.sparse_ffn.threshold(layer))
        return mlp(x, w, cfg.mlp_act)
    if cfg.gpt_oss:  # a GGUF's gate and up are two tensors (compiler/gguf_gpt_oss.py names them apart)
        p = f"model.layers.{layer}.mlp.experts."
        split = {part: [f"{p}{e}.{part}_proj.weight" for e in range(cfg.num_experts)] for part in ("gate", "up")}
        split["down"] = _experts(names, cfg, "down")
        on_kernels = {part: weights.experts(each) for part, each in split.items()}
        if all(on_kernels.values()):
            biases = {part: weights(f"{p}{part}_proj.bias") for part in ("gate", "up", "down")}
            return gpt_oss_moe_on_kernels(x, w, on_kernels, biases, cfg, layer)
        return gpt_oss_moe(x, w, {part: weights.stacked(_experts(names, cfg, part)) for part in ("gate_up", "down")},
                           cfg, layer)
    on_kernels = {part: weights.experts(_experts(names, cfg, part)) for part in ("gate", "up", "down")}
    if all(on_kernels.values()):
        return moe_on_kernels(x, w, on_kernels, cfg, layer)
    return moe(x, w, {part: weights.stacked(_experts(names, cfg, part)) for part in ("gate", "up", "down")}, cfg,
               layer)


def _experts(names: dict[str, str], cfg: ModelConfig, part: str) -> list[str]:
    return [names[f"expert.{e}.{part}"] for e in range(cfg.num_experts)]


def chosen_products(x: ov.Output, experts: GgufExperts, chosen: ov.Output) -> ov.Output:
    """Each token times its chosen experts' matrix (``GgufMoeMatMul``, named ``<constant>/matmul`` as
    compiler/layers.py ``linears`` names dense products): x [T, K] f32 (one row for all its choices) or [T, k, K] (a
    row per choice, each times its own expert), ``chosen`` [T, k] i64 -> f32 [T, k, N]."""
    per_choice = x.get_partial_shape().rank.get_length() == 3
    rows, picks = x, chosen
    if per_choice:  # [T * k, K], each row with its one expert [T * k, 1]
        rows = op.reshape(x, i64([-1, x.get_partial_shape()[2].get_length()]), special_zero=False).output(0)
        picks = op.reshape(chosen, i64([-1, 1]), special_zero=False).output(0)
    y = kernels.gguf_moe_matmul(rows, experts.blocks, picks, experts.block_type).get_node()
    y.set_friendly_name(f"{experts.blocks.get_node().get_friendly_name()}/matmul")
    if not per_choice:
        return y.output(0)
    n = experts.blocks.get_partial_shape()[1].get_length()
    shape = op.concat([op.shape_of(chosen, output_type="i64"), i64([n])], axis=0)  # [T, k, N]
    return op.reshape(y, shape, special_zero=False).output(0)


def _weighted_sum(down: ov.Output, weights: ov.Output, x: ov.Output) -> ov.Output:
    """The chosen experts' outputs ``down`` [T, k, H] summed with their routing ``weights`` [T, k], in x's shape
    [B, S, H]."""
    out = op.reduce_sum(op.multiply(down, op.unsqueeze(weights, i64([2]))), i64([1]), keep_dims=False)  # [T, H]
    return op.reshape(out, op.shape_of(x, output_type="i64"), special_zero=False).output(0)


def moe_on_kernels(x: ov.Output, w: dict[str, ov.Output], experts: dict[str, GgufExperts], cfg: ModelConfig,
                   layer: int) -> ov.Output:
    """compiler/layers.py ``moe`` (Qwen3-MoE, Mixtral; its router, top-k and renormalisation) with the experts'
    SwiGLU on fleet's kernels (module docstring): x [B, S, H] -> [B, S, H]; ``experts``: gate, up [E, I, H] and
    down [E, H, I] as bytes."""
    flat, weights, chosen = moe_routing(x, w, cfg, layer)
    gate, up = (chosen_products(flat, experts[part], chosen) for part in ("gate", "up"))  # [T, k, I]
    act = op.multiply(op.swish(gate), up).output(0)
    return _weighted_sum(chosen_products(act, experts["down"], chosen), weights, x)


def gpt_oss_moe_on_kernels(x: ov.Output, w: dict[str, ov.Output], experts: dict[str, GgufExperts],
                           biases: dict[str, ov.Output], cfg: ModelConfig, layer: int) -> ov.Output:
    """compiler/gpt_oss.py ``gpt_oss_moe`` (its biased router, softmax over the top k) with the experts on fleet's
    kernels (module docstring): x [B, S, H] -> [B, S, H]; ``experts``: gate, up [E, I, H] (a GGUF's ffn_gate_exps
    and ffn_up_exps, which HF's gate_up interleaves) and down [E, H, I] as bytes; ``biases``: gate, up [E, I] and
    down [E, 1, H] f32, each token's chosen experts' rows added to their products."""
    flat, weights, chosen = gpt_oss_routing(x, w, cfg, layer)

    def biased(y: ov.Output, part: str) -> ov.Output:  # + bias[chosen] [T, k, N]
        bias = op.reshape(biases[part], i64([cfg.num_experts, -1]), special_zero=False)  # [E, N]
        return op.add(y, op.gather(bias, chosen, i64(0))).output(0)

    gate, up = (biased(chosen_products(flat, experts[part], chosen), part) for part in ("gate", "up"))
    down = biased(chosen_products(clamped_swiglu(gate, up), experts["down"], chosen), "down")
    return _weighted_sum(down, weights, x)
