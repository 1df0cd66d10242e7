"""``fleet-compiler plan``: which layers each node of a fleet serves, so that the slowest stage is as fast
as it can be and no node runs out of memory.

Nodes take contiguous layer ranges in the order given (stage ``i`` = node ``i``; stage 0 also holds
the embedding, the last stage the final norm and LM head). A stage's time per token is its weight
reads (compiler/plan.py: ``decode_weights``; the head counts as ``ModelDims.head_layers`` layers)
divided by the node's speed; ``balanced_split`` minimizes the slowest stage's time subject to each
node's memory, which must hold (``StagePlan``):

* **weights** of its layers (and embedding, head) in the chosen format: fp16 2 B per weight; int8 1 B
  plus an f16 scale and a u8 zero point per output row; int4 (compiler/compress.py's size-class
  defaults) ``ratio`` of the decoder's linear layers at 0.5 B plus a scale (and zero point) per group,
  the rest, the embedding and the head at int8. Within 1% of the demo's real shard files (tested).
* **KV cache** for ``max_sessions`` sessions of ``max_context`` tokens each, which is what a worker
  reserves (``--kv-budget-mb``): tokens x sessions x layers x KV heads x head dim x 2 (K and V) x bytes
  per value of ``kv_cache_precision``; a sliding-window layer (Gemma 3's local layers, gpt-oss's) counts at most
  the slots a worker reserves for it (``ModelDims.sliding_layers``, fleet_common/sliding_kv.py). A stage's KV is
  its own layers' (the plan's table); while the split is sought, a stage of n layers counts the most KV any n
  consecutive layers hold, so a stage fits wherever its layers fall.
* **runtime**: ``RUNTIME_FIXED_BYTES`` + ``UNPACKED_COPY[format]`` x weights (``runtime_bytes``; a
  Mixture-of-Experts' ``UNPACKED_COPY_MOE``).

A Mixture-of-Experts layer reads only its chosen experts (top-k of n) per token, so its speed counts those
(``ModelDims.layer_params``), its memory every expert and the router (``idle_params`` too).

A sparse FFN build (``fleet-compiler build --sparse-ffn``, a ReLU-family model; docs/sparse-ffn.md) reads per token
all of ``gate`` and only the kept neurons' rows of ``up`` and ``down_t``: at ``ffn_sparsity`` s (the fraction of a
token's FFN neurons that are zero) a layer costs ``ModelDims.read_fraction`` of a dense one's reads. Its memory is
the dense build's: ``down_t`` replaces ``down`` with the same bytes (from bf16/fp16/f32 sources, the only ones a
sparse build takes).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fleet_common.manifest import DEVICES_FORMAT, MANIFEST_NAME, load_manifest
from fleet_common.runtime import KV_VALUE_BYTES
from fleet_common.sliding_kv import sliding_kv

from .arch import GEMMA, GPT_OSS, MOE, ModelConfig, moe_dims, moe_widths
from .compress import FORMATS, WeightSpec, resolve
from .nodes import Node
from .plan import balanced_split, decode_weights, parse_layers

MIB = 1 << 20
PLAN_FORMAT = 1
DEFAULT_SESSIONS = 4
# Measured on this repo's demo (SmolLM2-135M, 2 vCPU AVX2 without bf16, OpenVINO 2026.4.1). The CPU plugin
# packs a stage's weights into buffers of its own on the first inference of each kind of chunk: one
# layout for chunks of < 8 tokens and a second for 8-128, so an fp16 stage holds its weights ~2x and an
# int8/int4 stage ~1.6x once it has decoded and prefilled, beside the pages of the mapped IR file (1x,
# page cache the kernel can reclaim). Beside that: the interpreter, OpenVINO, gRPC (an idle worker:
# 87 MiB) and 40-75 MiB per compiled stage. Peak RSS of real workers of every stage of the 1-, 2- and
# 3-stage fp16, int8 and int4 builds, after a 16-token and a 1-token chunk and a session of 1,056 tokens,
# is 224-873 MiB; the rule below holds all 18 with 15-94% to spare (tightest: int8 1-stage, 525 MiB vs
# 601). A bf16 CPU or a GPU needs less; not measured here.
RUNTIME_FIXED_BYTES = 320 * MIB
UNPACKED_COPY = {"fp16": 2.0, "int8": 1.0, "int4": 1.0}  # plugin-packed bytes per weight byte at run time
# A Mixture-of-Experts stage in fp16 holds more (the CPU plugin's GatherMatmul over the stacked f16 experts): real
# workers of a 2-stage build of a 4-layer Qwen3-30B-A3B-shaped F16 GGUF (bench/real_gguf.py) peaked at 14,373 MiB
# for a 3,757 MiB stage and 5,456 for 1,380 (3.8x and 4.0x, 128 tokens prefilled, 16 decoded), where the rule
# above gives 11,592 and 4,461; this one 15,348 and 5,840. Its int8 build's workers held 3,827 and 1,431 MiB, within
# the rule above (4,083 and 1,702); its int4 build's 2,691 and 1,159 MiB too (2,697 and 1,240: barely, as its stage
# files, 1,322 and 505 MiB, were 11% above weight_bytes' estimate: NNCF's ratio over few, large expert tensors).
UNPACKED_COPY_MOE = {"fp16": 3.0, "int8": 1.0, "int4": 1.0}


class PlanRefused(ValueError):
    """No assignment fits the nodes' memory: names the node, the shortfall and the changes that would fit."""

    def __init__(self, message: str, node: str, shortfall_bytes: int, fixes: list[str]) -> None:
        text = message + ("\nany one of these would fit: " + "; ".join(fixes) if fixes
                          else "\nno single change of nodes, weights, context or sessions fits: give nodes more memory")
        super().__init__(text)
        self.node, self.shortfall_bytes, self.fixes = node, shortfall_bytes, fixes


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs of a decoder-only model (its Hugging Face config)."""

    model_id: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings
    tied_embeddings: bool  # a 1-stage build stores the shared embedding/head once
    # weights a layer stores beyond the ones a token reads (layer_params): a Mixture-of-Experts' unchosen experts
    # and router, per layer on average; counted for memory, not for speed
    idle_params: int = 0
    # sliding-window layers (Gemma 3's local ones, gpt-oss's): which (one flag per layer; () for none), and the
    # slots a session reserves in each
    sliding_layers: tuple[bool, ...] = ()
    local_slots: int = 0
    # a sparse FFN build: the fraction of a token's FFN neurons that are zero (0: dense; module doc)
    ffn_sparsity: float = 0.0

    @classmethod
    def from_config(cls, config: dict, model_id: str) -> ModelDims:
        """From a config.json dict; raises ``ValueError`` naming a missing field. A Mixture-of-Experts
        (qwen3_moe) has as ``intermediate_size`` the layers' mean MLP width a token reads (its chosen experts'),
        and every other expert's and the router's weights in ``idle_params``."""
        try:
            heads = int(config["num_attention_heads"])
            dims = cls(model_id, int(config["num_hidden_layers"]), int(config["hidden_size"]), heads,
                       int(config.get("num_key_value_heads") or heads),
                       int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                       int(config["intermediate_size"]), int(config["vocab_size"]),
                       int(config["max_position_embeddings"]), bool(config.get("tie_word_embeddings", False)))
        except KeyError as exc:
            raise ValueError(f"config.json of {model_id} has no {exc.args[0]}") from None
        if config.get("model_type") in GEMMA | GPT_OSS:
            cfg = ModelConfig.from_hf(config, f"config.json of {model_id}")
            sliding = sliding_kv(cfg.sliding_window, [i for i, local in enumerate(cfg.sliding_layers) if local])
            if sliding is not None:
                dims = replace(dims, sliding_layers=tuple(cfg.sliding_layers), local_slots=sliding.reserved_slots)
        if config.get("model_type") not in MOE:
            return dims
        moe = moe_dims(config, dims.num_layers, f"config.json of {model_id}")
        active, idle = moe_widths(dims.num_layers, dims.hidden_size, dims.intermediate_size, moe)
        return replace(dims, intermediate_size=active, idle_params=idle)

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linear layers that a decoded token reads (the cost model's unit; a
        Mixture-of-Experts layer's chosen experts only, the others in ``idle_params``)."""
        return decode_weights(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                              self.intermediate_size, self.vocab_size)[0]

    @property
    def read_fraction(self) -> float:
        """What one decoder layer reads per token, as a fraction of ``layer_params`` (1.0 for a dense layer; a
        sparse FFN's: attention, all of gate, ``1 - ffn_sparsity`` of up and of down_t)."""
        ffn = self.hidden_size * self.intermediate_size
        return (self.layer_params - 2 * ffn * self.ffn_sparsity) / self.layer_params

    def with_sparse_ffn(self, sparsity: float, hidden_act: str) -> ModelDims:
        """These dims for a sparse FFN build at ``sparsity`` (the fraction of a token's FFN neurons that are zero,
        0 < s < 1: a ReLU model's measured share, a SwiGLU model's calibrated one, as ``build --sparse-ffn S``).
        Raises ``ValueError`` for a model whose MLP is neither ReLU-family nor SwiGLU (``hidden_act``, as
        ``fleet-compiler build --sparse-ffn`` refuses it), a Mixture-of-Experts, or a sparsity out of range."""
        if not 0.0 < sparsity < 1.0:  # 0: the dense plan (a build refuses --sparse-ffn 0 too)
            raise ValueError(f"--sparse-ffn {sparsity}: give the fraction of a token's FFN neurons that are zero, "
                             "0 < s < 1 (e.g. 0.88 for ProSparse, 0.2 for a calibrated SwiGLU model)")
        if hidden_act not in ("relu", "silu"):
            raise ValueError(f"--sparse-ffn: {self.model_id}'s MLP is hidden_act {hidden_act!r}; a sparse FFN build "
                             "takes a ReLU-family model (relu) or a SwiGLU one (silu), so its plan does too")
        if self.moe:
            raise ValueError(f"--sparse-ffn: {self.model_id} is a Mixture-of-Experts; sparse FFN builds are dense models")
        return replace(self, ffn_sparsity=float(sparsity))

    @property
    def moe(self) -> bool:
        """A Mixture-of-Experts model: its layers store weights a token does not read (``idle_params``)."""
        return self.idle_params > 0

    @property
    def head_params(self) -> int:
        """Parameters of the LM head (vocab x hidden); the embedding has as many."""
        return self.vocab_size * self.hidden_size

    @property
    def head_layers(self) -> float:
        """The LM head's weight reads per token in (dense) layers' worth (8.0 for SmolLM2-135M)."""
        return self.head_params / self.layer_params

    @property
    def parameters(self) -> int:
        """All parameters: embedding, LM head unless tied, decoder layers with their norms, final norm."""
        return (self.head_params * (1 if self.tied_embeddings else 2)
                + self.num_layers * (self.layer_params + self.idle_params + 2 * self.hidden_size) + self.hidden_size)


@dataclass(frozen=True)
class ModelSource:
    """A model to plan for: its dimensions and the defaults a build folder sets."""

    dims: ModelDims
    weights: str  # the build's weight format ("fp16" for an HF folder or a mixed build)
    kv_cache_precision: str
    hidden_act: str = "silu"  # config.json's MLP activation (a sparse FFN needs "relu")


def read_model(path: Path) -> ModelSource:
    """An HF model folder or a fleet build folder (its copy of config.json; weights and KV precision from
    its manifest). Raises ``FileNotFoundError`` without config.json, ``ValueError`` for a bad one."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: give a Hugging Face model folder or a fleet build folder")
    config = json.loads((path / "config.json").read_text())
    act = str(config.get("hidden_act", "silu"))
    if (path / MANIFEST_NAME).is_file():
        manifest = load_manifest(path).manifest
        dims = ModelDims.from_config(config, manifest.model_id)
        weights = manifest.weights if manifest.weights in FORMATS else "fp16"  # "mixed": count fp16
        return ModelSource(dims, weights, manifest.kv_cache_precision, act)
    return ModelSource(ModelDims.from_config(config, path.resolve().name), "fp16", "f16", act)


def _int8_bytes(symmetric: bool, fan_in: int) -> float:
    return 1 + (2 + (0 if symmetric else 1)) / fan_in  # f16 scale (+ u8 zero point) per output row


def weight_bytes(dims: ModelDims, spec: WeightSpec, layers: int, embedding: bool, head: bool) -> int:
    """Bytes of a stage's weights stored as ``spec`` (see the module doc): ``layers`` decoder layers
    (and their two norms at f16), plus the embedding and/or final norm + LM head."""
    fan_in = dims.hidden_size
    if spec.format == "fp16":
        linear = table = 2.0
    elif spec.format == "int8":
        linear = table = _int8_bytes(spec.symmetric, fan_in)
    else:
        group = fan_in if spec.group_size == -1 else spec.group_size
        four = 0.5 + (2 + (0 if spec.symmetric else 0.5)) / group
        table = _int8_bytes(False, fan_in)  # NNCF's backup mode, int8 asymmetric
        linear = spec.ratio * four + (1 - spec.ratio) * table
    total = layers * ((dims.layer_params + dims.idle_params) * linear + 2 * dims.hidden_size * 2)
    tables = int(embedding) + int(head) - int(embedding and head and dims.tied_embeddings)
    total += tables * dims.head_params * table + (2 * dims.hidden_size if head else 0)
    return int(math.ceil(total))


def runtime_bytes(weights: int, fmt: str, moe: bool = False) -> int:
    """What a worker holds beside its weights and KV cache (measured; see ``RUNTIME_FIXED_BYTES``), in bytes; for
    a Mixture-of-Experts model's stage (``moe``) with ``UNPACKED_COPY_MOE``."""
    return RUNTIME_FIXED_BYTES + int(copy_factor(fmt, moe) * weights)


def copy_factor(fmt: str, moe: bool = False) -> float:
    """Plugin-packed bytes per weight byte a worker holds at run time (``UNPACKED_COPY``, ``UNPACKED_COPY_MOE``)."""
    return (UNPACKED_COPY_MOE if moe else UNPACKED_COPY)[fmt]


@dataclass(frozen=True)
class StagePlan:
    """One node's share: its layers ``[start, end)``, its memory by part (bytes) and its time per token."""

    index: int
    node: Node
    start: int
    end: int
    weight_bytes: int
    kv_bytes: int
    runtime_bytes: int
    cost: float  # weight reads per token in layers' worth (head included) / the node's speed (measured: = ms)
    ms_per_token: float | None  # predicted from the node's measured ms per layer; None for a relative speed

    @property
    def total_bytes(self) -> int:
        """What the node needs in bytes: weights + KV + runtime overhead."""
        return self.weight_bytes + self.kv_bytes + self.runtime_bytes


@dataclass(frozen=True)
class Plan:
    """A fleet's layer assignment (``plan``) and the settings its memory was counted for."""

    dims: ModelDims
    weights: str
    kv_cache_precision: str
    max_context: int
    max_sessions: int
    stages: tuple[StagePlan, ...]

    @property
    def layers(self) -> str:
        """The ranges as ``fleet-compiler build --layers`` takes them, e.g. ``0:12,12:30``."""
        return ",".join(f"{s.start}:{s.end}" for s in self.stages)

    @property
    def bottleneck(self) -> StagePlan:
        """The slowest stage, which caps the pipeline's tokens/s."""
        return max(self.stages, key=lambda s: s.cost)

    def to_json(self) -> str:
        """The plan file ``fleet-compiler build --plan`` follows (layers, devices, weights, KV precision)."""
        slowest = self.bottleneck
        return json.dumps({
            "plan_format": PLAN_FORMAT, "model_id": self.dims.model_id, "architecture": asdict(self.dims),
            "weights": self.weights, "kv_cache_precision": self.kv_cache_precision,
            "max_context": self.max_context, "max_sessions": self.max_sessions,
            "runtime": {"fixed_bytes": RUNTIME_FIXED_BYTES, "weights_factor": copy_factor(self.weights, self.dims.moe)},
            "layers": self.layers, "bottleneck_stage": slowest.index, "predicted_ms_per_token": slowest.ms_per_token,
            "stages": [{"index": s.index, "node": s.node.name, "device": s.node.device, "start": s.start, "end": s.end,
                        "memory_bytes": s.node.memory_bytes, "weight_bytes": s.weight_bytes, "kv_bytes": s.kv_bytes,
                        "runtime_bytes": s.runtime_bytes, "total_bytes": s.total_bytes, "speed": s.node.speed,
                        "ms_per_layer": s.node.ms_per_layer, "cost": round(s.cost, 4), "ms_per_token": s.ms_per_token}
                       for s in self.stages],
        }, indent=2) + "\n"


@dataclass(frozen=True)
class _Settings:
    weights: str
    kv_cache_precision: str
    max_context: int
    max_sessions: int


def plan(dims: ModelDims, nodes: list[Node], weights: str = "fp16", kv_cache_precision: str = "f16",
         max_context: int | None = None, max_sessions: int = DEFAULT_SESSIONS) -> Plan:
    """Assign contiguous layer ranges to ``nodes`` in order, minimizing the slowest stage's time within
    every node's memory (module doc). ``max_context``: tokens per session (default the model's).

    Nodes give either all a measured ``ms_per_layer`` (then stage times are predicted in ms) or relative
    speeds. Raises ``PlanRefused`` when no assignment fits (the node, its shortfall and what would fit),
    ``ValueError`` for bad settings (more nodes than layers, mixed speed kinds, a context beyond the
    model's, an unknown format)."""
    settings = _Settings(weights, kv_cache_precision, dims.max_context if max_context is None else max_context,
                         max_sessions)
    _check(dims, nodes, settings)
    result = _fit(dims, nodes, settings)
    if isinstance(result, Plan):
        return result
    message, node, short = result
    raise PlanRefused(message, node, short, _fixes(dims, nodes, settings))


def _check(dims: ModelDims, nodes: list[Node], s: _Settings) -> None:
    if not nodes:
        raise ValueError("no nodes: give --node NAME:MEM[:SPEED[:DEVICE]] per PC, or --nodes FILE")
    if len(nodes) > dims.num_layers:
        raise ValueError(f"{len(nodes)} nodes but the model has {dims.num_layers} layers: each node needs one")
    if len({n.name for n in nodes}) != len(nodes):
        raise ValueError(f"node names must differ: {[n.name for n in nodes]} (records of one PC take its host name: "
                         "give each `fleet-worker --profile` its own --name)")
    if len({n.ms_per_layer is None for n in nodes}) > 1:
        raise ValueError("give every node a measured ms per layer (fleet-worker --profile) or none (relative speeds)")
    if s.weights not in FORMATS:
        raise ValueError(f"unknown weight format {s.weights!r}; choose one of {', '.join(FORMATS)}")
    if s.kv_cache_precision not in KV_VALUE_BYTES:
        raise ValueError(f"unknown KV cache precision {s.kv_cache_precision!r}; choose one of "
                         f"{', '.join(KV_VALUE_BYTES)}")
    if not 1 <= s.max_context <= dims.max_context:
        raise ValueError(f"--max-context {s.max_context}: must be 1..{dims.max_context} (the model's context)")
    if s.max_sessions < 1:
        raise ValueError("--max-sessions must be at least 1")
    if dims.ffn_sparsity and s.weights != "fp16":
        raise ValueError(f"--sparse-ffn with --weights {s.weights}: a sparse FFN runs on fleet's kernels over the "
                         "model's own bf16/fp16/f32 weights (count fp16), as fleet-compiler build --sparse-ffn does")


def _fit(dims: ModelDims, nodes: list[Node], s: _Settings) -> Plan | tuple[str, str, int]:
    """The plan, or (why not, the node named, its shortfall in bytes)."""
    spec = resolve(s.weights, dims.parameters)
    last = len(nodes) - 1
    slot = s.max_sessions * dims.num_key_value_heads * dims.head_dim * 2 * KV_VALUE_BYTES[s.kv_cache_precision]
    local = min(s.max_context, dims.local_slots)
    sliding = dims.sliding_layers or (False,) * dims.num_layers
    held = list(itertools.accumulate((slot * (local if x else s.max_context) for x in sliding), initial=0))

    def parts(i: int, layers: int, start: int | None = None) -> tuple[int, int, int]:  # (weights, KV, runtime) bytes
        """Node ``i``'s bytes for ``layers`` layers from ``start`` (None: the most KV of any such run)."""
        w = weight_bytes(dims, spec, layers, i == 0, i == last)
        starts = range(dims.num_layers - layers + 1) if start is None else (start,)
        return w, max(held[j + layers] - held[j] for j in starts), runtime_bytes(w, s.weights, dims.moe)

    def capacity(i: int) -> int:
        """The most layers node ``i`` holds in memory (0: not even one)."""
        lo, hi = 0, dims.num_layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(parts(i, mid)) <= nodes[i].memory_bytes else (lo, mid - 1)
        return lo

    caps = [capacity(i) for i in range(len(nodes))]
    measured = nodes[0].ms_per_layer is not None
    speeds = [1 / n.ms_per_layer if measured else n.speed for n in nodes]
    if 0 in caps:
        i = caps.index(0)
        short = sum(parts(i, 1)) - nodes[i].memory_bytes
        return (f"node {nodes[i].name!r} ({_mib(nodes[i].memory_bytes)} MiB) cannot hold even one layer"
                f"{_extras(i, last)}: it needs {_describe(parts(i, 1))}: short {_mib(short)} MiB", nodes[i].name, short)
    if sum(caps) < dims.num_layers:  # the node that would come shortest of holding the rest, the others full
        rest = {i: dims.num_layers - (sum(caps) - caps[i]) for i in range(len(nodes))}
        short = {i: sum(parts(i, rest[i])) - nodes[i].memory_bytes for i in rest}
        i = min(short, key=short.get)
        return (f"{len(nodes)} node(s) hold at most {sum(caps)} of {dims.num_layers} layers: even with every other "
                f"node full, node {nodes[i].name!r} ({_mib(nodes[i].memory_bytes)} MiB) would need "
                f"{_describe(parts(i, rest[i]))} for {rest[i]} layers{_extras(i, last)}: short {_mib(short[i])} MiB",
                nodes[i].name, short[i])
    layer_cost = dims.read_fraction  # a dense layer's reads: 1.0
    ranges = balanced_split(dims.num_layers, len(nodes), layer_cost, dims.head_layers, speeds, caps)
    stages = []
    for i, (start, end) in enumerate(ranges):
        w, kv, rt = parts(i, end - start, start)
        work = (end - start) * layer_cost + (dims.head_layers if i == last else 0)
        ms = work * nodes[i].ms_per_layer if measured else None
        stages.append(StagePlan(i, nodes[i], start, end, w, kv, rt, work / speeds[i], ms))
    return Plan(dims, s.weights, s.kv_cache_precision, s.max_context, s.max_sessions, tuple(stages))


def _fixes(dims: ModelDims, nodes: list[Node], s: _Settings) -> list[str]:
    """The single changes that make the plan fit: more nodes like the smallest, smaller weights, a shorter
    context, fewer sessions (each the least change that fits)."""
    fixes = []
    smallest = min(nodes, key=lambda n: n.memory_bytes)
    for extra in range(1, dims.num_layers - len(nodes) + 1):
        added = [replace(smallest, name=f"{smallest.name}+{k}") for k in range(1, extra + 1)]
        if isinstance(_fit(dims, [*nodes[:-1], *added, nodes[-1]], s), Plan):
            fixes.append(f"{extra} more node(s) of {_mib(smallest.memory_bytes)} MiB like {smallest.name!r}")
            break
    for fmt in FORMATS[FORMATS.index(s.weights) + 1:]:
        if isinstance(_fit(dims, nodes, replace(s, weights=fmt)), Plan):
            fixes.append(f"--weights {fmt}")
            break
    for field, now in (("max_context", s.max_context), ("max_sessions", s.max_sessions)):
        lo, hi = 0, now - 1  # the largest value below now that fits (0: none)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if isinstance(_fit(dims, nodes, replace(s, **{field: mid})), Plan) else (lo, mid - 1)
        if lo:
            value = lo - lo % 64 if field == "max_context" and lo >= 64 else lo
            fixes.append(f"--{field.replace('_', '-')} {value} (now {now})")
    return fixes


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def _describe(parts: tuple[int, int, int]) -> str:
    w, kv, rt = parts
    return f"{_mib(w + kv + rt)} MiB (weights {_mib(w)} + KV {_mib(kv)} + runtime {_mib(rt)})"


def _extras(i: int, last: int) -> str:
    held = [name for name, holds in (("the embedding", i == 0), ("the LM head", i == last)) if holds]
    return f" with {' and '.join(held)}" if held else ""


def report_lines(p: Plan) -> list[str]:
    """The plan as a table: node, device, layers, memory by part against the node's, time per token."""
    sparse = (f"; sparse FFN at {p.dims.ffn_sparsity:.0%}: a layer reads {p.dims.read_fraction:.2f} of a dense one's "
              "weights per token" if p.dims.ffn_sparsity else "")
    lines = [f"plan for {p.dims.model_id}: {p.dims.num_layers} layers, {p.weights} weights, KV cache "
             f"{p.kv_cache_precision} for {p.max_sessions} session(s) x {p.max_context} tokens per worker; runtime "
             f"{_mib(RUNTIME_FIXED_BYTES)} MiB + {copy_factor(p.weights, p.dims.moe):g} x weights{sparse}",
             f"{'stage':>5}  {'node':<12} {'device':<6} {'layers':>7}  {'weights':>8}  {'KV':>8}  {'runtime':>8}  "
             f"{'total / memory MiB':>19}  {'cost':>6}  {'ms/token':>8}"]
    for s in p.stages:
        ms = f"{s.ms_per_token:.2f}" if s.ms_per_token is not None else "-"
        lines.append(f"{s.index:>5}  {s.node.name:<12} {s.node.device:<6} {s.start:>3}:{s.end:<3}  "
                     f"{_mib(s.weight_bytes):>8}  {_mib(s.kv_bytes):>8}  {_mib(s.runtime_bytes):>8}  "
                     f"{_mib(s.total_bytes):>8} / {_mib(s.node.memory_bytes):>8}  {s.cost:>6.2f}  {ms:>8}")
    slow = p.bottleneck
    when = (f"predicted {slow.ms_per_token:.2f} ms/token" if slow.ms_per_token is not None
            else "cost: dense layers' worth of weight reads per token / relative speed")
    lines.append(f"slowest stage: {slow.index} ({slow.node.name}); {when}")
    return lines


@dataclass(frozen=True)
class PlannedBuild:
    """What ``fleet-compiler build --plan`` takes from a plan file."""

    dims: ModelDims
    layers: str  # "0:12,12:30"
    devices: tuple[str, ...]  # per stage
    weights: str
    kv_cache_precision: str


def read_plan(path: Path) -> PlannedBuild:
    """Read a plan file written by ``fleet-compiler plan -o``; raises ``ValueError`` (naming the file) for
    another format or inconsistent ranges, ``FileNotFoundError``."""
    try:
        raw = json.loads(Path(path).read_text())
        if raw.get("plan_format") != PLAN_FORMAT:
            raise ValueError(f"plan format {raw.get('plan_format')!r}, this fleet-compiler reads {PLAN_FORMAT}")
        arch = raw["architecture"]
        dims = ModelDims(**{**arch, "sliding_layers": tuple(arch.get("sliding_layers", ()))})  # JSON's list
        stages = sorted(raw["stages"], key=lambda s: s["index"])
        layers = ",".join(f"{int(s['start'])}:{int(s['end'])}" for s in stages)
        parse_layers(layers, dims.num_layers)
        if layers != raw["layers"]:
            raise ValueError(f"its stages say {layers} but its layers {raw['layers']}")
        devices = tuple(Node(s["node"], 1, device=str(s["device"])).device for s in stages)
        return PlannedBuild(dims, layers, devices, str(raw["weights"]), str(raw["kv_cache_precision"]))
    except (KeyError, TypeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{path} is not a usable plan: {exc}") from None


def check_source(planned: PlannedBuild, src: Path) -> None:
    """Refuse (``ValueError``) to build ``src`` with a plan made for a model of other dimensions (an HF
    folder's config.json is compared; a .gguf is checked by its layer count when it loads)."""
    config = Path(src) / "config.json"
    if not config.is_file():
        return
    mine = replace(ModelDims.from_config(json.loads(config.read_text()), planned.dims.model_id),
                   ffn_sparsity=planned.dims.ffn_sparsity)  # the plan's choice, not the model's
    if mine != planned.dims:
        differ = [k for k, v in asdict(mine).items() if asdict(planned.dims)[k] != v]
        raise ValueError(f"the plan was made for another model than {src} ({', '.join(differ)} differ): "
                         "plan again for this model")


def record_devices(build: Path, devices: tuple[str, ...]) -> None:
    """Write the plan's device of each stage into the build's manifest (format 3 when one is not the CPU;
    fleet_common/manifest.py). Workers log it when they serve a stage on another device."""
    loaded = load_manifest(build)
    manifest = loaded.manifest
    if len(devices) != manifest.num_stages:
        raise ValueError(f"{len(devices)} planned devices for {manifest.num_stages} stages")
    stages = tuple(replace(s, device=d) for s, d in zip(manifest.stages, devices))
    fmt = max(DEVICES_FORMAT, manifest.format) if any(d != "CPU" for d in devices) else manifest.format
    (Path(build) / MANIFEST_NAME).write_text(replace(manifest, stages=stages, format=fmt).to_json())
