"""Writing one built stage (a shard or a whole-model draft) to disk: its graph from compiler/export.py saved
tensor by tensor, a full disk turned into a ``BuildError``, progress on a bar.

Used by compiler/build.py (the stages) and compiler/draft.py (the drafts).
"""

from __future__ import annotations

import errno
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import openvino as ov

from .arch import ModelConfig, hf_weight_names
from .compress import WeightSpec, int4_plan, sensitivity, weight_order
from .experts import expert_rows, stacked_name
from .export import StageSpec, export_stage, stage_tensors
from .sparse_ffn import SparseFfn


class BuildError(ValueError):
    """A build that cannot go on (disk full, unwritable output); the message says what to do."""


class Progress:
    """A progress bar over a build's bytes (rich), one task per stage or draft, with ETA."""

    def __init__(self, enabled: bool = True) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"), disable=not enabled, transient=False)

    @contextmanager
    def task(self, description: str, total: int):  # noqa: ANN201 - yields the on_read callback
        """A task of ``total`` bytes on the bar; yields its ``on_read(name, nbytes)`` callback."""
        task = self.bar.add_task(description, total=total, tensor="")

        def on_read(name: str, nbytes: int) -> None:
            self.bar.update(task, advance=nbytes, tensor=name)

        yield on_read
        self.bar.update(task, completed=total, tensor="")

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def save_stage(cfg: ModelConfig, weights, stage: StageSpec, path: Path, spec: WeightSpec,  # noqa: ANN001
               kv_cache_precision: str, progress: Progress, label: str, logits_index_input: bool = True,
               keep_blocks: bool = False, kernels: bool = False, sparse_ffn: SparseFfn | None = None) -> None:
    """Build ``stage`` and write it to ``path`` (``.xml`` + ``.bin``) with ``spec``'s weights.

    fp16, int8 and int4 go straight from the source to the file, one tensor at a time, by NNCF's own lowering
    in blocks of rows (compress.int8_rows, compress.int4_rows); a Mixture-of-Experts layer's stacked experts
    too, each stacked matrix compressed in blocks of rows across its experts. Which weight of an int4 stage
    takes int4 and which the int8 backup (compress.int4_plan) comes from the stage's graph before anything is
    read, and below ratio 1.0 from each weight's score (compress.sensitivity), a first pass over the weights
    one at a time. ``keep_blocks``, ``kernels``, ``sparse_ffn``: as ``export_stage``. Raises ``BuildError`` on a
    full disk."""
    total = stage_fp16_bytes(cfg, stage)
    int4 = None
    if spec.format == "int4":  # the graph alone (nothing read) says which weight takes what
        probe = export_stage(cfg, weights, stage, kv_cache_precision, logits_index_input=logits_index_input)
        reads = stacked_reads(cfg, weights, stage)
        int4 = int4_plan(weight_order(probe, set(stage_tensors(cfg, stage)) | set(reads)), spec,
                         lambda name: sensitivity(reads.get(name) or (lambda a, b: weights.tensor(name, rows=(a, b))),
                                                  weight_shape(weights, reads, name)))
        del probe
    with disk_errors(path), progress.task(label, total) as on_read:
        model = export_stage(cfg, weights, stage, kv_cache_precision, logits_index_input=logits_index_input,
                             on_read=on_read, int8=spec if spec.format == "int8" else None, keep_blocks=keep_blocks,
                             int4=int4, kernels=kernels, sparse_ffn=sparse_ffn)
        ov.save_model(model, path, compress_to_fp16=False)
        del model


def stacked_reads(cfg: ModelConfig, weights, stage: StageSpec) -> dict[str, object]:  # noqa: ANN001
    """The stacked expert matrices of ``stage``'s Mixture-of-Experts layers (the constants export.py
    ``_Weights.stacked`` makes, ``model.layers.N.mlp.experts.gate_proj.weight`` [E, rows, cols]), each as
    ``read(start, stop)``: rows ``[start, stop)`` of the matrix flattened to [E * rows, cols], float16, read
    expert by expert from ``weights`` (what compress.sensitivity and compress.int4_rows take)."""
    reads = {}
    for layer in cfg.moe_layers:
        if not stage.start <= layer < stage.end:
            continue
        names = hf_weight_names(cfg, layer)
        for part in ("gate", "up", "down"):
            experts = [names[f"expert.{e}.{part}"] for e in range(cfg.num_experts)]
            reads[stacked_name(experts)] = expert_rows(weights, experts)
    return reads


def weight_shape(weights, reads: dict[str, object], name: str) -> tuple[int, int]:  # noqa: ANN001
    """``name``'s shape as compress.sensitivity reads it: [rows, cols], or a stacked matrix's [E * rows, cols]."""
    return reads[name].shape if name in reads else tuple(weights.shape(name))  # type: ignore[attr-defined]


def stage_fp16_bytes(cfg: ModelConfig, stage: StageSpec) -> int:
    """Bytes of ``stage``'s tensors at 2 per weight: what an fp16 stage writes, and the unit of the
    progress bar (export.py reports each tensor so, whatever it is stored as)."""
    return sum(2 * math.prod(shape) for shape in stage_tensors(cfg, stage).values())


@contextmanager
def disk_errors(path: Path):  # noqa: ANN201
    """Turn a full disk while writing ``path`` into one ``BuildError`` that says so (other errors pass)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        free = shutil.disk_usage(path.parent).free
        if getattr(exc, "errno", None) != errno.ENOSPC and free >= 64 << 20:
            raise
        raise BuildError(f"disk full writing {path} ({human_size(free)} free): free space or choose another -o "
                         "folder; the previous build, if any, is unchanged") from None


def human_size(nbytes: int) -> str:
    """``nbytes`` for a person: 3.2 GiB, 12.5 MiB, 900 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{max(1, round(nbytes / 1024)) if nbytes else 0} KiB"
