"""``--local-workers N``: run the fleet's workers as child processes of the coordinator.

The embedded default for one-machine use and the demo. Each worker is a real ``fleet-worker``
process on loopback; a child that exits is restarted (with backoff) until the coordinator stops.
Children get the coordinator's ``--secret``/``--tls-*`` files (by path), so they accept its calls and
each other's.

Each child runs in its own session (process group), so a terminal's Ctrl-C, which signals the whole
foreground group, reaches only the coordinator: it ends the answers in flight, then stops its workers.
Linux SIGTERMs a child whose coordinator died any other way (even by SIGKILL).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from fleet_common.security import Security

log = logging.getLogger(__name__)


def _die_with(parent: int):  # noqa: ANN202
    """The child's ``preexec_fn``: ask Linux to SIGTERM it when the coordinator (pid ``parent``) dies,
    even by SIGKILL; exit at once if it died before the request was made."""
    def preexec() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalWorkers:
    """Starts one worker per stage on 127.0.0.1 and keeps them running, secured as ``security`` says
    (default: this process's, which the coordinator's settings set)."""

    def __init__(self, model: Path, num_stages: int, threads: int = 0, inference_precision: str = "auto",
                 security: Security | None = None) -> None:
        self.model = model
        self.security = security if security is not None else Security()
        self.num_stages = num_stages
        self.threads = threads
        self.inference_precision = inference_precision
        self.ports = [free_port() for _ in range(num_stages)]
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._supervisor: asyncio.Task | None = None
        self._stopping = False

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    async def _spawn(self, stage: int) -> None:
        cmd = [sys.executable, "-m", "worker.entry", "--shard", str(stage), "--model", str(self.model),
               "--host", "127.0.0.1", "--port", str(self.ports[stage]), "--threads", str(self.threads),
               "--inference-precision", self.inference_precision, "--no-announce", *self.security.cli_args()]
        self._procs[stage] = await asyncio.create_subprocess_exec(*cmd, preexec_fn=_die_with(os.getpid()),
                                                                  start_new_session=True)
        log.info("local worker for stage %d started (pid %d, port %d)", stage, self._procs[stage].pid,
                 self.ports[stage])

    async def start(self) -> None:
        for stage in range(self.num_stages):
            await self._spawn(stage)
        self._supervisor = asyncio.create_task(self._supervise(), name="local-workers")

    async def _supervise(self) -> None:
        backoff = {s: 1.0 for s in range(self.num_stages)}
        while not self._stopping:
            await asyncio.sleep(0.5)
            for stage, proc in list(self._procs.items()):
                if proc.returncode is not None and not self._stopping:
                    log.warning("local worker for stage %d exited with %s; restarting in %.0f s", stage,
                                proc.returncode, backoff[stage])
                    await asyncio.sleep(backoff[stage])
                    backoff[stage] = min(backoff[stage] * 2, 30.0)
                    await self._spawn(stage)

    async def stop(self) -> None:
        """Stop the workers (SIGTERM; SIGKILL after 10 s) and keep them stopped."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.terminate()
        log.info("stopping %d local worker(s)", sum(p.returncode is None for p in self._procs.values()))
        for proc in self._procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
