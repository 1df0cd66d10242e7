"""An empty worker's identity (issue 30): the worker id it announces, kept in its stage cache so that a
restarted worker is the same worker to the coordinator.

The coordinator plans over workers in the order of their ids (coordinator/fleet/planned.py
``nodes_from_capacities``), so a worker that drew a new id at each start could be given another worker's
stage after a restart and both would be shipped again what the other one holds. ``claim`` reads
``<stages dir>/worker-id`` (written once, at the first start) and holds an exclusive lock on
``<stages dir>/worker.lock`` for as long as the process runs: two workers on one stage cache would
announce one id and overwrite each other's stages, so the second one is refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

ID_FILE = "worker-id"
LOCK_FILE = "worker.lock"
_ID = re.compile(r"[0-9a-f]{12}")


class StagesDirInUse(RuntimeError):
    """Another running worker holds this stage cache; the message names the folder and that worker's pid."""


def claim(stages_dir: Path) -> tuple[str, int]:
    """(worker id, the lock's file descriptor: keep it open while serving) for the worker whose stage cache
    is ``stages_dir`` (created if missing). The id is 12 hex digits, read from ``stages_dir/worker-id`` or,
    when that is missing or unreadable, drawn at random and written there. Raises ``StagesDirInUse`` when
    another process holds the folder's lock, ``OSError`` when the folder cannot be created or locked."""
    stages_dir = Path(stages_dir)
    stages_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(stages_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StagesDirInUse(f"stage cache {stages_dir} is in use by another fleet-worker (pid {holder}): give "
                             "each worker on this PC its own --stages-dir") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    path = stages_dir / ID_FILE
    try:
        worker_id = path.read_text().strip()
    except OSError:
        worker_id = ""
    if not _ID.fullmatch(worker_id):
        if worker_id:
            log.warning("%s holds %r, not a worker id: drawing a new one", path, worker_id[:40])
        worker_id = uuid.uuid4().hex[:12]
        tmp = path.with_name(ID_FILE + ".part")
        with open(tmp, "w") as f:
            f.write(worker_id + "\n")
            f.flush()
            os.fsync(f.fileno())  # a power cut must not lose the id: its stages would be shipped again
        tmp.replace(path)
    return worker_id, fd
