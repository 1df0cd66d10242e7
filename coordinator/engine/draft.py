"""Model drafts run by the coordinator: one compiled draft model, one KV session per request.

The draft keeps its own KV cache with mask-based rejection, like the stages: drafts it fed and the
target rejected stay in its state, hidden. Before each proposal it reconciles with the request's
context (the tokens the target decided), so it needs no feedback beyond that context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fleet_common.manifest import DraftEntry, LoadedManifest
from fleet_common.residency import settle
from fleet_common.runtime import (KVSession, compact, compile_ir, run_chunk, runs_compressed, top_candidates,
                                  unpack_token_mask)

from .constraint import Matcher
from .sampling import SparseDist, target_distribution

log = logging.getLogger(__name__)


class DraftSession:
    """One request's state in the draft model.

    Invariant: the visible slots hold ``context[:n]`` in order; ``pending`` are the (token, slot)
    pairs of drafts fed in the last proposal beyond ``n``, not yet known to be accepted.
    """

    def __init__(self, kv: KVSession, prefill_chunk: int, top_k: int, compact_share: float, compact_min_slots: int):
        self.kv = kv
        self.n = 0
        self.pending: list[tuple[int, int]] = []
        self.prefill_chunk = prefill_chunk
        self.top_k = top_k
        self.seconds_per_token: float | None = None  # last proposal's cost per draft token, catch-up excluded
        self.compact_share = compact_share
        self.compact_min_slots = compact_min_slots

    def _feed(self, tokens: list[int], logits: bool) -> np.ndarray | None:
        """Append ``tokens`` at logical positions n.. (chunked); logits [V] of the last one if asked."""
        out = None
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start:start + self.prefill_chunk]
            want = logits and start + len(chunk) == len(tokens)
            x = np.asarray([chunk], dtype=np.int64)
            index = np.array([len(chunk) - 1], dtype=np.int64)
            y, _ = run_chunk(self.kv, "input_ids", x, self.kv.length, self.n + start, [], index)
            out = y[0, -1] if want else None
        return out

    def _reconcile(self, context: list[int]) -> None:
        """Keep the pending drafts the target accepted (a prefix matching ``context``); hide the rest."""
        matched = 0
        for token, _ in self.pending:
            if self.n + matched < len(context) and context[self.n + matched] == token:
                matched += 1
            else:
                break
        self.kv.visible[0, [slot for _, slot in self.pending[matched:]]] = 0
        self.n += matched
        self.pending = []
        invisible = self.kv.length - self.n
        if invisible >= max(self.compact_min_slots, self.compact_share * self.kv.length):
            compact(self.kv, self.kv.length, [])

    def prefill(self, prompt: list[int]) -> None:
        """Feed the prompt tokens the session does not hold (run while the target prefills): all of them,
        or those after a retained conversation's (``retain``; the prompt begins with its tokens)."""
        self._reconcile(prompt)
        self._feed(prompt[self.n:], logits=False)
        self.n = len(prompt)

    def retain(self, context: list[int], keep: int) -> None:
        """Hold exactly ``context[:keep]`` from now on (prefix cache): the drafts the target accepted are
        kept, every other slot hidden, then the state packed (slot i holds position i)."""
        self._reconcile(context)
        slots = np.flatnonzero(self.kv.visible[0, : self.kv.length])
        keep = min(keep, self.n)
        self.kv.visible[0, slots[keep:]] = 0
        self.n = keep
        compact(self.kv, self.kv.length, [])

    def propose(self, context: list[int], k: int, temperature: float, top_p: float,
                rng_at: Callable[[int], np.random.Generator], grammar: Matcher | None = None,
                ) -> tuple[list[int], list[SparseDist]]:
        """Draft up to ``k`` tokens continuing ``context`` (prompt + output so far).

        Returns (tokens [<=k], their draft distributions q [<=k]): point masses at temperature 0,
        else the draft's top-k after the same temperature/top-p as the target. ``rng_at(position)``
        gives the generator for the draft token at that logical position. Fewer than ``k`` (maybe
        none) when the draft's context would overflow, or when ``grammar`` (the request's, left as it
        was) is complete. Under ``grammar`` each draft token is drawn from the draft's distribution
        over the allowed tokens, as the target's is (so verification stays lossless).
        """
        self._reconcile(context)
        if self.n and self.n >= len(context):  # the same context again (a proposal whose step never ran: the
            self._unsee_last()                 # request failed over meanwhile): its newest token is fed again
        new = context[self.n:]
        if not new:
            raise ValueError("propose needs at least one context token (the newest)")
        room = self.kv.max_context - self.kv.length
        if len(new) + k - 1 > room:  # compact once, then give up drafting if still full
            compact(self.kv, self.kv.length, [])
            room = self.kv.max_context - self.kv.length
            k = min(k, room - len(new) + 1)
            if k <= 0:
                return [], []
        t0 = time.perf_counter()
        logits = self._feed(new, logits=True)
        first_s = time.perf_counter() - t0
        self.n += len(new)
        tokens: list[int] = []
        dists: list[SparseDist] = []
        t0 = time.perf_counter()
        mask = None if grammar is None else np.empty(grammar.words, dtype=np.int32)
        try:
            for i in range(k):
                allowed = None
                if grammar is not None:
                    if grammar.stopped:
                        break
                    grammar.fill(mask)
                    allowed = unpack_token_mask(mask[None, :], logits.shape[-1])
                ids, logprobs = top_candidates(logits[None, :], 1 if temperature <= 0 else self.top_k, allowed)
                keep = np.isfinite(logprobs[0])
                q = target_distribution(ids[0][keep], logprobs[0][keep], temperature, top_p)
                token = q.sample(rng_at(self.n + i))
                tokens.append(token)
                dists.append(q)
                if grammar is not None:
                    grammar.consume(token)
                if i + 1 < k:
                    slot = self.kv.length
                    logits = self._feed_draft(token, self.n + i)
                    self.pending.append((token, slot))
        finally:
            if grammar is not None:
                grammar.rollback(len(tokens))
        # what a draft token costs: the single-token forwards; the first forward also fed the tokens the
        # draft had not seen (many after a stretch of plain decoding), so it counts only when short
        if k > 1:
            self.seconds_per_token = (time.perf_counter() - t0) / (k - 1)
        elif len(new) <= 2:
            self.seconds_per_token = first_s
        else:
            self.seconds_per_token = None
        return tokens, dists

    def _unsee_last(self) -> None:
        """Hide the newest visible token (context[n - 1]), so that the next feed gives its logits again."""
        visible = np.flatnonzero(self.kv.visible[0, : self.kv.length])
        self.kv.visible[0, visible[-1]] = 0
        self.n -= 1

    def _feed_draft(self, token: int, position: int) -> np.ndarray:
        x = np.asarray([[token]], dtype=np.int64)
        y, _ = run_chunk(self.kv, "input_ids", x, self.kv.length, position, [], np.zeros(1, dtype=np.int64))
        return y[0, -1]


class DraftModel:
    """The build's draft model compiled once in the coordinator; requests get ``DraftSession``s.

    Inference runs on one dedicated thread (``run``), off the event loop. Raises ``ManifestError`` for a
    draft the build does not have, ``RuntimeError`` when it cannot compile.
    """

    def __init__(self, loaded: LoadedManifest, name: str, threads: int = 0, inference_precision: str = "auto",
                 prefill_chunk: int = 256, top_k: int = 64, compact_share: float = 0.5,
                 compact_min_slots: int = 64) -> None:
        self.entry: DraftEntry = loaded.manifest.draft(name)
        self.name = name
        self.compiled, _, compile_s = compile_ir(loaded.directory / self.entry.xml, "CPU", threads,
                                                 inference_precision, loaded.manifest.kv_cache_precision,
                                                 compressed=runs_compressed("CPU", self.entry))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self._options = (prefill_chunk, top_k, compact_share, compact_min_slots)
        # warm up: the first inferences of a fresh compiled model are several times slower, and
        # adaptive K must not learn the draft's cost from them
        # adaptive K must not learn the draft's cost from them; the plugin repacks the weights then, and the
        # mapped .bin's pages read for it are given back (fleet_common/residency.py: one copy, not two)
        def warm_up() -> None:
            warm = self.open("warm-up", 64)
            warm.prefill([0] * 8)
            for n in (9, 12):
                warm.propose([0] * n, 2, 0.0, 1.0, np.random.default_rng)

        settle(warm_up, [loaded.directory / self.entry.bin])
        log.info("draft %s (%d layers, %s weights) compiled in %.1f s", name, self.entry.num_layers,
                 self.entry.weights, compile_s)

    def open(self, session_id: str, max_slots: int) -> DraftSession:
        """A fresh draft session of at most ``max_slots`` KV slots (capped by the draft's context)."""
        kv = KVSession(session_id, self.compiled.create_infer_request(), min(max_slots, self.entry.max_context))
        return DraftSession(kv, *self._options)

    def reopen(self, draft: DraftSession, max_slots: int) -> DraftSession | None:
        """``draft`` (a retained session) allowed to grow to ``max_slots`` KV slots (capped by the draft's
        context); None when what it holds leaves no room for that."""
        cap = min(max_slots, self.entry.max_context)
        kv = draft.kv
        if kv.length >= cap:
            return None
        kv.resize(cap)
        return draft

    async def run(self, fn: Callable, *args):  # noqa: ANN201 - returns fn's result
        """Run ``fn(*args)`` (a ``DraftSession`` method) on the draft thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
