"""Retained sessions after a lapse of this coordinator's lease at a worker (issue 26 #2).

A worker frees the sessions of a coordinator it has not heard from for its ``--owner-timeout-s`` (30 s by
default): the coordinator's health checks renew that lease. A coordinator whose event loop stood still
(SIGSTOP, a machine suspended, a request that held the loop) cannot know whether the workers freed its
retained sessions (prefix cache) meanwhile: each would fail the next copy of its prefix, again and again.
So when a worker answers a health check after a gap longer than the coordinator's own limit for dropping
it (``--missed-health-checks`` intervals), every retained session on a pipeline through that worker is
checked on every stage (``OpenSession(resume)`` with the slots it holds: a no-op where it is alive, which
also renews its lease) and forgotten, freed on every stage, where any stage no longer holds it.
"""

from __future__ import annotations

import asyncio
import logging

from .prefix_cache import PrefixCache, Retained

log = logging.getLogger(__name__)


class LeaseCheck:
    """``Registry.on_lease_gap``: checks the retained sessions of ``cache`` through a worker that went
    ``gap_s`` seconds without a health check (``timeout_s``: deadline of each check's calls)."""

    def __init__(self, cache: PrefixCache | None, timeout_s: float) -> None:
        self.cache, self.timeout_s = cache, timeout_s
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, address: str, gap_s: float) -> None:
        """Start checking the retained sessions through ``address`` (in the background)."""
        if self.cache is None:
            return
        task = asyncio.ensure_future(self.check(address, gap_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def check(self, address: str, gap_s: float) -> int:
        """Check every settled retained session through ``address``; returns how many were gone."""
        entries = [e for e in self.cache.entries if address in e.pipeline.addresses and not e.copying
                   and (e.ready is None or e.ready.done())]
        if not entries:
            return 0
        log.warning("worker %s answered after %.0f s without a health check (this coordinator's lease there may "
                    "have lapsed): checking the %d retained session(s) on it", address, gap_s, len(entries))
        gone = sum(await asyncio.gather(*(self._alive(e) for e in entries)))
        if gone:
            log.warning("prefix cache: %d of %d retained session(s) through %s were freed at a stage; forgotten",
                        gone, len(entries), address)
        return gone

    async def _alive(self, entry: Retained) -> int:
        """0 when ``entry``'s session is still held on every stage (it stays retained), else 1 (evicted).
        It leaves the cache while checked, so no request takes it meanwhile."""
        if entry not in self.cache.entries:
            return 0
        self.cache.forget(entry)
        try:
            await entry.pipeline.open_session(entry.session_id, len(entry.tokens), self.timeout_s, resume=True)
        except Exception as exc:  # noqa: BLE001 - NOT_FOUND where it was freed; anything else: not reusable either
            log.info("prefix cache: %s is gone (%s)", entry.session_id, exc)
            self.cache.discard(entry)
            return 1
        entry.pipeline.forget(entry.session_id)  # held KV, not a running request: placement counts only those
        self.cache.retain(entry)  # back, most recently used
        return 0
