"""A worker's stage cache (issue 30): the stages shipped to it, one folder per build.

Layout: ``ROOT/<manifest sha256>/manifest.json`` (the build's manifest, its ``blobs`` list dropped: blobs
are compiled per PC and are not shipped) beside the shipped files at the paths the manifest names
(``stage_1/openvino_model.bin``, ...), so the folder loads as a build folder (``load_manifest``) of which
only the shipped stages are present. ``ROOT`` is ``--stages-dir`` (``FLEET_STAGES_DIR``), default
``$XDG_CACHE_HOME/fleet/stages`` (``~/.cache/fleet/stages``).

A file arrives as ``<path>.part``, written at the offset the sender was told (``held``) with unbuffered
writes, so a cut transfer leaves a partial file of exactly the bytes received, resumed there. Its sha256
is computed over the whole file as the pieces arrive (a resumed file's bytes held are read and hashed once
first). Once its last byte is written it is fsynced and renamed into place only when its sha256 equals the
manifest's; otherwise it is deleted. A file at its final path was therefore always checked (and is
checked again before it is loaded: ``verify_stage``).

A stage's ``.bin`` may also be built from the stages the cache holds (``reuse``): each complete stage ``.bin``
is indexed once as content segments (fleet_common/segments.py; ``ROOT/segments/<its sha256>.json``), and a
segment of the new file whose sha256 the index has is copied from there into the partial file, its bytes
hashed again as they are copied, through the same ``write`` as a piece received.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fleet_common.manifest import MANIFEST_NAME, LoadedManifest, Manifest, ManifestError, build_identity, sha256_file
from fleet_common.segments import READ_BYTES, Segment, file_segments
from fleet_common.settings import cache_home

from . import stage_quota

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"
MAX_MANIFEST_BYTES = 1 << 20  # a build's manifest.json is KBs (a 3-stage build of a 30-layer model: 3 KB); 1 MiB
SEGMENTS_DIR = "segments"  # ROOT/segments/<a .bin's sha256>.json: its segments (StageCache.segment_index)


class StageCacheError(ValueError):
    """Input the cache refuses, or a file that failed its check; ``code`` names the gRPC status to answer
    (``INVALID_ARGUMENT``, ``FAILED_PRECONDITION``, ``DATA_LOSS``, ``RESOURCE_EXHAUSTED``)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


def default_stages_dir() -> Path:
    """``$XDG_CACHE_HOME/fleet/stages``, else ``~/.cache/fleet/stages``."""
    return cache_home("stages")


NAME_MAX_BYTES = 255 - len(PART_SUFFIX)  # one part of a path: the file system's 255, less the partial file's suffix
PATH_MAX_BYTES = 1024  # a whole path inside a build (a build's longest: ~40 bytes)


def safe_relative(path: str) -> PurePosixPath:
    """``path`` (a file of a build, as a manifest names it) as a relative POSIX path that stays inside the
    folder it is joined to and that the file system can hold. Raises ``StageCacheError`` for an empty or
    absolute path, a ``..`` or ``.`` part, a backslash, a NUL or a drive letter (``C:``), a name ending in
    ``.part``, a part over ``NAME_MAX_BYTES`` or a path over ``PATH_MAX_BYTES`` bytes (UTF-8), or one that is
    not UTF-8."""
    shown = repr(path) if len(path) <= 200 else repr(path[:200]) + "..."
    if not path or "\\" in path or "\0" in path or path.startswith("/") or ":" in path.split("/")[0]:
        raise StageCacheError(f"path {shown} is not a relative path inside the stage (absolute, empty or not POSIX)")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StageCacheError(f"path {shown} leaves the stage or is not normalised ('..', '.' or '//')")
    if path.endswith(PART_SUFFIX):
        raise StageCacheError(f"path {shown} ends in {PART_SUFFIX}, the cache's partial files")
    try:
        longest, total = max(len(p.encode()) for p in parts), len(path.encode())
    except UnicodeEncodeError:
        raise StageCacheError(f"path {shown} is not UTF-8") from None
    if longest > NAME_MAX_BYTES or total > PATH_MAX_BYTES:
        raise StageCacheError(f"path {shown} is too long for the stage cache: {total:,} bytes, a part of {longest:,} "
                              f"(at most {PATH_MAX_BYTES:,}, and {NAME_MAX_BYTES} per part)")
    return PurePosixPath(path)


def stage_files(manifest: Manifest, stage: int) -> list[str]:
    """The files a worker needs to serve ``stage``: its IR's ``.xml`` and ``.bin`` (the manifest's paths).
    Raises ``StageCacheError`` for a stage the build does not have."""
    if not 0 <= stage < manifest.num_stages:
        raise StageCacheError(f"stage {stage} out of range: the build has stages 0..{manifest.num_stages - 1}")
    entry = manifest.stages[stage]
    return [entry.xml, entry.bin]


_TYPES = {"int": int, "str": str, "dict": dict}


def _check_fields(what: str, value: object) -> None:
    """Each field of the dataclass ``value`` of the type its annotation names (ints >= 0, not bools)."""
    for f in dataclasses.fields(value):
        got, kind = getattr(value, f.name), _TYPES.get(f.type)
        if kind is not None and (not isinstance(got, kind) or (kind is int and (isinstance(got, bool) or got < 0))):
            raise StageCacheError(f"{what}: {f.name} is {str(got)[:80]!r}, not {'an int >= 0' if kind is int else 'a ' + f.type}")


def check_stage_paths(manifest: Manifest) -> None:
    """Check the manifest's architecture and stages as a worker reads them: fields of their types, stage ``i``
    of index ``i`` and layers ``start <= end <= num_layers``, and each stage's ``.xml`` and ``.bin`` a path inside
    the build (``safe_relative``) that the manifest's ``files`` lists with a sha256 (64 lowercase hex digits).
    Raises ``StageCacheError`` naming the stage, the field or the path."""
    _check_fields("architecture", manifest.architecture)
    for i, entry in enumerate(manifest.stages):
        _check_fields(f"stage {i}", entry)
        if entry.index != i or not entry.start <= entry.end <= manifest.architecture.num_layers:
            raise StageCacheError(f"stage {i}: index {entry.index}, layers [{entry.start}, {entry.end}) of "
                                  f"{manifest.architecture.num_layers}")
        for path in (entry.xml, entry.bin):
            if not isinstance(path, str):
                raise StageCacheError(f"stage {entry.index}: file {path!r} is not a path")
            try:
                safe_relative(path)
            except StageCacheError as exc:
                raise StageCacheError(f"stage {entry.index}: {exc}") from None
            digest = manifest.files.get(path)
            if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise StageCacheError(f"stage {entry.index}: {path} has no sha256 in the manifest's files "
                                      f"(found {str(digest)[:80]!r})")


@dataclass(frozen=True)
class Held:
    """What the cache holds of one file: ``bytes`` (all of it when ``complete``, else its partial file's)."""

    path: str
    bytes: int
    complete: bool


class StageCache:
    """The stage cache at ``root`` (module doc). Methods are blocking (file I/O, hashing): the worker runs
    them off its event loop."""

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes  # --stages-max-gb (worker/stage_quota.py); None: the disk's free space only
        # partial file -> (bytes hashed, running sha256): each piece is hashed as it is written, so a file is not
        # read back whole at its end; a resumed file's bytes held are hashed once first (``_running``)
        self._digests: dict[Path, tuple[int, object]] = {}

    def _running(self, part: Path, offset: int):
        """The running sha256 of ``part``'s first ``offset`` bytes (made by reading them when none is kept)."""
        state = self._digests.pop(part, None)
        if state is not None and state[0] == offset:
            return state[1]
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            while (done := f.tell()) < offset and (block := f.read(min(1 << 20, offset - done))):
                digest.update(block)
        return digest

    def build_dir(self, manifest_sha256: str) -> Path:
        """The folder of the build ``manifest_sha256`` (64 hex digits; ``StageCacheError`` otherwise)."""
        if len(manifest_sha256) != 64 or any(c not in "0123456789abcdef" for c in manifest_sha256):
            raise StageCacheError(f"manifest_sha256 {manifest_sha256[:80]!r} is not 64 lowercase hex digits")
        return self.root / manifest_sha256

    def manifest(self, manifest_sha256: str, model_id: str = "") -> LoadedManifest:
        """The cached build's manifest. Raises ``StageCacheError`` (FAILED_PRECONDITION) when the cache has
        none (send it with StageStatus first) or its model id is not ``model_id`` (when given)."""
        folder = self.build_dir(manifest_sha256)
        path = folder / MANIFEST_NAME
        if not path.is_file():
            raise StageCacheError(f"no manifest {manifest_sha256[:12]} in the stage cache: send it with "
                                  "StageStatus first", "FAILED_PRECONDITION")
        try:
            if path.stat().st_size > MAX_MANIFEST_BYTES:
                raise ValueError(f"{path.stat().st_size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a manifest may have")
            manifest = Manifest.from_json(path.read_bytes().decode())
            check_stage_paths(manifest)
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError, ManifestError) as exc:
            raise StageCacheError(f"the stage cache's {path} is damaged ({str(exc)[:200]}): the coordinator's next "
                                  "StageStatus replaces it with the manifest it sends", "FAILED_PRECONDITION") from None
        if model_id and manifest.model_id != model_id:
            raise StageCacheError(f"manifest {manifest_sha256[:12]} is of model {manifest.model_id!r}, not {model_id!r}")
        return LoadedManifest(manifest, folder, manifest_sha256)

    def public(self, message: str) -> str:
        """``message`` (an error the worker logs) as a caller may read it: the stage cache's folder (as given and
        resolved) is left out, so a file in it is named by its path inside the cache (``<build>/<path>``) and
        the cache itself as "the stage cache"; the worker's own log keeps the whole message."""
        for root in sorted({str(self.root), str(self.root.absolute()), str(self.root.resolve())}, key=len,
                           reverse=True):
            message = message.replace(f" ({root})", "").replace(root + os.sep, "").replace(root, "the stage cache")
        return message

    def put_manifest(self, manifest_sha256: str, data: bytes, model_id: str = "") -> LoadedManifest:
        """Store a build's ``manifest.json`` bytes (its ``blobs`` dropped) unless the cache has it. Raises
        ``StageCacheError`` when they are not a manifest, their identity is not ``manifest_sha256`` or the
        model id is not ``model_id`` (when given)."""
        folder = self.build_dir(manifest_sha256)
        if len(data) > MAX_MANIFEST_BYTES:
            raise StageCacheError(f"the manifest sent has {len(data):,} bytes: at most {MAX_MANIFEST_BYTES:,} (a build's "
                                  "manifest is KBs)")
        if (folder / MANIFEST_NAME).is_file():
            try:
                return self.manifest(manifest_sha256, model_id)
            except StageCacheError as exc:
                if exc.code != "FAILED_PRECONDITION":  # another model's: refused as it is
                    raise
                log.warning("%s: replacing it with the manifest sent, once that checks out", exc)
        try:
            identity = build_identity(data)
            raw = json.loads(data)
            check_stage_paths(Manifest.from_json(data.decode()))
        except RecursionError:
            raise StageCacheError("the manifest sent nests too deep to be a fleet manifest") from None
        except (ValueError, TypeError, AttributeError, ManifestError) as exc:  # JSON not an object: Type/AttributeError
            raise StageCacheError(f"the manifest sent is not a fleet manifest: {exc}") from None
        if identity != manifest_sha256:
            raise StageCacheError(f"the manifest sent has identity {identity[:12]}, not {manifest_sha256[:12]}")
        raw.pop("blobs", None)
        self._store_manifest(folder, json.dumps(raw, indent=2, sort_keys=True) + "\n")
        return self.manifest(manifest_sha256, model_id)

    def _store_manifest(self, folder: Path, text: str) -> None:
        """``text`` as ``folder/manifest.json``, through a temporary file of this call's own (two StageStatus calls
        storing it at once each rename a whole one). A full disk is ``StageCacheError`` (RESOURCE_EXHAUSTED) naming
        the file and the bytes free and needed; nothing is left behind."""
        tmp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=MANIFEST_NAME + ".", suffix=PART_SUFFIX, dir=folder)
            with open(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, folder / MANIFEST_NAME)
        except BaseException as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StageCacheError(
                    f"disk full in the stage cache ({self.root}) storing {folder / MANIFEST_NAME} "
                    f"({shutil.disk_usage(self.root).free:,} bytes free, {len(text.encode()):,} needed): free space or "
                    "give fleet-worker another --stages-dir", "RESOURCE_EXHAUSTED") from None
            raise

    def _target(self, loaded: LoadedManifest, path: str) -> tuple[Path, str]:
        """(final path, manifest sha256) of ``path``, a file the build lists. Raises ``StageCacheError``."""
        rel = safe_relative(path)
        expected = loaded.manifest.files.get(path)
        if expected is None:
            raise StageCacheError(f"path {path!r} is not a file of manifest {loaded.sha256[:12]}")
        return loaded.directory / rel, expected

    def held(self, loaded: LoadedManifest, path: str) -> Held:
        """How much of ``path`` the cache holds (a complete file is not hashed again here)."""
        final, _ = self._target(loaded, path)
        if final.is_file():
            return Held(path, final.stat().st_size, True)
        part = final.with_name(final.name + PART_SUFFIX)
        return Held(path, part.stat().st_size if part.is_file() else 0, False)

    def free_bytes(self, keep: frozenset[str] = frozenset()) -> int:
        """Bytes a stage may still take: the free space of the file system holding the cache, and under
        ``max_bytes`` what the builds in ``keep`` (never deleted to make room) leave."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if self.max_bytes is None:
            return free
        kept = sum(b.bytes for b in stage_quota.builds(self.root) if b.name in keep)
        return max(0, min(free, self.max_bytes - kept))

    def make_room(self, loaded: LoadedManifest, path: str, size: int, keep: frozenset[str], reserved: int = 0) -> int:
        """Before ``path`` of ``loaded`` is written up to ``size`` bytes: delete the least recently used builds
        but ``loaded``'s and ``keep``'s until it fits under ``max_bytes`` with ``reserved`` (bytes other transfers
        are still to write), and what no transfer will finish (``clean``). Returns the bytes it still needs.
        Raises ``StageCacheError`` (RESOURCE_EXHAUSTED) naming --stages-max-gb when it cannot fit."""
        held = self.held(loaded, path)
        need = 0 if held.complete else max(0, size - held.bytes)
        stage_quota.touch(loaded.directory)
        if self.max_bytes is None:
            return need
        if size > self.max_bytes:
            raise StageCacheError(f"{path} of manifest {loaded.sha256[:12]} has {size:,} bytes, more than this "
                                  f"worker's stage cache may hold ({self.max_bytes:,} bytes): raise its "
                                  "--stages-max-gb", "RESOURCE_EXHAUSTED")
        used, short = stage_quota.over(self.root, self.max_bytes, need, keep | {loaded.sha256}, reserved)
        if short:
            raise StageCacheError(f"{path} of manifest {loaded.sha256[:12]} needs {need:,} more bytes: the stage cache "
                                  f"holds {used:,} of the {self.max_bytes:,} bytes --stages-max-gb allows in builds it "
                                  "serves or receives now: raise --stages-max-gb", "RESOURCE_EXHAUSTED")
        return need

    def fits(self, loaded: LoadedManifest, path: str, size: int) -> bool:
        """Whether ``path`` of ``loaded`` fits up to ``size`` bytes under ``max_bytes`` beside every build held."""
        if self.max_bytes is None:
            return True
        held = self.held(loaded, path)
        need = 0 if held.complete else max(0, size - held.bytes)
        return sum(b.bytes for b in stage_quota.builds(self.root)) + need <= self.max_bytes

    def use(self, loaded: LoadedManifest, keep: frozenset[str]) -> None:
        """``loaded``'s build is used now (a StageStatus names it, it is loaded): marked so, and the builds least
        recently used but ``keep``'s deleted while the cache is over ``max_bytes`` or ``MAX_BUILDS`` builds."""
        stage_quota.touch(loaded.directory)
        if self.max_bytes is not None:
            stage_quota.over(self.root, self.max_bytes, 0, keep | {loaded.sha256})

    def clean(self, busy: frozenset[str] = frozenset()) -> list[str]:
        """Delete what no transfer will finish (worker/stage_quota.py ``clean``); ``busy`` are the files being
        written (``<manifest sha256>/<path>``), never deleted. Returns the paths deleted."""
        def readable(name: str) -> set[str] | None:
            try:
                return set(self.manifest(name).manifest.files.values())
            except (StageCacheError, OSError):
                return None

        parts = {self.root / f"{key}{PART_SUFFIX}" for key in busy}
        return stage_quota.clean(self.root, parts, readable, SEGMENTS_DIR)

    def write(self, loaded: LoadedManifest, path: str, offset: int, data: bytes, size: int) -> bool:
        """Write ``data`` at ``offset`` of ``path``'s partial file; at ``offset + len(data) == size`` check
        and finish it (``finish``). Returns whether the file is now complete. Raises ``StageCacheError``:
        an offset other than the bytes held (FAILED_PRECONDITION, naming both), data past ``size``, a file
        already complete, a full disk (RESOURCE_EXHAUSTED: the partial file keeps what was written before
        this piece) and a wrong hash (DATA_LOSS: the file is deleted). ``size`` is the sender's word only (the
        manifest has none): a partial file is not bound to a size, so bytes a lying sender left are found by the
        hash at the end, never block another sender (the PutStage handler holds one call to one size)."""
        final, _ = self._target(loaded, path)
        if final.is_file():
            raise StageCacheError(f"{path} is complete in the cache already", "FAILED_PRECONDITION")
        end = offset + len(data)
        if end > size:
            raise StageCacheError(f"{path}: piece at {offset} of {len(data)} bytes goes past the file's size {size}")
        part = final.with_name(final.name + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.is_file() else 0
        if have and (offset == 0 or have > size):
            have = self._restart(part, path, offset, have, size)
        if offset != have:
            raise StageCacheError(f"{path}: piece at offset {offset}, but the cache holds {have} bytes of it: "
                                  f"resume at {have}", "FAILED_PRECONDITION")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        digest = self._running(part, offset)
        try:
            os.lseek(fd, offset, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            os.ftruncate(fd, offset)  # nothing of a piece that did not fit stays
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StageCacheError(
                    f"disk full in the stage cache ({self.root}) writing {path} at {offset:,} of {size:,} bytes "
                    f"({shutil.disk_usage(self.root).free:,} bytes free, {size - offset:,} more needed for this "
                    "file): free space or give fleet-worker another --stages-dir", "RESOURCE_EXHAUSTED") from None
            raise
        finally:
            os.close(fd)
        digest.update(data)
        self._digests[part] = (end, digest)
        if end < size:
            return False
        self.finish(loaded, path)
        return True

    def _restart(self, part: Path, path: str, offset: int, have: int, size: int) -> int:
        """A piece at offset 0, or a partial file longer than the file's ``size`` (left by another build of that
        path, a sender that lied): the partial file is emptied (0 bytes held, returned). A piece elsewhere while
        the partial file is longer than ``size`` is refused (FAILED_PRECONDITION, resume at 0)."""
        if offset:
            raise StageCacheError(f"{path}: the partial file holds {have:,} bytes, more than the file's size {size:,}: "
                                  "resume at 0 (a piece at offset 0 restarts it)", "FAILED_PRECONDITION")
        log.info("stage cache: %s: restarting its partial file (%d bytes held, a piece at offset 0 of %d bytes)",
                 path, have, size)
        os.truncate(part, 0)
        self._digests.pop(part, None)
        return 0

    def settle(self, loaded: LoadedManifest, path: str) -> bool:
        """Whether ``path`` is complete, after putting in place its partial file when that hashes to the
        manifest's sha256 (every byte written, the worker stopped before the rename); a partial file that
        does not is kept as it is (a transfer resumes it), its running hash kept for that."""
        final, expected = self._target(loaded, path)
        part = final.with_name(final.name + PART_SUFFIX)
        if final.is_file() or not part.is_file():
            return final.is_file()
        size = part.stat().st_size
        digest = self._running(part, size)
        self._digests[part] = (size, digest)
        if digest.hexdigest() != expected:
            return False
        self.finish(loaded, path)
        return True

    def finish(self, loaded: LoadedManifest, path: str) -> None:
        """fsync ``path``'s partial file, hash it whole and rename it into place when its sha256 equals the
        manifest's; else delete it and raise ``StageCacheError`` (DATA_LOSS) naming the file and both hashes."""
        final, expected = self._target(loaded, path)
        part = final.with_name(final.name + PART_SUFFIX)
        fd = os.open(part, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        state = self._digests.pop(part, None)
        actual = state[1].hexdigest() if state is not None and state[0] == part.stat().st_size else sha256_file(part)
        if actual != expected:
            part.unlink(missing_ok=True)
            raise StageCacheError(f"{path}: sha256 {actual} of the bytes received differs from the manifest's "
                                  f"{expected}: the file was deleted", "DATA_LOSS")
        os.replace(part, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)
        log.info("stage cache: %s of manifest %s complete (%d bytes, sha256 checked)", path, loaded.sha256[:12],
                 final.stat().st_size)

    def verify_stage(self, loaded: LoadedManifest, stage: int) -> None:
        """Hash ``stage``'s files in the cache against the manifest (a partial file that hashes to it is put in
        place first: ``settle``). Raises ``StageCacheError`` (FAILED_PRECONDITION) naming the files missing, or (DATA_LOSS) a file whose sha256 differs (it is
        deleted, so that shipping it again replaces it; the message names both hashes)."""
        files = stage_files(loaded.manifest, stage)
        missing = [p for p in files if not self.settle(loaded, p)]
        if missing:
            raise StageCacheError(f"stage {stage} of manifest {loaded.sha256[:12]} is not in the cache: missing "
                                  f"{', '.join(missing)} (ship it first)", "FAILED_PRECONDITION")
        for path in files:
            final, expected = self._target(loaded, path)
            if (actual := sha256_file(final)) != expected:
                final.unlink(missing_ok=True)
                raise StageCacheError(f"{path} in the stage cache has sha256 {actual}, the manifest {expected}: "
                                      "deleted; ship it again", "DATA_LOSS")

    def _stage_bins(self):  # noqa: ANN202 - an iterator of (build folder, its manifest, stage entry)
        """Each complete stage ``.bin`` (with its ``.xml``) of each build in the cache."""
        for build in sorted(p for p in self.root.iterdir() if p.is_dir() and len(p.name) == 64) \
                if self.root.is_dir() else []:
            try:
                loaded = self.manifest(build.name)
            except (StageCacheError, ManifestError, ValueError, OSError):
                continue
            for entry in loaded.manifest.stages:
                try:
                    whole = (build / entry.xml).is_file() and (build / entry.bin).is_file()
                except OSError:  # a name the file system refuses: the stage is not held
                    continue
                if whole:
                    yield build, loaded, entry

    def holds_stages(self) -> bool:
        """Whether the cache holds a complete ``.bin`` of any build (``reuse`` may find segments there): file
        names only, no manifest read (StageStatus asks this each time; stored manifests may be many)."""
        builds = [p for p in self.root.iterdir() if p.is_dir() and len(p.name) == 64] if self.root.is_dir() else []
        return any(f.is_file() for build in builds for f in build.rglob("*.bin"))

    def segment_index(self) -> dict[bytes, tuple[Path, int, int, Path]]:
        """sha256 -> (file, offset, size, its index file) of every segment of every complete stage ``.bin``
        (with its ``.xml``) of every build in the cache: read from ``ROOT/segments``, each file not indexed yet hashed once (about
        0.7 GB/s here). A file that cannot be indexed (an xml that does not parse) is left out with a warning."""
        index: dict[bytes, tuple[Path, int, int, Path]] = {}
        folder = self.root / SEGMENTS_DIR
        for build, loaded, entry in self._stage_bins():
            digest = loaded.manifest.files.get(entry.bin, "")
            if len(digest) == 64:
                sidecar = folder / f"{digest}.json"
                for seg in self._segments(sidecar, build / entry.xml, build / entry.bin):
                    index.setdefault(seg.sha256, (build / entry.bin, seg.offset, seg.size, sidecar))
        return index

    @staticmethod
    def _segments(sidecar: Path, xml: Path, binary: Path) -> list[Segment]:
        try:
            rows = json.loads(sidecar.read_text())["segments"]
            return [Segment(int(o), int(n), bytes.fromhex(h)) for o, n, h in rows]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        try:
            segments = file_segments(xml, binary)
        except (ValueError, OSError) as exc:
            log.warning("stage cache: cannot index %s for reuse: %s", binary, exc)
            return []
        try:  # a temporary file of this call's own: two indexing at once each rename a whole one
            sidecar.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{sidecar.name}.", dir=sidecar.parent)
            with open(fd, "w") as f:
                f.write(json.dumps({"segments": [[s.offset, s.size, s.sha256.hex()] for s in segments]}))
            os.replace(tmp, sidecar)
        except OSError as exc:  # a full disk: the index is only not kept
            log.warning("stage cache: cannot keep the index of %s in %s: %s", binary, sidecar, exc)
        return segments

    def reuse(self, loaded: LoadedManifest, path: str, size: int,
              segments: list[Segment]) -> tuple[int, int, list[bool]]:
        """Append to ``path``'s partial file, from its end, each next segment (``segments`` tile ``[0,
        size)`` in order) that ``segment_index`` holds, copied through ``write`` (so hashed, size-checked and,
        at ``size``, checked against the manifest and put in place), until one is not held or the partial file
        ends inside one. Returns (bytes held of the file now, bytes copied, per segment whether it is held).
        A copied segment whose bytes no longer hash to its sha256 is cut off again and ends the copying.
        Raises ``StageCacheError`` for segments that do not tile the file, and as ``write`` does."""
        at = 0
        for seg in segments:
            if seg.offset != at or seg.size <= 0 or len(seg.sha256) != 32:
                raise StageCacheError(f"{path}: segments must tile [0, {size}) in order, each with a 32-byte "
                                      f"sha256: one at {seg.offset} of {seg.size} bytes after byte {at}")
            at += seg.size
        if at != size:
            raise StageCacheError(f"{path}: segments end at byte {at}, the file's size is {size}")
        self._target(loaded, path)  # a file of the build (StageCacheError) before any file is read
        index = self.segment_index()
        held = [seg.sha256 in index and index[seg.sha256][2] == seg.size for seg in segments]
        state = self.held(loaded, path)
        if state.complete:
            return state.bytes, 0, held
        if state.bytes == size:  # every byte written, not checked yet (a worker stopped before the rename)
            self.finish(loaded, path)
            return size, 0, held
        have, copied = state.bytes, 0
        for seg, known in zip(segments, held, strict=True):
            if seg.offset + seg.size <= have:
                continue
            if seg.offset != have or not known:
                break
            if not self._copy(loaded, path, size, seg, index[seg.sha256]):
                break
            have += seg.size
            copied += seg.size
        return have, copied, held

    def _copy(self, loaded: LoadedManifest, path: str, size: int, seg: Segment,
              source: tuple[Path, int, int, Path]) -> bool:
        """Copy ``source`` (file, offset, size, index file) as ``seg`` of ``path`` through ``write``; False (the
        partial file cut back to ``seg.offset``, the source's index file deleted) when the bytes read do not
        hash to ``seg.sha256``."""
        src, offset, _, sidecar = source
        digest, done = hashlib.sha256(), 0
        try:
            f = open(src, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:  # evicted meanwhile (the quota): those bytes are sent instead
            log.info("stage cache: %s no longer readable (%s): not reused", src, exc.strerror)
            return False
        with f:
            while done < seg.size:
                block = os.pread(f.fileno(), min(READ_BYTES, seg.size - done), offset + done)
                if not block:
                    break
                digest.update(block)
                if done + len(block) == seg.size and digest.digest() != seg.sha256:
                    break  # the last block: not written, so a file completing here is never checked wrong
                self.write(loaded, path, seg.offset + done, block, size)
                done += len(block)
        if done == seg.size:
            return True
        log.warning("stage cache: %s bytes [%d, %d) no longer hash to their index entry: not reused", src, offset,
                    offset + seg.size)
        final, _ = self._target(loaded, path)
        part = final.with_name(final.name + PART_SUFFIX)
        if part.is_file():
            os.truncate(part, seg.offset)
        self._digests.pop(part, None)
        sidecar.unlink(missing_ok=True)  # that file is indexed again from its bytes
        return False

