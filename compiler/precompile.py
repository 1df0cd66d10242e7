"""``fleet-compiler precompile`` (and ``build --precompile``): compile each stage of a build for a device
and save the compiled model next to its IR, so a worker imports it instead of compiling.

The blob is what ``CompiledModel.export_model`` writes (OpenVINO docs, "Model Caching Overview": the
same export/import the model cache uses, done once ahead of time). It is compiled with exactly the
properties a worker would use (``fleet_common.blobs.shard_config``: the worker's ``--threads`` and
``--inference-precision`` matter) on this machine's device, and recorded in the manifest's ``blobs``
list with its sha256 and ``BlobKey``. Blobs are per machine: run this on the PC that will serve the
stage (the build's identity ignores the list, so the build stays the same build as its copies).
Needs only OpenVINO (no torch).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from fleet_common.blobs import BlobKey, blob_name, export_blob
from fleet_common.manifest import MANIFEST_NAME, BlobEntry, load_manifest
from fleet_common.runtime import check_kernels, compile_ir, runs_compressed, stage_core

log = logging.getLogger(__name__)


def precompile(build: Path, devices: tuple[str, ...] = ("CPU",), threads: int = 0,
               inference_precision: str = "auto", stages: tuple[int, ...] | None = None) -> list[BlobEntry]:
    """Compile ``stages`` (default all) of ``build`` for each of ``devices`` with a worker's ``threads``
    and ``inference_precision``, write each blob next to its IR and record it in the manifest (a blob
    of the same stage and key is replaced). Returns the new entries.

    Raises ``ManifestError`` for a folder that is no build, ``ValueError`` for a stage it lacks,
    ``RuntimeError`` when a stage does not compile on a device."""
    build = Path(build)
    loaded = load_manifest(build)
    manifest = loaded.manifest
    wanted = range(manifest.num_stages) if stages is None else stages
    for s in wanted:
        if not 0 <= s < manifest.num_stages:
            raise ValueError(f"stage {s} out of range: this build has stages 0..{manifest.num_stages - 1}")
    core = stage_core()
    entries = []
    for device in devices:
        for s in wanted:
            key = BlobKey.here(manifest, s, device, threads, inference_precision, core)
            entry = manifest.stages[s]
            check_kernels(entry, f"stage {s} of {build}")
            t0 = time.perf_counter()
            compiled, _, _ = compile_ir(build / entry.xml, device, threads, inference_precision,
                                        manifest.kv_cache_precision, compressed=runs_compressed(device, entry))
            rel = blob_name(entry.xml, key)
            sha = export_blob(compiled, build / rel)
            del compiled
            entries.append(BlobEntry(stage=s, file=rel, sha256=sha, key=key.to_dict()))
            log.info("stage %d: %s blob %s (%.0f MB) in %.1f s", s, device, rel, (build / rel).stat().st_size / 1e6,
                     time.perf_counter() - t0)
    record_blobs(build, entries)
    return entries


def record_blobs(build: Path, entries: list[BlobEntry]) -> None:
    """Add ``entries`` to the manifest's ``blobs``, replacing any of the same stage and key (whose file
    the new blob has overwritten: the file is named by the key). Edits the JSON itself, so fields this
    version does not know survive, and replaces the file atomically (never writes through a hard link)."""
    path = build / MANIFEST_NAME
    raw = json.loads(path.read_text())
    fresh = {(e.stage, json.dumps(e.key, sort_keys=True)) for e in entries}
    kept = [b for b in raw.get("blobs", []) if (b["stage"], json.dumps(b["key"], sort_keys=True)) not in fresh]
    raw["blobs"] = kept + [{"stage": e.stage, "file": e.file, "sha256": e.sha256, "key": e.key} for e in entries]
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
