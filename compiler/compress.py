"""Weight compression of shards and drafts: NNCF's data-free ``compress_weights`` on the exported IR.

``fleet-compiler build --weights fp16|int8|int4`` (``--stage-weights 0=int8,1=int4`` per stage):

* ``fp16``: the IR stores fp16 weights, computed in the inference precision (today's default).
* ``int8``: 8-bit integers per output channel, asymmetric by default (NNCF's ``INT8_ASYM``), every
  weight including embeddings and the LM head.
* ``int4``: 4-bit integers in groups of ``group_size`` weights along the input dimension, each group
  with its own scale (and zero point when asymmetric); ``ratio`` of the decoder's linear layers go to
  4 bit, the rest (the ones whose weights lose most, by NNCF's data-free criterion) and the embedding
  and each stage's last linear layer to NNCF's backup precision, int8 asymmetric.

NNCF: "Weights Compression", docs/compression_algorithms/CompressWeights.md in openvinotoolkit/nncf;
OpenVINO's "4-bit Weight Quantization" guide (mode, group_size, ratio trade-offs; recommended
configurations per model). NNCF compresses each stage on its own, so a stage that is not the last
keeps its last linear layer (a decoder layer's MLP down projection) at int8: a sharded int4 build
is very slightly larger and more precise than the same model compressed whole.

The builder does not hand NNCF the whole stage (its f32 temporaries of every weight peaked at ~6x the
int4 stage): int8 and int4 are written tensor by tensor with NNCF's own lowering (``int8_rows``,
``int4_rows``), each weight's precision picked as ``compress_weights`` picks it (``int4_plan``; below
ratio 1.0 from ``sensitivity``'s scores), byte for byte NNCF's result on the whole stage
(tests/unit/test_int8_builder.py, tests/unit/test_int4_builder.py). A Mixture-of-Experts layer's stacked
experts [E, rows, cols] too: compressed as [E * rows, cols] in blocks of rows across the experts, NNCF's
layout for a stacked weight (compiler/export.py ``_Weights._stacked_int4``; tests/integration/test_moe_int4.py).
``compress`` (NNCF on the whole stage) is what the tests compare against.

Defaults per size class (``SIZE_CLASSES``), by the model's parameter count, for int4 (int8 is
per-channel asymmetric at every size, measured +0.16% perplexity on the demo against +0.50%
symmetric): under 1B parameters, asymmetric, group 32, 80% of the layers at 4 bit. Measured on the
demo (docs/compression.md): group 32 beats 64 and 128, and keeping 20% of the layers at
int8 cuts the perplexity increase from +24.5% to +14.8% for 10% more bytes; small models lose the
most, as OpenVINO's guide warns. From 1B: symmetric, group 128, ratio 0.8 (the guide's recommended
configuration for Llama-2-7B-chat and other 7B models); from 10B: symmetric, group 128, ratio 1.0.
The two larger classes come from the guide and are not measured here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import openvino as ov

FORMATS = ("fp16", "int8", "int4")


@dataclass(frozen=True)
class WeightSpec:
    """How one model file's weights are stored and the NNCF parameters that make them."""

    format: str  # one of FORMATS
    symmetric: bool = False  # int8 / int4: no zero point
    group_size: int = -1  # int4: weights per scale along the input dimension; -1 = one per output channel
    ratio: float = 1.0  # int4: share of the decoder's linear layers at 4 bit (the rest int8)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.group_size != -1 and self.group_size < 2:
            raise ValueError(f"group size must be -1 (per channel) or at least 2, got {self.group_size}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")

    def nncf_mode(self) -> str:
        """NNCF's ``CompressWeightsMode`` value (``int4_asym``, ...); "" for fp16."""
        if self.format == "fp16":
            return ""
        return f"{self.format}_{'sym' if self.symmetric else 'asym'}"

    def parameters(self) -> dict[str, object]:
        """What the manifest records: the arguments given to ``nncf.compress_weights`` (and NNCF's
        version); empty for fp16."""
        if self.format == "fp16":
            return {}
        from importlib.metadata import version

        params: dict[str, object] = {"mode": self.nncf_mode(), "nncf": version("nncf")}
        if self.format == "int4":
            params.update(group_size=self.group_size, ratio=self.ratio, backup_mode="int8_asym",
                          all_layers=False, group_size_fallback="adjust")
        return params


SIZE_CLASSES: tuple[tuple[float, WeightSpec], ...] = (  # (parameters below, int4 defaults)
    (1e9, WeightSpec("int4", symmetric=False, group_size=32, ratio=0.8)),
    (10e9, WeightSpec("int4", symmetric=True, group_size=128, ratio=0.8)),
    (math.inf, WeightSpec("int4", symmetric=True, group_size=128, ratio=1.0)),
)

# The self drafts keep the recipes they were measured with (compiler/draft.py).
SELF_DRAFT_SPECS = {
    "int4": WeightSpec("int4", symmetric=True, group_size=64, ratio=1.0),
    "int8": WeightSpec("int8", symmetric=False),
}


def default_spec(fmt: str, parameters: int) -> WeightSpec:
    """The default ``fmt`` spec for a model of ``parameters`` weights (its size class)."""
    if fmt != "int4":
        return WeightSpec(fmt)
    return next(spec for bound, spec in SIZE_CLASSES if parameters < bound)


def resolve(fmt: str, parameters: int, symmetric: bool | None = None, group_size: int | None = None,
            ratio: float | None = None) -> WeightSpec:
    """``default_spec`` with the given overrides (None keeps the default; group size and ratio apply
    to int4 only, symmetry to int8 and int4). Raises ``ValueError`` for an invalid value."""
    spec = default_spec(fmt, parameters)
    if spec.format == "fp16":
        return spec
    spec = replace(spec, symmetric=spec.symmetric if symmetric is None else symmetric)
    if spec.format == "int4":
        spec = replace(spec, group_size=spec.group_size if group_size is None else group_size,
                       ratio=spec.ratio if ratio is None else ratio)
    return spec


def parse_stage_weights(text: str, num_stages: int) -> dict[int, str]:
    """Parse ``"0=int8,1=int4"`` into ``{0: "int8", 1: "int4"}``.

    Raises ``ValueError`` naming the bad entry (syntax, stage out of range, repeated stage, format).
    """
    out: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        stage, sep, fmt = item.partition("=")
        if not sep or not stage.strip().isdigit():
            raise ValueError(f"--stage-weights entry {item!r} is not STAGE=FORMAT (e.g. 0=int8,1=int4)")
        index, fmt = int(stage), fmt.strip()
        if index >= num_stages:
            raise ValueError(f"--stage-weights names stage {index}, but this build has stages 0..{num_stages - 1}")
        if index in out:
            raise ValueError(f"--stage-weights names stage {index} twice")
        if fmt not in FORMATS:
            raise ValueError(f"--stage-weights {item!r}: unknown weight format {fmt!r}; choose one of "
                             f"{', '.join(FORMATS)}")
        out[index] = fmt
    return out


def compress(model: ov.Model, spec: WeightSpec) -> ov.Model:
    """Compress ``model``'s weights (f32 or fp16 constants) as ``spec`` says with NNCF, data-free;
    fp16 returns it unchanged (``ov.save_model`` stores fp16). A group size that does not divide a
    layer's input dimension is adjusted for that layer (NNCF's ``GroupSizeFallbackMode.ADJUST``)."""
    if spec.format == "fp16":
        return model
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    mode = nncf.CompressWeightsMode(spec.nncf_mode())
    if spec.format == "int8":
        return nncf.compress_weights(model, mode=mode)
    return nncf.compress_weights(
        model, mode=mode, group_size=spec.group_size, ratio=spec.ratio,
        advanced_parameters=AdvancedCompressionParameters(
            group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))


ROW_BLOCK_BYTES = 64 << 20  # int8, int4: rows compressed per NNCF call (rows are independent)


def int8_rows(read, shape: tuple[int, ...], symmetric: bool, out: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-channel int8 of a weight [rows, cols] with NNCF's own lowering (``weight_lowering.compress_weight``,
    the function ``compress_weights`` applies to each weight), ``ROW_BLOCK_BYTES`` of rows at a time:
    each row has its own scale (and zero point), so blocks give the same bytes as the whole tensor at a
    fraction of NNCF's f32 temporaries (a 1 GiB embedding needs ~64 MiB of them, not ~6 GiB).

    ``read(start, stop)`` returns rows ``[start, stop)`` as float16; ``out`` [rows, cols] uint8 (asym)
    or int8 (sym) receives the weights. Returns (scale [rows, 1] float16, zero point [rows, 1] uint8 or
    None when symmetric).
    """
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    import nncf

    mode = nncf.CompressWeightsMode.INT8_SYM if symmetric else nncf.CompressWeightsMode.INT8_ASYM
    config = WeightCompressionConfig(mode)
    rows, cols = shape
    scale = np.empty((rows, 1), np.float16)
    zero_point = None if symmetric else np.empty((rows, 1), np.uint8)
    for start, stop in row_blocks(rows, cols):
        cw = compress_weight(Tensor(read(start, stop)), (1,), config)
        # NNCF reuses its output buffers between calls: copy out before the next block
        out[start:stop] = np.asarray(cw.tensor.data)
        scale[start:stop] = np.asarray(cw.scale.data)
        if zero_point is not None:
            zero_point[start:stop] = np.asarray(cw.zero_point.data)
    return scale, zero_point


def row_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of a weight [rows, cols] to compress one at a time: ``ROW_BLOCK_BYTES`` of f32
    each, every one at least NNCF's ``MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION`` weights unless the whole tensor
    is smaller. NNCF runs a tensor of that many weights or more through an OpenVINO-compiled kernel and a smaller
    one through numpy (``weight_lowering._can_run_optimized``); a block takes the same one as the whole tensor,
    so blocks give NNCF's bytes for the whole tensor."""
    from nncf.quantization.algorithms.weight_compression.constants import MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION

    least = MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION
    if rows * cols < least:
        return [(0, rows)]
    step = max(1, ROW_BLOCK_BYTES // (cols * 4), -(-least // cols))
    bounds = [*range(0, rows, step), rows]
    if len(bounds) > 2 and (rows - bounds[-2]) * cols < least:  # a short tail joins the block before it
        del bounds[-2]
    return list(itertools.pairwise(bounds))


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values (uint8 0..15 or int8 -8..7, any shape) -> their bytes in OpenVINO's u4/i4 layout: flat,
    element 2k in the low nibble of byte k, an odd count padded with a zero nibble."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << 4)


def int4_rows(read, shape: tuple[int, int], symmetric: bool, group_size: int,
              out: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """int4 of a weight [rows, cols] in groups of ``group_size`` weights along a row (-1: one group per row)
    with NNCF's own lowering (``weight_lowering.compress_weight``, what ``compress_weights`` applies to a weight
    it puts at ``int4_sym``/``int4_asym``), in blocks of rows (``row_blocks``): groups lie within a row, so the
    bytes are NNCF's for the whole tensor.

    ``read(start, stop)`` returns rows ``[start, stop)`` as float16. Returns ``weights``: the codes [rows, cols]
    packed (``pack_nibbles``, i4 when symmetric, else u4), ``scale`` [rows, groups] float16 and, asymmetric,
    ``zero_point``: [rows, groups] u4 packed. ``out`` (uint8, ``rows * cols / 2`` bytes; ``cols`` even): the
    packed codes are written there block by block and ``weights`` is ``out``, so the unpacked codes of the
    whole tensor (a byte per weight) are never held: what a stacked Mixture-of-Experts matrix needs.
    """
    import nncf
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    mode = nncf.CompressWeightsMode.INT4_SYM if symmetric else nncf.CompressWeightsMode.INT4_ASYM
    config = WeightCompressionConfig(mode, group_size=group_size)
    rows, cols = shape
    groups = 1 if group_size == -1 else cols // group_size
    if out is not None and (cols % 2 or out.size != rows * cols // 2):
        raise ValueError(f"int4_rows: out holds {out.size} bytes, a [{rows}, {cols}] weight packs into "
                         f"{rows * cols / 2:g} (cols must be even)")
    codes = None if out is not None else np.empty((rows, cols), np.int8 if symmetric else np.uint8)
    scale = np.empty((rows, groups), np.float16)
    zero_point = None if symmetric else np.empty((rows, groups), np.uint8)
    for start, stop in row_blocks(rows, cols):
        cw = compress_weight(Tensor(read(start, stop)), (1,), config)
        block = np.asarray(cw.tensor.data).reshape(stop - start, cols)
        if out is None:
            codes[start:stop] = block
        else:
            out[start * cols // 2:stop * cols // 2] = pack_nibbles(block)
        scale[start:stop] = np.asarray(cw.scale.data).reshape(stop - start, groups)
        if zero_point is not None:
            zero_point[start:stop] = np.asarray(cw.zero_point.data).reshape(stop - start, groups)
    parts = {"weights": pack_nibbles(codes) if out is None else out, "scale": scale}
    return parts | ({} if zero_point is None else {"zero_point": pack_nibbles(zero_point)})


def sensitivity(read, shape: tuple[int, int]) -> float:
    """NNCF's data-free score of a weight [rows, cols] for ``ratio`` < 1 (``mixed_precision.DataFreeCriterion``,
    nncf 3.4): 1 / (error + float16's eps), the error being the largest over rows of the mean squared error of
    per-channel int8_asym (``weight_lowering.get_integer_quantization_error``, "max_mean"), taken in blocks of
    rows (``row_blocks``; the maximum of the blocks' maxima). The lowest scores go to 4 bit first.
    ``read(start, stop)`` returns rows ``[start, stop)`` as float16."""
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import get_integer_quantization_error
    from nncf.tensor import Tensor

    config = WeightCompressionConfig()  # int8_asym, per channel: NNCF's measure whatever the backup mode
    error = max(get_integer_quantization_error(Tensor(read(start, stop)), (1,), config, reduction="max_mean")
                for start, stop in row_blocks(*shape))
    return 1 / (error + float(np.finfo(np.float16).eps))


def weight_order(model: ov.Model, names: set[str]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The weights among ``names`` that ``model``'s MatMuls (input 1) and Gathers (input 0) read from a constant
    (through Converts), in the order NNCF's ``compress_weights`` walks them to pick each weight's precision: its
    graph's (``GraphConverter.create_nncf_graph``) ``topological_sort``, lexicographic by NNCF's node ids, which
    need not be OpenVINO's ``get_ordered_ops`` (a Mixture-of-Experts layer's router comes after its experts in
    OpenVINO's order, before them in NNCF's). (name, ``"matmul"`` or ``"gather"``, shape), one entry per use;
    nothing is read."""
    from nncf.openvino.graph.nncf_graph_builder import GraphConverter

    rank = {node.node_name: i for i, node in enumerate(GraphConverter.create_nncf_graph(model).topological_sort())}
    order = []
    for node in sorted(model.get_ops(), key=lambda node: rank.get(node.get_friendly_name(), -1)):
        kind = {"MatMul": "matmul", "Gather": "gather"}.get(node.get_type_name())
        if kind is None:
            continue
        source = node.input(1 if kind == "matmul" else 0).get_source_output().get_node()
        while source.get_type_name() == "Convert":
            source = source.input(0).get_source_output().get_node()
        name = source.get_friendly_name()
        if source.get_input_size() == 0 and name in names:
            order.append((name, kind, tuple(source.get_output_shape(0))))
    return order


def int4_plan(order: list[tuple[str, str, tuple[int, ...]]], spec: WeightSpec,
              score: Callable[[str], float] | None = None) -> dict[str, tuple[str, int]]:
    """Each weight's NNCF mode and group size in an int4 stage of ``spec``, ``{name: (mode, group_size)}``, as
    ``compress_weights`` (``all_layers=False``, backup ``int8_asym``, group size fallback ADJUST, data-free)
    picks them (nncf 3.4, ``WeightCompression.get_weight_compression_parameters`` and
    ``MixedPrecisionCriterion.apply``):

    * embeddings (Gathers) and the last MatMul in ``order`` (``weight_order``) at the backup, ``("int8_asym",
      -1)``; when that MatMul's weight was met before (an embedding tied to the LM head in one stage), no
      MatMul is held back;
    * the other MatMuls at ``spec.nncf_mode()`` with ``spec.group_size``, or, when that does not divide the
      row, the largest power of two that does if it is at least NNCF's ``min_adjusted_group_size`` (32),
      else at the backup;
    * ``spec.ratio`` < 1: of those, the ones of lowest ``score(name)`` (``sensitivity``) at 4 bit while their
      weights stay under ``ratio`` of all theirs, the rest at the backup. ``score`` is called once per
      weight (it reads it); it is needed only then (``ValueError`` without it).
    """
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    least = AdvancedCompressionParameters().min_adjusted_group_size
    plan: dict[str, tuple[str, int]] = {}
    matmuls, last_shared = [], False
    for index, (name, kind, shape) in enumerate(order):
        if name in plan:
            last_shared = index == len(order) - 1
            continue
        plan[name] = ("int8_asym", -1)
        if kind == "matmul":
            matmuls.append((name, shape))
    primary = []  # NNCF's ratio-defining weights: (name, weights, group size)
    for name, shape in matmuls if last_shared else matmuls[:-1]:
        group = spec.group_size
        if group != -1 and shape[-1] % group:
            group = shape[-1] & -shape[-1]  # the largest power of two dividing the row
            if group < least:
                continue
        primary.append((name, math.prod(shape), group))
    if spec.ratio < 1 and primary:
        if score is None:
            raise ValueError(f"int4 at ratio {spec.ratio} ranks the weights: int4_plan needs their scores")
        scores = [score(name) for name, _, _ in primary]
        total, kept, chosen = sum(n for _, n, _ in primary), 0, []
        for index in sorted(range(len(primary)), key=scores.__getitem__):  # stable: ties in graph order
            if (kept + primary[index][1]) / total >= spec.ratio:
                break
            chosen.append(primary[index])
            kept += primary[index][1]
        primary = chosen
    for name, _, group in primary:
        plan[name] = (spec.nncf_mode(), group)
    return plan


def describe(fmt: str, parameters: dict[str, object]) -> str:
    """Short label of a recorded format, e.g. ``int4 asym g32 r1.0`` or ``fp16``."""
    mode = str(parameters.get("mode", ""))
    parts = [fmt]
    if mode:
        parts.append("sym" if mode.endswith("_sym") else "asym")
    if "group_size" in parameters:
        parts.append(f"g{parameters['group_size']}" if parameters["group_size"] != -1 else "per-channel")
    if "ratio" in parameters:
        parts.append(f"r{float(parameters['ratio']):.1f}")
    return " ".join(parts)
