"""How a worker gets its shard's CompiledModel, fastest first:

1. a pre-compiled blob of the build (``fleet-compiler precompile``) whose ``BlobKey`` equals what this
   worker would compile here: imported (``Core.import_model``), nothing compiled;
2. otherwise the IR, compiled through OpenVINO's model cache (``CACHE_DIR``, "Model Caching Overview"
   in the OpenVINO docs): imported from the cache when an earlier start on this machine left it there,
   compiled and written there otherwise;
3. the IR compiled, when the cache is off.

It logs which one it used and why (a blob that does not match is never loaded: the log names what
differs), and the worker reports it in its Info RPC (``load_source``, ``load_s``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from fleet_common.blobs import BlobKey, import_blob, ir_digest, shard_config
from fleet_common.manifest import LoadedManifest, ManifestError, sha256_file, verify_files
from fleet_common.runtime import KV_VALUE_BYTES, check_kernels, compile_ir, runs_compressed, stage_core
from fleet_common.settings import cache_home

log = logging.getLogger(__name__)

CACHE_ENTRIES_KEPT = 4  # model-cache files kept per stage IR (one per config and build folder path)
DEFAULT_CACHE_MAX_BYTES = 8 << 30  # the whole model cache (all builds' stages) is kept under this


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fleet/openvino``, else ``~/.cache/fleet/openvino``."""
    return cache_home("openvino")


@dataclass
class LoadedShard:
    """A shard's compiled model and where it came from."""

    compiled: ov.CompiledModel
    kv_value_bytes: int
    source: str  # "blob", "model-cache" or "ir"
    detail: str  # the blob file, the cache folder, or why no blob was used
    seconds: float  # import or compile time
    keepalive: object = None  # a blob's memory map, which the imported model reads its weights from


def load_shard(loaded: LoadedManifest, stage: int, device: str = "CPU", threads: int = 0,
               inference_precision: str = "auto", *, blobs: bool = True, verify_hashes: bool = False,
               cache_dir: Path | None = None, cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES) -> LoadedShard:
    """Load ``stage`` of the build for ``device`` with a worker's ``threads`` and ``inference_precision``.

    ``blobs``: import a matching pre-compiled blob when the build has one. ``verify_hashes``: sha256-check
    the files before loading them (a blob that fails is skipped with a warning; an IR that fails is an
    error). ``cache_dir``: OpenVINO model cache root (None: no cache); each stage IR gets its own folder,
    named by the IR's hashes, because OpenVINO keys what it caches for a model file by the file's path.
    ``cache_max_bytes``: after writing a cache entry, the least recently loaded stage folders of the whole
    cache are deleted until it is under this size (the folder just written is always kept).
    Raises ``ManifestError`` when the IR does not match the manifest, ``RuntimeError`` when it does not
    compile, ``kernels.KernelsUnavailable`` (a ``RuntimeError``: one line saying what to install) when the stage
    needs fleet's kernels and this install lacks them or has another version."""
    manifest = loaded.manifest
    check_kernels(manifest.stages[stage], f"stage {stage} of {loaded.directory}")
    compressed = runs_compressed(device, manifest.stages[stage])
    kv = shard_config(threads, inference_precision, manifest.kv_cache_precision, compressed)["KV_CACHE_PRECISION"]
    kv_bytes = KV_VALUE_BYTES.get(str(kv), 2)
    why_not = ""
    candidates = [b for b in manifest.blobs if b.stage == stage] if blobs else []
    if candidates:
        core = stage_core()
        wanted = BlobKey.here(manifest, stage, device, threads, inference_precision, core)
        reasons = []
        for blob in candidates:
            if reason := BlobKey.from_dict(blob.key).mismatch(wanted):
                reasons.append(f"blob {blob.file} {reason}")
                continue
            path = loaded.directory / blob.file
            if verify_hashes and (not path.is_file() or sha256_file(path) != blob.sha256):
                reasons.append(f"blob {blob.file} is missing or does not match its sha256 in the manifest")
                continue
            t0 = time.perf_counter()
            try:
                imported = import_blob(core, path, device, shard_config(threads, inference_precision, str(kv),
                                                                        compressed))
            except (RuntimeError, OSError, ValueError) as exc:
                reasons.append(f"blob {blob.file} failed to import ({str(exc).strip().splitlines()[-1][:200]})")
                continue
            seconds = time.perf_counter() - t0
            log.info("stage %d: compiled blob %s imported in %.2f s (no compilation)", stage, blob.file, seconds)
            return LoadedShard(imported.compiled, kv_bytes, "blob", blob.file, seconds, imported.mapping)
        why_not = "; ".join(reasons)
        log.warning("stage %d: %s: compiling the IR", stage, why_not)
    entry = manifest.stages[stage]
    if verify_hashes and (problems := verify_files(loaded, only=[entry.xml, entry.bin])):
        raise ManifestError("shard files do not match the manifest: " + "; ".join(problems))
    if cache_dir is None:
        compiled, kv_bytes, seconds = compile_ir(loaded.directory / entry.xml, device, threads, inference_precision,
                                                 manifest.kv_cache_precision, compressed=compressed)
        log.info("stage %d: IR compiled in %.2f s (model cache off)", stage, seconds)
        return LoadedShard(compiled, kv_bytes, "ir", why_not or "model cache off", seconds)
    folder = Path(cache_dir) / ir_digest(manifest, stage)[:16]
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):  # OpenVINO writes cache files in place: one writer at a time
        compiled, kv_bytes, seconds = compile_ir(loaded.directory / entry.xml, device, threads, inference_precision,
                                                 manifest.kv_cache_precision, cache_dir=folder,
                                                 compressed=compressed)
        hit = bool(compiled.get_property("LOADED_FROM_CACHE"))
        (folder / ".lock").touch()  # its mtime is the folder's last use, for _prune_root
        if not hit:
            _prune(folder)
    if not hit:
        _prune_root(Path(cache_dir), cache_max_bytes, keep=folder)
    if hit:
        log.info("stage %d: IR loaded from OpenVINO's model cache %s in %.2f s", stage, folder, seconds)
        return LoadedShard(compiled, kv_bytes, "model-cache", str(folder), seconds)
    log.info("stage %d: IR compiled in %.2f s and written to OpenVINO's model cache %s", stage, seconds, folder)
    return LoadedShard(compiled, kv_bytes, "ir", why_not or f"cache written to {folder}", seconds)


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` across processes (no-op where ``fcntl`` is missing).

    OpenVINO's file cache truncates and rewrites an entry in place, so two workers of the same stage
    starting together could both compile and write it while one already maps it; under the lock the
    second one waits and imports what the first wrote. ``wait=False`` raises ``BlockingIOError`` instead of
    waiting when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prune(folder: Path) -> None:
    """Keep the ``CACHE_ENTRIES_KEPT`` newest cache files of a stage (one per config and per path the
    build was loaded from: copies of a build in temporary folders would pile up otherwise)."""
    entries = sorted(folder.glob("*.blob"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[CACHE_ENTRIES_KEPT:]:
        old.unlink(missing_ok=True)  # a worker that maps it keeps its copy until it exits


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _prune_root(root: Path, max_bytes: int, keep: Path) -> None:
    """Delete the least recently loaded stage folders of the cache at ``root`` until its files total at most
    ``max_bytes`` (``keep``, the folder just written, stays even when it alone is over). Every build and
    every code version a machine ever ran leaves a folder: without this the cache grows without bound (a
    test machine's reached 33 GB). A folder another process holds the lock of is skipped. Errors (a folder
    removed meanwhile) are ignored: pruning never fails a load."""
    import shutil

    try:
        folders = [f for f in root.iterdir() if f.is_dir() and f != keep]
        sizes = {f: _folder_bytes(f) for f in folders}
        total = sum(sizes.values()) + _folder_bytes(keep)
    except OSError:
        return
    lock_time = lambda f: (f / ".lock").stat().st_mtime if (f / ".lock").exists() else 0.0  # noqa: E731
    for old in sorted(folders, key=lock_time):
        if total <= max_bytes:
            break
        try:
            with _locked(old / ".lock", wait=False):
                shutil.rmtree(old)
        except (BlockingIOError, OSError):
            continue
        total -= sizes[old]
        log.info("model cache over %.1f GB: removed %s (%.0f MB, least recently loaded)", max_bytes / 2**30, old,
                 sizes[old] / 2**20)
