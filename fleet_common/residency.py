"""One copy of a stage's weights in memory, not two.

OpenVINO memory-maps a stage's ``.bin`` (or a model-cache blob) and, on the first inference, the CPU plugin
repacks every compressed or f16 weight into its own kernel layout (anonymous memory). Reading the file for that
repack leaves every page of the mapping resident in the process, so a worker held the weights twice: its file
pages (the mapped ``.bin``) beside the plugin's copy (bench/kernels/kernel_bench.py: 951 MiB file-backed + 896 MiB
anonymous for a 927 MB stage). After the repack the mapping is read only for what the plugin uses in place (the
embedding rows a Gather reads).

``settle`` runs that first inference at load time on a throwaway request and, while it runs and once it is done,
gives the mapped pages of the stage's files back to the kernel (``madvise(MADV_DONTNEED)``, Linux ``madvise(2)``):
a read-only file mapping's page dropped this way is read again from the page cache if it is touched later, so
nothing changes but the resident set; dropping them while the repack runs keeps the peak near one copy too.
Only mappings without write permission are touched (a private page that was written would be lost).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

MADV_DONTNEED = 4  # linux/mman.h
RELEASE_EVERY_S = 0.1  # while the repack runs: how often the mapped pages read so far are given back


def _mappings(paths: set[str]) -> list[tuple[int, int]]:
    """(start, length) of this process's read-only mappings of ``paths`` (/proc/self/maps, proc(5))."""
    spans = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") in paths and "w" not in parts[1]:
                    start, end = (int(a, 16) for a in parts[0].split("-"))
                    spans.append((start, end - start))
    except OSError:
        return []
    return spans


def release(paths: Iterable[Path]) -> int:
    """Give back the resident pages of this process's read-only mappings of ``paths``; returns the bytes of
    mappings advised (not the pages freed). A no-op (0) where ``madvise`` or ``/proc`` is missing."""
    if not sys.platform.startswith("linux"):
        return 0
    wanted = {str(Path(p).resolve()) for p in paths}
    libc = ctypes.CDLL(None, use_errno=True)
    total = 0
    for start, length in _mappings(wanted):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED) == 0:
            total += length
    return total


def settle(warm_up: Callable[[], None], paths: Iterable[Path]) -> None:
    """Run ``warm_up`` (a first inference: the plugin repacks its weights) while the mapped pages of ``paths``
    are given back every ``RELEASE_EVERY_S``, then once more after it. Exceptions of ``warm_up`` propagate."""
    paths = [Path(p) for p in paths]
    done = threading.Event()

    def releaser() -> None:
        while not done.wait(RELEASE_EVERY_S):
            release(paths)

    thread = threading.Thread(target=releaser, name="fleet-release-pages", daemon=True)
    thread.start()
    try:
        warm_up()
    finally:
        done.set()
        thread.join()
        release(paths)


def resident_mib() -> dict[str, float]:
    """This process's VmHWM (peak), VmRSS, RssAnon and RssFile in MiB (/proc/self/status; {} elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return {}
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    return {k: int(fields[k].split()[0]) / 1024 for k in keys if k in fields}
