"""What an empty worker's stage cache may hold on disk (issue 45): at most ``--stages-max-gb``, the builds
least recently used deleted first to make room; and what no transfer will finish is deleted.

A build's folder (``ROOT/<manifest sha256>``, worker/stage_cache.py) counts every byte under it: its manifest,
its complete files and its partial files. Its last use is the folder's mtime, set when a StageStatus names it,
a file of it is written or it is loaded. ``make_room`` deletes the least recently used builds other than those
``keep`` names (the build served, the builds being written) until the bytes a new file needs fit, or refuses
(RESOURCE_EXHAUSTED) naming the flag. ``clean`` deletes a build folder without a readable manifest (a stored
manifest is renamed in whole: only a crash or someone else leaves one), a partial file no transfer has written
to for ``PART_MAX_AGE_S``, a temporary file of a manifest or index left by a crash, and the segment index of a
``.bin`` no build holds any more.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PART_MAX_AGE_S = 24 * 3600.0  # a partial file untouched this long is deleted (a cut transfer resumes long before)
JUNK_AGE_S = 600.0  # a build folder without a manifest, or a temporary file, this old is deleted (none is younger)
MAX_BUILDS = 256  # builds kept at most (each costs a folder and a manifest of up to 1 MiB), whatever their bytes
HEX = frozenset("0123456789abcdef")


def is_build(path: Path) -> bool:
    """Whether ``path`` is named as a build folder of the cache (64 lowercase hex digits)."""
    return len(path.name) == 64 and set(path.name) <= HEX


@dataclass(frozen=True)
class BuildUse:
    """One build folder: its ``bytes`` on disk (every file under it) and ``used`` (its mtime, unix seconds)."""

    name: str
    bytes: int
    used: float


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (0 when it is gone)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:  # deleted meanwhile
                pass
    return total


def builds(root: Path) -> list[BuildUse]:
    """Each build folder under ``root``, least recently used first."""
    out = []
    for path in root.iterdir() if root.is_dir() else ():
        if path.is_dir() and is_build(path):
            try:
                out.append(BuildUse(path.name, folder_bytes(path), path.stat().st_mtime))
            except OSError:
                continue
    return sorted(out, key=lambda b: (b.used, b.name))


def touch(folder: Path) -> None:
    """Mark the build ``folder`` used now (its mtime)."""
    try:
        os.utime(folder)
    except OSError:
        pass


def evict(root: Path, name: str, why: str) -> None:
    """Delete the build folder ``root/name``, saying why."""
    shutil.rmtree(root / name, ignore_errors=True)
    log.info("stage cache: deleted build %s (%s)", name[:12], why)


def over(root: Path, max_bytes: int, need: int, keep: set[str], reserved: int = 0) -> tuple[int, int]:
    """Delete the least recently used builds not in ``keep`` until ``need`` more bytes (and ``reserved``, the
    bytes other transfers are still to write) fit under ``max_bytes``, and the builds number at most
    ``MAX_BUILDS``. Returns (bytes held by the builds left, bytes still over: 0 when it fits)."""
    held = builds(root)
    used = sum(b.bytes for b in held) + reserved
    count = len(held)
    for b in held:
        if used + need <= max_bytes and count <= MAX_BUILDS:
            break
        if b.name in keep:
            continue
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(b.used))
        evict(root, b.name, f"{b.bytes:,} bytes, unused since {since}: the stage cache is kept under --stages-max-gb "
                            f"({max_bytes / 2**30:g} GiB)")
        used -= b.bytes
        count -= 1
    return used - reserved, max(0, used + need - max_bytes)


def clean(root: Path, busy: set[Path], readable: Callable[[str], set[str] | None], segments_dir: str) -> list[str]:
    """Delete what no transfer will finish (module doc) under ``root``; ``busy`` are the partial files being
    written now, ``readable(name)`` gives the set of file sha256s a build's manifest lists (None when the
    manifest is missing or damaged). Returns the paths deleted."""
    gone: list[str] = []
    now = time.time()
    digests: set[str] = set()

    def drop(path: Path) -> None:
        try:
            path.unlink()
            gone.append(str(path))
        except OSError:
            pass

    for build in (p for p in root.iterdir() if p.is_dir() and is_build(p)) if root.is_dir() else ():
        try:
            age = now - build.stat().st_mtime
        except OSError:
            continue
        files = readable(build.name)
        if files is None:
            if age >= JUNK_AGE_S:
                shutil.rmtree(build, ignore_errors=True)
                gone.append(str(build))
            continue
        digests |= files
        for parent, _, names in os.walk(build):
            for name in names:
                path = Path(parent, name)
                try:
                    idle = now - path.stat().st_mtime
                except OSError:
                    continue
                temporary = name.startswith("manifest.json.") and name.endswith(".part")
                if (temporary and idle >= JUNK_AGE_S) or (
                        name.endswith(".part") and not temporary and path not in busy and idle >= PART_MAX_AGE_S):
                    drop(path)
    index = root / segments_dir
    for path in index.iterdir() if index.is_dir() else ():
        if path.name.startswith(".") and now - path.stat().st_mtime >= JUNK_AGE_S:  # a crashed write's temporary
            drop(path)
        elif path.suffix == ".json" and path.stem not in digests:
            drop(path)
    return gone
