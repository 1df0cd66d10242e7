"""The PutStage calls an empty worker runs at once (issue 45), so that a silent sender cannot hold them.

Each call takes one of ``max_puts`` slots (pieces of up to 64 MiB in flight each: memory stays bounded) and is
the one writer of each file it writes. A call is *stalled* when no piece came for ``STALL_S``, or when, older
than that, it received less than ``MIN_RATE_BYTES_S`` on average: a link gone silent, a half-open connection,
a sender trickling bytes to keep its place. A stalled call holds its slot and its files only until another
sender wants them: a new call finding every slot taken ends the most stalled one, and a piece of a file a
stalled call writes ends that call (``ABORTED``, resumable: its bytes written are kept); a sender that keeps
sending is never ended. Without a stalled call a new one is refused at once (RESOURCE_EXHAUSTED with
``BUSY``: the shipper retries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fleet_common.shipping import BUSY

from .stage_cache import StageCacheError

log = logging.getLogger(__name__)

STALL_S = 5.0  # a call without a piece this long may be ended for another sender (a piece: 2 MiB, < 2 s at 1 MiB/s)
MIN_RATE_BYTES_S = 64 << 10  # a call older than STALL_S receiving less than this on average may be ended too
END_WAIT_S = 30.0  # how long a sender waits for an ended call to let go (its piece being written ends first)


@dataclass(eq=False)
class Put:
    """One PutStage call: its handler's task, when it started and got its last piece (monotonic seconds), the
    bytes it received, the files it writes (``<manifest sha256>/<path>``), and why another sender ended it."""

    task: asyncio.Task
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    received: int = 0
    files: set[str] = field(default_factory=set)
    ended: str = ""
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def piece(self, nbytes: int) -> None:
        """A piece of ``nbytes`` arrived."""
        self.last = time.monotonic()
        self.received += nbytes

    def stalled(self, now: float) -> float:
        """How stalled the call is at ``now``: seconds without a piece when it is stalled (module doc), else 0."""
        idle, age = now - self.last, now - self.started
        if idle >= STALL_S or (age >= STALL_S and self.received < MIN_RATE_BYTES_S * age):
            return max(idle, STALL_S)
        return 0.0


class PutSlots:
    """The worker's PutStage calls (module doc); ``writing`` is the set of files being written, shared with
    ReuseStage (a file has one writer)."""

    def __init__(self, max_puts: int, writing: set[str]) -> None:
        self.max_puts, self.writing = max_puts, writing
        self.puts: set[Put] = set()

    async def admit(self, put: Put) -> None:
        """Give ``put`` a slot, ending the most stalled call when every slot is taken. Raises
        ``StageCacheError`` (RESOURCE_EXHAUSTED, ``BUSY``) when none is stalled."""
        if len(self.puts) >= self.max_puts:
            now = time.monotonic()
            victim = max(self.puts, key=lambda p: p.stalled(now))
            if not victim.stalled(now):
                raise StageCacheError(f"{len(self.puts)} PutStage calls are running on this worker (at most "
                                      f"{self.max_puts} at once, so that the pieces they hold stay within bounded "
                                      "memory), each receiving: " + BUSY, "RESOURCE_EXHAUSTED")
            await self.end(victim, f"no piece for {now - victim.last:.0f} s while another sender waited for a slot")
        self.puts.add(put)

    async def claim(self, put: Put, key: str, path: str) -> None:
        """Make ``put`` the writer of ``key`` (``path`` names it in errors), ending a stalled call that writes it.
        Raises ``StageCacheError`` (ABORTED: retried by the shipper) while a call that is not stalled, or a
        ReuseStage, writes it."""
        if key in put.files:
            return
        if key in self.writing:
            holder = next((p for p in self.puts if key in p.files and p is not put), None)
            now = time.monotonic()
            if holder is None or not holder.stalled(now):
                raise StageCacheError(f"{path} is being written by another call", "ABORTED")
            await self.end(holder, f"no piece for {now - holder.last:.0f} s while another sender sent {path}")
            deadline = time.monotonic() + END_WAIT_S
            while key in self.writing and time.monotonic() < deadline:  # its last piece is being written
                await asyncio.sleep(0.05)
            if key in self.writing:
                raise StageCacheError(f"{path} is still being written by an ended call", "ABORTED")
        self.writing.add(key)
        put.files.add(key)

    async def end(self, victim: Put, why: str) -> None:
        """End the call ``victim`` (its handler answers ABORTED with ``why``) and wait until it let its slot go."""
        log.warning("stage store: ending a PutStage call writing %s: %s", ", ".join(sorted(victim.files)) or "nothing",
                    why)
        victim.ended = f"PutStage ended by the worker: {why}; resume at the bytes StageStatus gives"
        victim.task.cancel()
        try:
            await asyncio.wait_for(victim.released.wait(), END_WAIT_S)
        except TimeoutError:
            log.error("stage store: an ended PutStage call did not let go of its slot in %.0f s", END_WAIT_S)

    def leave(self, put: Put) -> None:
        """``put`` has ended: its slot is free (its files are freed by the caller, once their last piece is written)."""
        self.puts.discard(put)
        put.released.set()
