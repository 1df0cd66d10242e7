"""Export one layer range of a Hugging Face decoder-only model as a stateful OpenVINO IR shard.

The shard graph (design.md §4):

* inputs: ``input_ids`` [B, S] i64 (stage 0) or ``hidden_states`` [B, S, H] f32 (later stages);
  ``attention_mask`` [B, P+S] i64 over *physical* KV slots (1 = visible, 0 = hidden, e.g. a
  rejected draft token); ``position_ids`` [B, S] i64 *logical* positions; ``beam_idx`` [B] i32;
  last stage only: ``logits_index`` [K] i64, the positions of the chunk whose logits are wanted.
* outputs: ``hidden_states`` [B, S, H] f32, or ``logits`` [B, K, V] f32 on the last stage.
  ``export_stage(..., logits_index_input=False)`` drops ``logits_index`` and the last stage emits
  ``logits`` [B, S, V] for every position: the optimum-intel contract OpenVINO GenAI expects.
* KV cache: one ReadValue/Assign state pair per layer and per K/V, each read going
  ``ReadValue -> Gather(beam_idx, axis 0) -> Concat -> SDPA``. That exact chain is what the CPU
  plugin's ``StatefulSDPAFusion`` (and the GPU plugin's ``IndirectKVCache``) match; without the
  Gather nothing fails but decode runs 1.6-2.6x slower (Berenbaum & Venkatachalam, arXiv 2608.19147;
  the same trick as optimum-intel's ``fuse_cache_reorder``).

The 4-D causal + visibility mask is built inside the graph from ``attention_mask``: query ``i`` of
the chunk (physical slot ``P + i``) sees slot ``j`` iff ``j <= P + i`` and ``attention_mask[j] == 1``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import torch
from openvino import opset13
from openvino._offline_transformations import apply_make_stateful_transformation

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class StageSpec:
    """What one exported shard covers: layers ``[start, end)`` of a ``num_layers`` model."""

    index: int
    start: int
    end: int
    num_layers: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers


class _KVConcat:
    """Duck-typed HF ``Cache``: prepends the explicit past K/V inputs and records the presents.

    ``update(k, v, layer_idx)`` takes new K/V [B, KVH, S, D] and returns [B, KVH, P+S, D].
    """

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], first_layer: int) -> None:
        self.past = past
        self.first_layer = first_layer
        self.present: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key, value, layer_idx, cache_kwargs=None):  # noqa: ANN001 - HF signature
        past_k, past_v = self.past[layer_idx - self.first_layer]
        key = torch.cat([past_k, key], dim=2)
        value = torch.cat([past_v, value], dim=2)
        self.present.append((key, value))
        return key, value


class _StageModule(torch.nn.Module):
    """Torch wrapper over decoder layers ``[start, end)`` with explicit KV in/out (made stateful later)."""

    def __init__(self, model: torch.nn.Module, stage: StageSpec, logits_index_input: bool = True) -> None:
        super().__init__()
        base = model.model
        self.stage = stage
        self.logits_index_input = logits_index_input
        self.embed_tokens = base.embed_tokens if stage.first else None
        self.layers = torch.nn.ModuleList(base.layers[stage.start : stage.end])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if stage.last else None
        self.lm_head = model.lm_head if stage.last else None

    def forward(self, inputs, attention_mask, position_ids, beam_idx, *args):  # noqa: ANN001
        n = len(self.layers)
        flat_past = args[: 2 * n]
        past = [(flat_past[2 * i], flat_past[2 * i + 1]) for i in range(n)]
        # The Gather on beam_idx sits right after each KV read: this is the fusion hint.
        past = [(k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in past]
        hidden = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs  # [B, S, H]

        seq = hidden.shape[1]
        total = attention_mask.shape[1]  # P + S physical slots
        slots = torch.arange(total, dtype=torch.int64)  # [T]
        query_slots = torch.arange(seq, dtype=torch.int64) + (total - seq)  # [S]
        causal = slots[None, :] <= query_slots[:, None]  # [S, T]
        visible = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # [B, 1, S, T]
        zero = torch.zeros((), dtype=hidden.dtype)
        neg = torch.tensor(torch.finfo(hidden.dtype).min, dtype=hidden.dtype)
        mask = torch.where(visible, zero, neg)  # [B, 1, S, T] additive

        cos_sin = self.rotary_emb(hidden, position_ids)
        cache = _KVConcat(past, self.stage.start)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                position_embeddings=cos_sin,
            )
        presents = [t for kv in cache.present for t in kv]
        if self.lm_head is None:
            return (hidden, *presents)
        if self.logits_index_input:
            logits_index = args[2 * n]  # this local's name becomes the IR Parameter's friendly name
            hidden = hidden.index_select(1, logits_index)  # [B, K, H]
        hidden = self.norm(hidden)  # [B, K, H] or [B, S, H]
        logits = self.lm_head(hidden).float()  # [B, K, V] or [B, S, V]
        return (logits, *presents)


def _kv_names(stage: StageSpec) -> tuple[list[str], list[str]]:
    ins, outs = [], []
    for layer in range(stage.start, stage.end):
        for kind in ("key", "value"):
            ins.append(f"past_key_values.{layer}.{kind}")
            outs.append(f"present.{layer}.{kind}")
    return ins, outs


def _build_state_initializer(model: ov.Model, batch_source: str) -> None:
    """Give every ReadValue a zeros initializer shaped [B, KVH, 0, D] (B from ``batch_source``).

    Without it the stateful model fails to compile or infer (same as optimum-intel's
    ``build_state_initializer``).
    """
    batch = opset13.gather(
        opset13.shape_of(model.input(batch_source), output_type="i64"),
        opset13.constant([0]),
        opset13.constant(0),
    )
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims = [d.min_length for d in op.get_output_partial_shape(0)]
        parts = [batch] + [opset13.constant(np.array([d], dtype=np.int64)) for d in dims[1:]]
        shape = opset13.concat(parts, axis=0)
        op.set_arguments([opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)), shape)])
    model.validate_nodes_and_infer_types()


def export_stage(model: torch.nn.Module, stage: StageSpec, kv_cache_precision: str = "f16", *,
                 logits_index_input: bool = True) -> ov.Model:
    """Convert layers ``[stage.start, stage.end)`` of ``model`` (an HF ``*ForCausalLM`` in f32) to a
    stateful OpenVINO model with the input/output contract in this module's docstring.

    ``kv_cache_precision`` is written to ``rt_info["runtime_options"]["KV_CACHE_PRECISION"]`` as
    optimum-intel does; without it the CPU plugin picks u8 KV and shards drift from the whole model.
    ``logits_index_input=False`` (last stage only matters): no ``logits_index`` input, logits for
    every position [B, S, V], as OpenVINO GenAI's ``LLMPipeline`` expects of ``openvino_model.xml``.
    Raises ``ValueError`` for an unsupported architecture.
    """
    cfg = model.config
    if cfg.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.model_type!r}; supported: {SUPPORTED_ARCHITECTURES}")
    model.config._attn_implementation = "sdpa"
    wrapper = _StageModule(model, stage, logits_index_input).eval()
    n = stage.end - stage.start
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    batch, seq, past = 2, 3, 4
    if stage.first:
        first = ("input_ids", torch.randint(0, cfg.vocab_size, (batch, seq)), ov.PartialShape([-1, -1]), ov.Type.i64)
    else:
        first = (
            "hidden_states",
            torch.randn(batch, seq, cfg.hidden_size),
            ov.PartialShape([-1, -1, cfg.hidden_size]),
            ov.Type.f32,
        )
    specs = [
        first,
        ("attention_mask", torch.ones(batch, past + seq, dtype=torch.int64), ov.PartialShape([-1, -1]), ov.Type.i64),
        ("position_ids", torch.arange(past, past + seq).repeat(batch, 1), ov.PartialShape([-1, -1]), ov.Type.i64),
        ("beam_idx", torch.arange(batch, dtype=torch.int32), ov.PartialShape([-1]), ov.Type.i32),
    ]
    kv_in, kv_out = _kv_names(stage)
    for name in kv_in:
        specs.append(
            (name, torch.randn(batch, kv_heads, past, head_dim), ov.PartialShape([-1, kv_heads, -1, head_dim]), ov.Type.f32)
        )
    if stage.last and logits_index_input:
        specs.append(("logits_index", torch.tensor([seq - 1], dtype=torch.int64), ov.PartialShape([-1]), ov.Type.i64))

    with torch.no_grad(), warnings.catch_warnings():
        # tracing notes on shapes that are constant by construction (mask dtype limits, SDPA flags)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        ov_model = ov.convert_model(
            wrapper,
            example_input=tuple(s[1] for s in specs),
            input=[(s[2], s[3]) for s in specs],
        )
    for port, spec in zip(ov_model.inputs, specs):
        port.get_tensor().set_names({spec[0]})
    out_names = ["logits" if stage.last else "hidden_states", *kv_out]
    for port, name in zip(ov_model.outputs, out_names):
        port.get_tensor().set_names({name})

    apply_make_stateful_transformation(ov_model, dict(zip(kv_in, kv_out)))
    _build_state_initializer(ov_model, specs[0][0])
    ov_model.set_rt_info(kv_cache_precision, ["runtime_options", "KV_CACHE_PRECISION"])
    log.info("stage %d: layers [%d, %d) exported", stage.index, stage.start, stage.end)
    return ov_model
