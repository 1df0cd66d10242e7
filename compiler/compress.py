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

Defaults per size class (``SIZE_CLASSES``), by the model's parameter count, for int4 (int8 is
per-channel asymmetric at every size, measured +0.16% perplexity on the demo against +0.50%
symmetric): under 1B parameters, asymmetric, group 32, 80% of the layers at 4 bit. Measured on the
demo (README, "Weight compression"): group 32 beats 64 and 128, and keeping 20% of the layers at
int8 cuts the perplexity increase from +24.5% to +14.8% for 10% more bytes; small models lose the
most, as OpenVINO's guide warns. From 1B: symmetric, group 128, ratio 0.8 (the guide's recommended
configuration for Llama-2-7B-chat and other 7B models); from 10B: symmetric, group 128, ratio 1.0.
The two larger classes come from the guide and are not measured here.
"""

from __future__ import annotations

import math
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


ROW_BLOCK_BYTES = 64 << 20  # int8: rows compressed per NNCF call (per-channel: rows are independent)


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
    step = max(1, ROW_BLOCK_BYTES // (cols * 4))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        cw = compress_weight(Tensor(read(start, stop)), (1,), config)
        # NNCF reuses its output buffers between calls: copy out before the next block
        out[start:stop] = np.asarray(cw.tensor.data)
        scale[start:stop] = np.asarray(cw.scale.data)
        if zero_point is not None:
            zero_point[start:stop] = np.asarray(cw.zero_point.data)
    return scale, zero_point


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
