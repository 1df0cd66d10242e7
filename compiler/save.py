"""Writing one built stage (a shard or a whole-model draft) to disk: its graph from compiler/export.py saved
tensor by tensor (int4 of Mixture-of-Experts stages compressed by NNCF afterwards), a full disk turned into a
``BuildError``, progress on a bar.

Used by compiler/build.py (the stages) and compiler/draft.py (the drafts).
"""

from __future__ import annotations

import errno
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import openvino as ov

from fleet_common.residency import settle

from .arch import ModelConfig
from .compress import WeightSpec, compress, int4_plan, sensitivity, streams_int4, weight_order
from .export import StageSpec, export_stage, stage_tensors


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
               keep_blocks: bool = False) -> None:
    """Build ``stage`` and write it to ``path`` (``.xml`` + ``.bin``) with ``spec``'s weights.

    fp16, int8 and int4 go straight from the source to the file, one tensor at a time, by NNCF's own lowering
    in blocks of rows (compress.int8_rows, compress.int4_rows). Which weight of an int4 stage takes int4 and
    which the int8 backup (compress.int4_plan) comes from the stage's graph before anything is read, and
    below ratio 1.0 from each weight's score (compress.sensitivity), a first pass over the weights one at a
    time. int4 of a Mixture-of-Experts stage (compress.streams_int4): the fp16 IR is written first, read back
    memory-mapped and compressed by NNCF on the whole stage, the mapped pages given back while NNCF reads them
    (fleet_common/residency.py ``settle``). Raises ``BuildError`` on a full disk."""
    total = stage_fp16_bytes(cfg, stage)
    streamed = spec.format in ("fp16", "int8") or streams_int4(spec, bool(cfg.moe_layers))
    fp16 = path if streamed else path.with_name(path.stem + ".fp16.xml")
    int4 = None
    if spec.format == "int4" and streamed:  # the graph alone (nothing read) says which weight takes what
        probe = export_stage(cfg, weights, stage, kv_cache_precision, logits_index_input=logits_index_input)
        int4 = int4_plan(weight_order(probe, set(stage_tensors(cfg, stage))), spec,
                         lambda name: sensitivity(lambda a, b: weights.tensor(name, rows=(a, b)), weights.shape(name)))
        del probe
    with disk_errors(path), progress.task(label, total) as on_read:
        model = export_stage(cfg, weights, stage, kv_cache_precision, logits_index_input=logits_index_input,
                             on_read=on_read, int8=spec if spec.format == "int8" else None, keep_blocks=keep_blocks,
                             int4=int4)
        ov.save_model(model, fp16, compress_to_fp16=False)
        del model
    if streamed:
        return
    with disk_errors(path):
        compressed = []  # NNCF reads every weight of the mapped fp16 IR: its pages given back while it runs
        settle(lambda: compressed.append(compress(ov.Core().read_model(fp16), spec)), [fp16.with_suffix(".bin")])
        ov.save_model(compressed[0], path, compress_to_fp16=False)
        del compressed
    fp16.unlink()
    fp16.with_suffix(".bin").unlink()


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
