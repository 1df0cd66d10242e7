"""The decoder's graph operations, in OpenVINO ops (opset13): linear layers (OpenVINO's MatMul, or fleet's
kernels' product of a GGUF tensor's blocks), RMSNorm, rotary embeddings, the stateful KV cache, attention under the
visibility mask (and a sliding window), the MLPs (SwiGLU, GeGLU, Mixture-of-Experts) and Gemma 3's
layer. ``export.py`` assembles a stage from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset6
from openvino import opset13 as op
from openvino.op.util import Variable, VariableInfo
from openvino.utils.node_factory import NodeFactory

from fleet_common import kernels
from fleet_common.sliding_kv import kv_state_names

from .arch import ModelConfig

MASK_MIN = float(np.finfo(np.float32).min)  # additive mask of hidden slots (transformers' choice)
ROUTER_SOFTMAX = "/router_softmax"  # the name's end of a Mixture-of-Experts router's Softmax (``moe``)


@dataclass(frozen=True)
class GgufWeight:
    """A linear weight [rows, cols] as one GGUF tensor's bytes as they lie in the file (a u8 Constant [rows, row
    bytes]), multiplied by fleet's own kernel (fleet_common/kernels.py ``GgufMatMul``, type ``block_type``);
    ``order`` [rows] i64 or None: the product's outputs in HF's row order are its outputs ``order`` (llama.cpp's
    Q/K row permutation undone on the product, not on the bytes)."""

    blocks: ov.Output
    block_type: str
    order: np.ndarray | None = None


def i64(values) -> ov.Output:  # noqa: ANN001
    return op.constant(np.asarray(values, dtype=np.int64)).output(0)


def f32(value: float) -> ov.Output:
    return op.constant(np.float32(value)).output(0)


def linear(x: ov.Output, weight: ov.Output | GgufWeight, bias: ov.Output | None = None) -> ov.Output:
    """``x @ weight.T (+ bias)``: x [B, S, in] f32, weight [out, in] -> [B, S, out] (nn.Linear); a ``GgufWeight``
    as ``linears`` computes it."""
    return linears(x, [weight], [bias])[0]


def linears(x: ov.Output, weights: list[ov.Output | GgufWeight],
            biases: list[ov.Output | None] | None = None) -> list[ov.Output]:
    """``x @ w.T (+ b)`` for each weight [out_i, in] of one input x [B, S, in] f32 -> [B, S, out_i] each.

    ``GgufWeight``s are fleet's ``GgufMatMul`` over their blocks, all of them one op (the same products, one op's
    cost and one wait of the threads a decode step: ``kernels.gguf_matmuls``; named ``<constant>/matmul``, the
    constants' names joined by ``+``), each output gathered into HF's order where the file permuted its rows."""
    biases = biases or [None] * len(weights)
    blocks = [w for w in weights if isinstance(w, GgufWeight)]
    products = iter(())
    if blocks:
        node = kernels.gguf_matmuls(x, [w.blocks for w in blocks], [w.block_type for w in blocks])[0].get_node()
        node.set_friendly_name("+".join(w.blocks.get_node().get_friendly_name() for w in blocks) + "/matmul")
        products = iter(node.outputs())
    out = []
    for w, bias in zip(weights, biases):
        if isinstance(w, GgufWeight):
            y = next(products)
            if w.order is not None:
                y = op.gather(y, i64(w.order), i64(-1)).output(0)
        else:
            y = op.matmul(x, w, transpose_a=False, transpose_b=True).output(0)
        out.append(y if bias is None else op.add(y, bias).output(0))
    return out


def rms_norm(x: ov.Output, weight: ov.Output, eps: float) -> ov.Output:
    """RMSNorm over the last axis (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``, the
    op chain the CPU plugin fuses into one RMS node."""
    mean = op.reduce_mean(op.power(x, f32(2.0)), i64([-1]), keep_dims=True)
    inv = op.divide(f32(1.0), op.sqrt(op.add(mean, f32(eps))))
    return op.multiply(op.multiply(x, inv), weight).output(0)


def rope_tables(position_ids: ov.Output, cfg: ModelConfig,
                inv_freq: tuple[float, ...] | None = None) -> tuple[ov.Output, ov.Output]:
    """cos and sin [B, 1, S, rotary_dim] f32 of RoPE (Su et al. 2021, half-split "NeoX" layout as in
    transformers) at logical ``position_ids`` [B, S] i64, computed once per stage; both times
    ``cfg.rope_scale`` when it is not 1 (LongRoPE's attention factor, Ding et al. 2024: transformers'
    ``attention_scaling``).

    The angles are ``inv_freq [B, D/2, 1] @ positions [B, 1, S]`` as transformers' rotary embedding
    writes them: the CPU plugin keeps that MatMul and Cos/Sin in f32 when it runs the rest in bf16
    (an elementwise product instead ran in bf16 and cost the demo its answers: angles of ~40 rad
    rounded to 8 bits of mantissa). ``inv_freq`` (default ``cfg.inv_freq``): other frequencies (Gemma 3's local
    layers)."""
    freqs = cfg.inv_freq if inv_freq is None else inv_freq
    inv_freq = op.constant(np.asarray(freqs, dtype=np.float32).reshape(1, -1, 1))  # [1, D/2, 1]
    pos = op.unsqueeze(op.convert(position_ids, ov.Type.f32), i64([1]))  # [B, 1, S]
    batch = op.gather(op.shape_of(position_ids, output_type="i64"), i64([0]), i64(0))
    inv = op.broadcast(inv_freq, op.concat([batch, i64([len(freqs), 1])], axis=0))  # [B, D/2, 1]
    freqs = op.transpose(op.matmul(inv, pos, transpose_a=False, transpose_b=False), i64([0, 2, 1]))  # [B, S, D/2]
    emb = op.unsqueeze(op.concat([freqs, freqs], axis=-1), i64([1]))  # [B, 1, S, D]
    cos, sin = op.cos(emb).output(0), op.sin(emb).output(0)
    if cfg.rope_scale != 1.0:
        cos, sin = op.multiply(cos, f32(cfg.rope_scale)).output(0), op.multiply(sin, f32(cfg.rope_scale)).output(0)
    return cos, sin


def apply_rope(x: ov.Output, cos: ov.Output, sin: ov.Output, head_dim: int,
               rotary_dim: int | None = None) -> ov.Output:
    """``x * cos + rotate_half(x) * sin`` for x [B, heads, S, D] (transformers' ``apply_rotary_pos_emb``); with
    ``rotary_dim`` < D (partial rotary, Phi-4-mini's 0.75) only the first ``rotary_dim`` dims of each head turn,
    the rest pass as they are (cos and sin [B, 1, S, rotary_dim])."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim < head_dim:
        turned = op.slice(x, i64([0]), i64([rotary_dim]), i64([1]), i64([3])).output(0)
        kept = op.slice(x, i64([rotary_dim]), i64([head_dim]), i64([1]), i64([3]))
        return op.concat([apply_rope(turned, cos, sin, rotary_dim), kept], axis=-1).output(0)
    half = head_dim // 2
    x1 = op.slice(x, i64([0]), i64([half]), i64([1]), i64([3]))
    x2 = op.slice(x, i64([half]), i64([head_dim]), i64([1]), i64([3]))
    rotated = op.concat([op.negative(x2), x1], axis=-1)
    return op.add(op.multiply(x, cos), op.multiply(rotated, sin)).output(0)


def _heads(x: ov.Output, heads: int, head_dim: int, norm: ov.Output | None, eps: float) -> ov.Output:
    """[B, S, heads * D] -> [B, heads, S, D], with the per-head RMSNorm of Qwen3 when ``norm`` is given."""
    x = op.reshape(x, i64([0, 0, heads, head_dim]), special_zero=True).output(0)
    if norm is not None:
        x = rms_norm(x, norm, eps)
    return op.transpose(x, i64([0, 2, 1, 3])).output(0)


def kv_cache(new: ov.Output, beam_idx: ov.Output, cfg: ModelConfig, variable_id: str,
             batch: ov.Output) -> tuple[ov.Output, ov.Node]:
    """Append ``new`` [B, KVH, S, D] to a KV state; return ([B, KVH, P+S, D], its Assign sink).

    ``ReadValue -> Gather(beam_idx) -> Concat``: the chain the stateful SDPA fusion matches. The state
    starts as zeros [B, KVH, 0, D] (B from the stage's first input)."""
    info = VariableInfo()
    info.data_shape = ov.PartialShape([-1, cfg.num_kv_heads, -1, cfg.head_dim])
    info.data_type = ov.Type.f32
    info.variable_id = variable_id
    variable = Variable(info)
    init_shape = op.concat([batch, i64([cfg.num_kv_heads, 0, cfg.head_dim])], axis=0)
    init = op.broadcast(f32(0.0), init_shape)
    past = opset6.read_value(init, variable)
    reordered = op.gather(past, beam_idx, i64(0))
    present = op.concat([reordered, new], axis=2)
    return present.output(0), opset6.assign(present, variable)


def repeat_kv(x: ov.Output, groups: int, heads: int, head_dim: int) -> ov.Output:
    """[B, KVH, T, D] -> [B, KVH * groups, T, D], each KV head shared by ``groups`` query heads (GQA,
    Ainslie et al. 2023; transformers' ``repeat_kv``)."""
    if groups == 1:
        return x
    shape = op.shape_of(x, output_type="i64")
    target = op.concat([op.slice(shape, i64([0]), i64([2]), i64([1])), i64([groups]),
                        op.slice(shape, i64([2]), i64([4]), i64([1]))], axis=0)
    expanded = op.broadcast(op.unsqueeze(x, i64([2])), target, broadcast_spec="BIDIRECTIONAL")
    return op.reshape(expanded, i64([0, heads, -1, head_dim]), special_zero=True).output(0)


def attention(x: ov.Output, w: dict[str, ov.Output], cfg: ModelConfig, rope: tuple[ov.Output, ov.Output],
              mask: ov.Output, beam_idx: ov.Output, batch: ov.Output, layer: int,
              window_kv: bool = False) -> tuple[ov.Output, list[ov.Node]]:
    """Self-attention of one layer over its KV state: x [B, S, H] -> [B, S, H], plus the two Assign sinks; with
    ``w["sinks"]`` gpt-oss's attention with sinks (compiler/gpt_oss.py), with ``w["o_bias"]`` o_proj's bias.

    ``window_kv`` (a sliding-window layer): its KV state may hold only the *last* physical slots (the runtime
    drops the older ones, which the window hides anyway: fleet_common/sliding_kv.py), so the mask
    [B, 1, S, T] is cut to its last P' + S columns, P' the slots the state holds."""
    d = cfg.head_dim
    q, k, v = linears(x, [w["q"], w["k"], w["v"]], [w.get("q_bias"), w.get("k_bias"), w.get("v_bias")])
    q = _heads(q, cfg.num_heads, d, w.get("q_norm"), cfg.rms_norm_eps)
    k = _heads(k, cfg.num_kv_heads, d, w.get("k_norm"), cfg.rms_norm_eps)
    v = _heads(v, cfg.num_kv_heads, d, None, cfg.rms_norm_eps)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin, d, cfg.rotary_dim), apply_rope(k, cos, sin, d, cfg.rotary_dim)
    key_state, value_state = kv_state_names(layer)
    keys, k_sink = kv_cache(k, beam_idx, cfg, key_state, batch)
    values, v_sink = kv_cache(v, beam_idx, cfg, value_state, batch)
    if window_kv:
        held = op.gather(op.shape_of(keys, output_type="i64"), i64([2]), i64(0))  # [1]: P' + S
        mask = op.slice(mask, op.negative(held), i64([np.iinfo(np.int64).max]), i64([1]), i64([3])).output(0)
    keys, values = repeat_kv(keys, cfg.kv_groups, cfg.num_heads, d), repeat_kv(values, cfg.kv_groups, cfg.num_heads, d)
    scale = d ** -0.5 if cfg.attn_scale is None else cfg.attn_scale
    if "sinks" in w:  # gpt-oss: a sink logit per head, SDPA's sixth input
        out = sdpa_with_sinks(q, keys, values, mask, scale, w["sinks"])
    else:
        out = op.scaled_dot_product_attention(q, keys, values, mask, f32(scale), causal=False)  # [B, heads, S, D]
    out = op.reshape(op.transpose(out, i64([0, 2, 1, 3])), i64([0, 0, cfg.num_heads * d]), special_zero=True)
    return linear(out.output(0), w["o"], w.get("o_bias")), [k_sink, v_sink]


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


def mlp(x: ov.Output, w: dict[str, ov.Output], act: str = "silu") -> ov.Output:
    """Gated MLP, x [B, S, H] -> [B, S, H]: ``down(act(gate(x)) * up(x))``, SwiGLU (``act`` "silu", Shazeer
    2020) or ReGLU ("relu": ReluLLaMA, ProSparse, MiniCPM-S, whose FFN neurons are mostly zero)."""
    gate, up = linears(x, [w["gate"], w["up"]])
    activated = op.swish(gate) if act == "silu" else op.relu(gate)
    return linear(op.multiply(activated, up).output(0), w["down"])


def moe(x: ov.Output, w: dict[str, ov.Output], experts: dict[str, ov.Output],
        cfg: ModelConfig, layer: int) -> ov.Output:
    """A sparse Mixture-of-Experts MLP (Qwen3-MoE; transformers' ``Qwen3MoeSparseMoeBlock``), x [B, S, H] ->
    [B, S, H]: the router's choice (``moe_routing``) and the weighted sum of the chosen experts' SwiGLU outputs
    (``experts``: ``_Weights.stacked`` of gate, up [E, I, H] and down [E, H, I]).

    The experts are written as OpenVINO's tiled MoE block (``moe_tiled``), which the CPU plugin's
    ``ConvertTiledMoeBlockToGatherMatmuls`` turns into GatherMatmul(Compressed) nodes: each token reads only
    its chosen experts' blocks, still compressed, inside the kernel (a CPU stage of fleet's kernels multiplies
    the experts' bytes itself instead: compiler/experts.py). It replaced an explicit Gather of the chosen
    experts' slices, decompressed to f32 before a batched MatMul, 6.8x slower on the CPU (117 against 17.1
    ms/token for 4 Qwen3-30B-A3B layers in Q4_K_M, bench/kernels/moe_bench.py; docs/design-measured.md keeps
    that row)."""
    flat, weights, chosen = moe_routing(x, w, cfg, layer)
    out = moe_tiled(flat, weights, chosen, experts, cfg.num_experts)  # [N, H]
    return op.reshape(out, op.shape_of(x, output_type="i64"), special_zero=False).output(0)  # [B, S, H]


def moe_routing(x: ov.Output, w: dict[str, ov.Output], cfg: ModelConfig,
                layer: int) -> tuple[ov.Output, ov.Output, ov.Output]:
    """A Qwen3-MoE / Mixtral router's choice for x [B, S, H]: (x flattened [N, H], the weights [N, k] f32, the
    chosen experts [N, k] i64): the router's softmax over the experts, its top ``experts_per_token`` (TopK) weights
    renormalised to sum 1 when ``norm_topk_prob``. The Softmax is named ``model.layers.{layer}.mlp.gate/
    router_softmax`` (``ROUTER_SOFTMAX``: compiler/inspect.py counts Softmax nodes left by unfused attention, not
    this one)."""
    hidden, k = cfg.hidden_size, cfg.experts_per_token
    flat = op.reshape(x, i64([-1, hidden]), special_zero=False)  # [N, H]
    probs = op.softmax(op.matmul(flat, w["router"], transpose_a=False, transpose_b=True), -1,
                       name=f"model.layers.{layer}.mlp.gate{ROUTER_SOFTMAX}")  # [N, E]
    top = op.topk(probs, i64(k), axis=-1, mode="max", sort="value", index_element_type=ov.Type.i64)
    weights, chosen = top.output(0), top.output(1)  # [N, k] each
    if cfg.norm_topk_prob:
        weights = op.divide(weights, op.reduce_sum(weights, i64([-1]), keep_dims=True)).output(0)
    return flat.output(0), weights, chosen


def moe_tiled(flat: ov.Output, weights: ov.Output, chosen: ov.Output,
              experts: dict[str, ov.Output], num_experts: int) -> ov.Output:
    """The chosen experts' SwiGLU outputs summed with their weights, flat [N, H] f32 -> [N, H] (``chosen`` [N, k]
    i64, ``weights`` [N, k] f32; ``experts[part]``: all E experts' matrix [E, rows, cols] f32, its
    decompression chain whole), as OpenVINO's tiled MoE block (the form optimum-intel exports Qwen3-MoE in):
    the tokens tiled over all E experts [E, N, H], three batched MatMuls against the whole stacked experts,
    SwiGLU, and the outputs weighted by the routing map [E, N, 1] (the top-k weights scattered into zeros
    [N, E]) and summed over E. Computed as written, every expert runs; the CPU plugin matches the block and
    runs only the chosen experts (GatherMatmul)."""
    hidden = flat.get_partial_shape()[1].get_length()
    tiled = op.reshape(op.tile(flat, i64([num_experts, 1])), i64([num_experts, -1, hidden]), special_zero=False)
    gate = op.matmul(tiled, experts["gate"], transpose_a=False, transpose_b=True)  # [E, N, I]
    up = op.matmul(tiled, experts["up"], transpose_a=False, transpose_b=True)
    act = op.multiply(NodeFactory("opset4").create("Swish", [gate.output(0)], {}), up)  # one input: the pattern's
    down = op.matmul(act, experts["down"], transpose_a=False, transpose_b=True)  # [E, N, H]
    down = op.reshape(down, i64([num_experts, 0, hidden]), special_zero=True)  # the Reshapes: the pattern's
    rows = op.gather(op.shape_of(chosen, output_type="i64"), i64([0]), i64(0))  # [1]: N
    zeros = op.broadcast(f32(0.0), op.concat([rows, i64([num_experts])], axis=0))  # [N, E]
    routing = op.scatter_elements_update(zeros, chosen, weights, i64(1))  # [N, E]
    routing = op.reshape(op.transpose(routing, i64([1, 0])), i64([num_experts, 0]), special_zero=True)
    routing = op.unsqueeze(routing, i64([2]))  # [E, N, 1]
    return op.reduce_sum(op.multiply(down, routing), i64([0]), keep_dims=False).output(0)


def visibility_mask(attention_mask: ov.Output, seq: ov.Output) -> ov.Output:
    """Additive mask [B, 1, S, T] f32: 0 where query ``i`` (physical slot ``T - S + i``) may see slot ``j``
    (``j <= T - S + i`` and ``attention_mask[b, j] == 1``), float32's minimum elsewhere."""
    total = op.gather(op.shape_of(attention_mask, output_type="i64"), i64(1), i64(0))  # T
    slots = op.range(i64(0), total, i64(1), output_type="i64")  # [T]
    queries = op.add(op.range(i64(0), seq, i64(1), output_type="i64"), op.subtract(total, seq))  # [S]
    causal = op.less_equal(op.unsqueeze(slots, i64([0])), op.unsqueeze(queries, i64([1])))  # [S, T]
    visible = op.logical_and(op.unsqueeze(causal, i64([0, 1])),
                             op.greater(op.unsqueeze(attention_mask, i64([1, 2])), i64(0)))  # [B, 1, S, T]
    return op.select(visible, f32(0.0), f32(MASK_MIN)).output(0)


def window_mask(attention_mask: ov.Output, seq: ov.Output, mask: ov.Output, window: int) -> ov.Output:
    """``mask`` [B, 1, S, T] (``visibility_mask``) with the keys ``window`` or more logical positions before each
    query hidden too (a sliding-window layer: transformers' ``sliding_window_overlay``, kv > q - window).

    A key's logical distance from a query is the number of visible slots after it up to the query's slot,
    ``cumsum(attention_mask)`` at the query minus at the key: hidden slots (rejected drafts) hold no position,
    so they neither count nor become visible."""
    seen = op.cumsum(attention_mask, i64(1))  # [B, T]
    at_query = op.slice(seen, op.negative(op.unsqueeze(seq, i64([0]))), i64([np.iinfo(np.int64).max]), i64([1]),
                        i64([1]))  # [B, S]: the chunk's slots are the last S
    distance = op.subtract(op.unsqueeze(at_query, i64([2])), op.unsqueeze(seen, i64([1])))  # [B, S, T]
    far = op.unsqueeze(op.greater_equal(distance, i64(window)), i64([1]))  # [B, 1, S, T]
    return op.select(far, f32(MASK_MIN), mask).output(0)


def geglu(x: ov.Output, w: dict[str, ov.Output]) -> ov.Output:
    """GeGLU MLP (Shazeer 2020; Gemma's ``gelu_pytorch_tanh``): ``down(gelu_tanh(gate(x)) * up(x))``."""
    gate, up = linears(x, [w["gate"], w["up"]])
    return linear(op.multiply(op.gelu(gate, approximation_mode="tanh"), up).output(0), w["down"])


def norm_weight(weight: ov.Output, cfg: ModelConfig) -> ov.Output:
    """An RMSNorm's multiplier: ``weight + cfg.norm_offset`` (Gemma's HF ``1 + w``), or ``weight`` itself."""
    return weight if not cfg.norm_offset else op.add(weight, f32(cfg.norm_offset)).output(0)


def gemma_layer(x: ov.Output, w: dict[str, ov.Output], cfg: ModelConfig, rope: tuple[ov.Output, ov.Output],
                mask: ov.Output, beam_idx: ov.Output, batch: ov.Output, layer: int,
                window_kv: bool = False) -> tuple[ov.Output, list[ov.Node]]:
    """One Gemma 3 decoder layer (transformers' ``Gemma3DecoderLayer``): ``x + post_norm(attention(input_norm(x)))``,
    then ``+ post_ff_norm(geglu(pre_ff_norm(x)))``; every norm (q/k's too) times ``1 + w`` as ``norm_weight``."""
    w = dict(w) | {role: norm_weight(w[role], cfg) for role in w if role.endswith("norm")}
    eps = cfg.rms_norm_eps
    h, sinks = attention(rms_norm(x, w["input_norm"], eps), w, cfg, rope, mask, beam_idx, batch, layer, window_kv)
    x = op.add(x, rms_norm(h, w["post_norm"], eps)).output(0)
    h = geglu(rms_norm(x, w["pre_ff_norm"], eps), w)
    return op.add(x, rms_norm(h, w["post_ff_norm"], eps)).output(0), sinks
