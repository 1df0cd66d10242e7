"""Prefix caching across requests: the KV of finished conversations stays on the stages, and a new
request whose prompt begins with one of them prefills only the rest.

The coordinator owns the cache for every stage at once (the stages only hold sessions): a finished
request's KV is *retained* as a session of its own (``BatchGroup.detach`` copies its row out of its
batch group, packed, so slot i holds logical position i), with the tokens it holds. A new prompt is
matched against the retained sessions' tokens by longest common prefix (LCP), as llama-server's slots,
exo's ``KVPrefixCache`` and OpenVINO GenAI's stateful chat (``align_cache_and_history``) do:

* the prompt extends a retained session entirely (the next turn of a chat): the request *takes* it
  (``OpenSession(resume)`` grows its reservation) and prefills the new suffix;
* the prompt shares only part of it (a chat edited in the middle, a regenerated answer, a client's
  title request that wraps the whole chat): the request gets a *copy* of the common prefix
  (``Copy``) and the retained session stays for its own conversation, so a background request never
  takes the KV of the chat it summarises;
* a taken conversation runs where its KV is; a copy is made only on the pipeline placement picked
  for the request anyway (with replicas, spreading the load outweighs saving a prefill);
* below ``min_tokens`` of common prefix, nothing is reused;
* a request reuses only what requests with the same API key left (its ``scope``): a conversation's
  prefix, and the TTFT and ``cached_tokens`` it shows, never leak to holders of another key.

A retained session serves one request at a time. Eviction is the coordinator's, for all stages at
once: least recently used first, beyond ``max_tokens`` retained tokens, after ``idle_s`` without use,
and under admission pressure (a stage without KV room for a new request) before any request waits.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class Retained:
    """A finished request's KV held on every stage of ``pipeline`` as session ``session_id``: slot i
    holds ``tokens[i]`` at logical position i. ``draft``: the draft model's session for the same
    tokens (a ``DraftSession``), when the request drafted with one."""

    session_id: str
    pipeline: Any  # coordinator.engine.pipeline.Pipeline
    tokens: list[int]
    draft: Any = None
    scope: str = ""  # the API key's digest of the request it came from: only requests with the same reuse it
    last_used: float = field(default_factory=time.monotonic)
    copying: int = 0  # copies of its prefix in flight (and its own making): not evicted meanwhile
    doomed: bool = False  # cleared while copying: evicted once the copies are done, never matched again
    ready: asyncio.Future | None = None  # True once its KV is in place at the stages, False if that failed


@dataclass
class Hit:
    """What a prompt reuses: ``tokens`` of ``entry`` (its first ones), taken whole (``take``: the
    prompt extends the entry) or copied."""

    entry: Retained
    tokens: int
    take: bool


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def new_session_id() -> str:
    return f"kv-{uuid.uuid4().hex[:24]}"


class PrefixCache:
    """The retained sessions, least recently used first.

    ``close(entry)`` frees an evicted entry's sessions (on the stages, in the background);
    ``min_tokens``: the shortest common prefix worth reusing; ``max_tokens``: bound on the tokens all
    retained sessions hold together; ``idle_s``: an entry unused this long is evicted.
    """

    def __init__(self, close: Callable[[Retained], None], min_tokens: int = 16, max_tokens: int = 16384,
                 idle_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._close = close
        self.min_tokens, self.max_tokens, self.idle_s = min_tokens, max_tokens, idle_s
        self._clock = clock
        self.entries: list[Retained] = []
        self.evictions = 0

    @property
    def held_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def lookup(self, prompt: list[int], usable: Callable[[Retained], bool] = lambda e: True) -> Hit | None:
        """The best reuse for ``prompt`` [tokens] among entries ``usable`` says may serve it (their
        pipeline is healthy): the longest common prefix, at least ``min_tokens`` and at most
        ``len(prompt) - 1`` (one token is always fed, for the logits). A taken entry leaves the cache
        (the request owns its session); a copied one is marked ``copying`` until ``copied``."""
        self.sweep()
        best, best_n = None, 0
        for entry in self.entries:
            if entry.doomed:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > best_n and usable(entry):
                best, best_n = entry, n
        best_n = min(best_n, len(prompt) - 1)
        if best is None or best_n < self.min_tokens:
            return None
        take = best_n == len(best.tokens)
        if take:
            self.entries.remove(best)
        else:
            best.copying += 1
            best.last_used = self._clock()
            self._touch(best)
        return Hit(best, best_n, take)

    def copied(self, hit: Hit) -> None:
        """The copy of ``hit``'s prefix is made (or failed): its entry may be evicted again."""
        if not hit.take:
            self.done_copying(hit.entry)

    def done_copying(self, entry: Retained) -> None:
        """One copy of ``entry`` (or its own making) is done: a ``clear`` meanwhile evicts it now."""
        entry.copying -= 1
        if entry.doomed and not entry.copying and entry in self.entries:
            self._evict(entry)

    def retain(self, entry: Retained) -> bool:
        """Add a finished request's KV (while ``entry.ready`` is pending, its KV is still being put in
        place: it can be matched, and the request that matches it waits for it, but it is not evicted);
        evicts least recently used entries beyond ``max_tokens``. False: ``entry`` alone is over that bound
        and is not kept."""
        if len(entry.tokens) > self.max_tokens:  # alone over the bound: not kept (the caller frees it)
            return False
        entry.last_used = self._clock()
        self.entries.append(entry)
        while self.held_tokens > self.max_tokens and self.evict_lru(keep=entry):
            pass
        return True

    def evict_lru(self, keep: Retained | None = None) -> bool:
        """Evict the least recently used entry (not ``keep``, not one being copied); whether one was."""
        for entry in self.entries:
            if entry is not keep and not entry.copying:
                self._evict(entry)
                return True
        return False

    def sweep(self) -> None:
        """Evict entries idle longer than ``idle_s`` and entries whose pipeline is gone."""
        now = self._clock()
        for entry in list(self.entries):
            if not entry.copying and (now - entry.last_used > self.idle_s or not entry.pipeline.healthy):
                self._evict(entry)

    def forget(self, entry: Retained) -> None:
        """Drop ``entry`` without freeing anything (its KV never got to the stages)."""
        if entry in self.entries:
            self.entries.remove(entry)

    def discard(self, entry: Retained) -> None:
        """Evict ``entry`` (free its sessions) whether or not it is still listed: a taken entry whose
        reuse failed, or one whose copy failed (its KV may be gone at a stage: never matched again)."""
        if entry in self.entries:
            self.entries.remove(entry)
        self.evictions += 1
        self._close(entry)

    def clear(self) -> None:
        """Evict every entry. One being copied or made is evicted when that is done (``done_copying``): closed
        now, the copy in flight would open its session again after the close, for nobody to free."""
        for entry in list(self.entries):
            if entry.copying:
                entry.doomed = True
            else:
                self._evict(entry)

    def _touch(self, entry: Retained) -> None:
        self.entries.remove(entry)
        self.entries.append(entry)

    def _evict(self, entry: Retained) -> None:
        self.entries.remove(entry)
        self.evictions += 1
        self._close(entry)
