"""Generation engine: one request's life from chat messages to streamed text, over the pipeline.

The coordinator owns each session's tokens; workers own only KV state. Prefill is chunked
(``prefill_chunk`` tokens per step) so a long prompt never builds one huge message.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from fleet_common.manifest import LoadedManifest

from .batching import BatchGroup, Batcher, Member
from .metrics import CoordinatorMetrics
from .errors import (ContextLengthExceeded, InvalidRequest, Overloaded, PipelineUnavailable, ShuttingDown,
                     StageFailure)
from .registry import Registry
from .sampling import Penalties, SparseDist, generation_defaults, penalized_distribution
from .draft import DraftModel
from .logprobs import LogprobLog, TokenLogprob
from .prefix_cache import PrefixCache, Retained, new_session_id
from .speculative import AdaptiveK, StepCosts, ngram_draft, verify
from .settings import CoordinatorSettings
from .tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client went away


class FinishReason(str, enum.Enum):
    """OpenAI ``finish_reason`` values."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context limit reached


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks, fixed-length runs)
    top_k: int = 0  # sample among this many best candidates (0 = all the last stage returns)
    penalties: Penalties = field(default_factory=Penalties)
    logprobs: int | None = None  # None: none; N: each token's logprob and its N best candidates' (logprobs.py)


@dataclass
class Request:
    """One generation request; token lists change only through its methods."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # of those, accepted by the target
    verify_steps: int = 0  # decode steps that carried drafts
    draft_ms: float = 0.0  # time spent proposing drafts
    verify_ms: float = 0.0  # wall time of the steps that verified drafts
    compactions: int = 0  # KV compactions (one state rewrite per stage each)
    batch_max: int = 0  # most sessions that shared one of its decode steps (its batch group's size)
    failovers: int = 0  # times it moved to replica workers after a stage failed
    output_counts: dict[int, int] = field(default_factory=dict)  # times each token was generated (penalties)
    prefilled: int = 0  # prompt tokens on the stages so far (streamed as prefill progress)
    cached_tokens: int = 0  # prompt tokens whose KV a retained session gave (prefix cache), not prefilled
    logprobs: LogprobLog | None = None  # one record per output token, when params.logprobs asks for them

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = LogprobLog(self.params.logprobs)

    def target(self, ids: np.ndarray, logprobs: np.ndarray, ahead: list[int] = ()) -> SparseDist:  # noqa: B006
        """What to sample the next token from, given the last stage's candidates for it: after the
        penalties over the output so far plus ``ahead`` (drafts before this position in a verify step).
        With logprobs asked for, the candidates are kept for the token decided here: the ``len(ahead)``-th
        of its step, which ``append`` takes them for."""
        p, counts = self.params, self.output_counts
        if self.logprobs is not None:
            self.logprobs.offer(ids, logprobs, len(ahead))
        if p.penalties.active and ahead:
            counts = dict(counts)
            for token in ahead:
                counts[token] = counts.get(token, 0) + 1
        seen = self._prompt_set() if p.penalties.repetition != 1.0 else frozenset()
        return penalized_distribution(ids, logprobs, p.temperature, p.top_p, p.penalties, counts, seen, p.top_k)

    def _prompt_set(self) -> frozenset[int]:
        if not hasattr(self, "_prompt_tokens"):
            self._prompt_tokens = frozenset(self.prompt_ids)
        return self._prompt_tokens

    def record_verify(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """Count one decode step that verified ``drafted`` drafts, ``accepted`` of them accepted."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms

    def speculation_stats(self) -> dict:
        """Acceptance metrics of this request (empty counts when it did not speculate)."""
        return {
            "drafted_tokens": self.drafted,
            "verify_steps": self.verify_steps,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # tokens emitted per verify step: accepted drafts + the target's own token
            "mean_accepted_length": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "compactions": self.compactions,
            "batch_max": self.batch_max,
            "failovers": self.failovers,
        }

    def append(self, token: int, offset: int = 0) -> None:
        """Add an output token; ``offset``: the characters of completion text before its own."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.append(token)
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        if self.logprobs is not None:
            self.logprobs.record(token, offset)

    def take_logprobs(self, upto: int | None = None) -> tuple[TokenLogprob, ...]:
        """The logprob records not yet taken of tokens whose text starts before character ``upto``
        (None: all), for the TextDelta carrying that text; () when none were asked for."""
        return () if self.logprobs is None else self.logprobs.take(upto)

    def finish(self, reason: FinishReason) -> None:
        self.status, self.finish_reason, self.finished_at = RequestStatus.FINISHED, reason, time.perf_counter()

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_at is None else (self.first_token_at - self.created) * 1000

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first per second of decoding (1 / TPOT)."""
        if self.first_token_at is None or self.finished_at is None or len(self.output_ids) < 2:
            return None
        return (len(self.output_ids) - 1) / max(self.finished_at - self.first_token_at, 1e-9)


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text; ``finish_reason`` is set on the last one."""

    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text starts in ``text`` (when asked for)


class Engine:
    """Turns requests into pipeline steps; many requests run concurrently, each its own session."""

    def __init__(self, settings: CoordinatorSettings, loaded: LoadedManifest, registry: Registry,
                 tokenizer: ChatTokenizer) -> None:
        self.settings = settings
        self.manifest = loaded.manifest
        self.registry = registry
        self.tokenizer = tokenizer
        model_context = self.manifest.architecture.max_context
        self.max_context = min(settings.max_context or model_context, model_context)
        self.eos_ids = set(self.manifest.eos_token_ids)
        self.generation_defaults = generation_defaults(loaded.directory)  # the model's, for silent requests
        log.info("model sampling defaults (generation_config.json): %s", self.generation_defaults or "none")
        self._slots = asyncio.Semaphore(settings.max_concurrent_requests)
        self._queued = 0  # requests waiting for a slot
        self.running = 0  # requests generating
        self.metrics = CoordinatorMetrics()
        self._kv_freed_event = asyncio.Event()  # set (and replaced) whenever KV is freed at the stages
        self.model_name = settings.served_model_name or self.manifest.model_id
        self._background: set[asyncio.Task] = set()  # best-effort closes of sessions left behind
        self.stopping = False  # shutting down: new requests are refused
        self._cut: asyncio.Future | None = None  # done: running requests end now (made in the loop, on first use)
        self.step_costs = StepCosts()  # pipeline step wall time by chunk length, for adaptive K
        self.batcher = Batcher(settings.batch_groups or self.manifest.num_stages, settings.max_batch,
                               settings.spec_k_max + 1, settings.compact_share, settings.compact_min_slots,
                               self._timeout, settings.batch_wait_ms / 1000, on_freed=self._kv_freed,
                               context_limit=self.max_context)
        self.draft_source = settings.draft
        if self.draft_source == "auto":
            self.draft_source = self.manifest.drafts[0].name if self.manifest.drafts else "none"
        self.draft_model: DraftModel | None = None
        if self.draft_source not in ("none", "ngram"):
            self.draft_model = DraftModel(loaded, self.draft_source, settings.draft_threads,
                                          settings.inference_precision, settings.prefill_chunk, settings.sample_top_k,
                                          settings.compact_share, settings.compact_min_slots)
        log.info("speculative decoding: draft %s, K %s", self.draft_source,
                 settings.spec_k or f"adaptive (max {settings.spec_k_max})")
        self.prefix_cache: PrefixCache | None = None
        if settings.prefix_cache:
            self.prefix_cache = PrefixCache(self._evict_retained, settings.prefix_cache_min_tokens,
                                            settings.prefix_cache_tokens, settings.prefix_cache_idle_s)

    def prefix_cache_state(self) -> dict:
        """What the prefix cache holds (``/health``, metrics): retained sessions and their tokens."""
        cache = self.prefix_cache
        if cache is None:
            return {"enabled": False, "sessions": 0, "tokens": 0, "evictions": 0}
        return {"enabled": True, "sessions": len(cache.entries), "tokens": cache.held_tokens,
                "evictions": cache.evictions, "max_tokens": cache.max_tokens}

    def _evict_retained(self, entry: Retained) -> None:
        """Free an evicted retained session on every stage (in the background)."""
        self.metrics.prefix_evictions.inc()
        log.debug("prefix cache: freeing %s (%d tokens)", entry.session_id, len(entry.tokens))
        self._close_in_background(entry.pipeline, entry.session_id)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()

    async def drain(self, grace_s: float, bound_s: float = 10.0) -> None:
        """Shut down generation: refuse new requests (``ShuttingDown``) from now on, give running ones
        ``grace_s`` to finish, then end the rest (``cut``), and wait up to ``bound_s`` until every
        session they held is closed at the stages."""
        self.stopping = True
        if await self._settled(grace_s, self._requests_gone):
            return
        log.warning("shutting down: ending %d running request(s) and %d queued", self.running, self._queued)
        self.cut()
        if not await self._settled(bound_s, self._requests_gone):
            log.warning("shutting down: %d request(s) still running after %.0f s", self.running, bound_s)
        if not await self._settled(bound_s, self._sessions_freed):
            log.warning("shutting down: sessions of %d batch group(s) may be left open at the stages",
                        sum(not g.idle for g in self.batcher.groups))

    def cut(self) -> None:
        """End every running request now: its stream raises ``ShuttingDown`` and its sessions are freed."""
        if not self._cut_future().done():
            self._cut.set_result(None)

    def _cut_future(self) -> asyncio.Future:
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    def _requests_gone(self) -> bool:
        return not self.running and not self._queued

    def _sessions_freed(self) -> bool:
        return not self._background and all(g.idle for g in self.batcher.groups)

    @staticmethod
    async def _settled(timeout_s: float, done) -> bool:  # noqa: ANN001 - () -> bool
        """Wait up to ``timeout_s`` for ``done()``; whether it came true."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not done():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _refuse_if_stopping(self) -> None:
        if self.stopping:
            raise ShuttingDown("the coordinator is shutting down and takes no new requests; send the request "
                               "again once it is back (or to another coordinator)")

    def make_request(self, messages: list[dict], params: SamplingParams) -> Request:
        """Tokenize a chat; raises ``ContextLengthExceeded`` when the prompt leaves no room to answer."""
        return self.request_for(self.tokenizer.encode_chat(messages), params)

    def request_for(self, prompt_ids: list[int], params: SamplingParams, param: str = "messages",
                    kind: str = "chatcmpl") -> Request:
        """A request for ``prompt_ids`` (id ``kind-...``); raises ``ContextLengthExceeded`` (naming the
        request field ``param``) when the prompt leaves no room to answer."""
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_context} tokens. However, your {param} "
                f"resulted in {len(prompt_ids)} tokens. Please reduce the length of the {param}.", param=param)
        if params.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        params.max_tokens = min(params.max_tokens, self.max_context - len(prompt_ids))
        return Request(f"{kind}-{uuid.uuid4().hex[:24]}", prompt_ids, params)

    def _timeout(self, tokens: int) -> float:
        s = self.settings
        return s.rpc_timeout_s + tokens * s.per_token_timeout_s * self.manifest.num_stages

    async def generate(self, request: Request) -> AsyncIterator[TextDelta]:
        """Run ``request`` to completion, yielding text deltas (never a split UTF-8 character).

        Waits in a bounded queue for a request slot and for KV room on every stage; raises
        ``Overloaded`` (HTTP 429) when the queue is full or the wait exceeds ``queue_timeout_s``,
        ``PipelineUnavailable`` / ``StageFailure``
        when the fleet cannot serve it. The session's KV is freed on every stage however it ends
        (including the consumer closing this generator on client disconnect).
        """
        s = self.settings
        self._refuse_if_stopping()
        if not self._slots.locked():
            await self._slots.acquire()  # free: returns without suspending
        elif self._queued >= s.max_queued_requests:
            self.metrics.requests.labels("refused").inc()
            raise Overloaded(f"{s.max_concurrent_requests} requests are running and {self._queued} are queued "
                             "(--max-queued-requests); retry shortly")
        else:
            self._queued += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), s.queue_timeout_s)
            except TimeoutError:
                self.metrics.requests.labels("refused").inc()
                raise Overloaded(f"waited {s.queue_timeout_s:.0f} s for one of {s.max_concurrent_requests} request "
                                 "slots (--max-concurrent-requests); retry later") from None
            finally:
                self._queued -= 1
        self.running += 1
        try:
            self._refuse_if_stopping()  # it waited in the queue while the coordinator began to stop
            async with contextlib.aclosing(self._generate(request)) as deltas:
                while (delta := await self._next(request, deltas)) is not None:
                    yield delta
        finally:
            self.running -= 1
            self._slots.release()

    async def _next(self, request: Request, deltas: AsyncIterator[TextDelta]) -> TextDelta | None:
        """The next delta of ``deltas`` (None after the last), or ``ShuttingDown`` when the coordinator
        ends running requests first: ``deltas`` is then cancelled, which frees its sessions."""
        pull = asyncio.ensure_future(_pull(deltas))
        try:
            await asyncio.wait((pull, self._cut_future()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut = not pull.done()  # the cut came first (or this task was cancelled: its client left)
            if cut:
                pull.cancel()
                await asyncio.gather(pull, return_exceptions=True)
        if not cut:
            return pull.result()
        raise ShuttingDown(f"the coordinator is shutting down: this answer was cut short after "
                           f"{len(request.output_ids)} tokens; send the request again once it is back (or to "
                           "another coordinator)")

    async def _open_session(self, pipeline, session: str, slots: int, resume: bool = False) -> None:  # noqa: ANN001
        """Open ``session`` with ``slots`` KV slots on every stage (``resume``: a retained session it
        takes over), waiting while a stage has no room (``_admitted``). Raises ``Overloaded``."""
        await self._admitted(session, lambda: pipeline.open_session(session, slots, self.settings.rpc_timeout_s, resume))

    async def _admitted(self, session: str, attempt) -> None:  # noqa: ANN001 - () -> Awaitable (raises Overloaded)
        """Run ``attempt`` (an OpenSession or a Copy on every stage) until a stage stops refusing it for
        KV room, up to ``queue_timeout_s``: admission control by the workers' KV budgets. Under that
        pressure retained sessions (prefix cache) are freed first, least recently used first. Raises
        ``Overloaded``."""
        s = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.queue_timeout_s
        waited = False
        while True:
            freed = self._kv_freed_event  # taken before the attempt: a free during it is not missed
            try:
                await attempt()
                return
            except Overloaded as exc:
                if self.prefix_cache is not None and self.prefix_cache.evict_lru():
                    log.info("%s: no KV room at a stage; freed a retained session (prefix cache)", session)
                elif not waited:
                    log.info("%s: waiting up to %.0f s for KV room: %s", session, deadline - loop.time(), exc.message)
                    waited = True
                if loop.time() >= deadline:
                    raise Overloaded(f"no stage room for this request's KV after {s.queue_timeout_s:.0f} s in the "
                                     f"queue: {exc.message}") from None
                with contextlib.suppress(TimeoutError):  # a session or batch group freeing KV may make room
                    await asyncio.wait_for(freed.wait(), max(0.0, deadline - loop.time()))

    async def _seat(self, request: Request, slots: int) -> _Seat:
        """A pipeline for ``request`` with its session open on every stage. Raises ``Overloaded``,
        ``PipelineUnavailable``, or ``StageFailure`` (saying which stage has no worker left, when a
        health check of the failed one finds so)."""
        try:
            pipeline = await self.registry.pipeline()
            if pipeline.observe_link is None:
                pipeline.observe_link = lambda link, seconds: self.metrics.link.labels(link).observe(seconds)
            seat = await self._seat_on_retained(request, slots)
            if seat is None:
                await self._open_session(pipeline, request.request_id, slots)
                seat = _Seat(self, request, pipeline, slots)
        except StageFailure as failure:
            if failure.address is not None:
                await self.registry.recheck([failure.address])
            if missing := self.registry.missing_stages():
                raise StageFailure(f"{failure.summary}; {self.registry.missing_message(missing)}",
                                   detail=failure.detail, stage=failure.stage, address=failure.address) from failure
            raise
        return seat

    async def _seat_on_retained(self, request: Request, slots: int) -> _Seat | None:
        """A seat on a retained session's KV when ``request``'s prompt begins with one (prefix cache):
        the session itself when the prompt extends it, else a copy of the common prefix; None when
        nothing is reused (or the reuse failed: the prompt is then prefilled in full). Raises
        ``Overloaded`` when the stages have no room for it."""
        if self.prefix_cache is None:
            return None
        hit = self.prefix_cache.lookup(request.prompt_ids, lambda e: e.pipeline.healthy)
        if hit is None:
            return None
        entry, session = hit.entry, hit.entry.session_id if hit.take else request.request_id
        timeout_s = self._timeout(hit.tokens)
        try:
            if hit.take:
                await self._open_session(entry.pipeline, session, slots, resume=True)
            else:
                await self._admitted(session, lambda: entry.pipeline.copy(session, entry.session_id, 0, hit.tokens,
                                                                          slots, timeout_s))
        except Exception as exc:
            if hit.take:
                self._evict_retained(entry)
            if isinstance(exc, Overloaded):
                raise
            log.warning("%s: could not reuse %d cached tokens of %s (%s); prefilling the whole prompt",
                        request.request_id, hit.tokens, entry.session_id, exc)
            return None
        finally:
            self.prefix_cache.copied(hit)
        request.cached_tokens = hit.tokens
        seat = _Seat(self, request, entry.pipeline, slots, session=session, cached=hit.tokens)
        seat.draft = entry.draft if hit.take else None
        return seat

    async def _prefill(self, pipeline, session: str, tokens: list[int], top_k: int, logits: bool,  # noqa: ANN001
                       request: Request | None = None, offset: int = 0):
        """Run ``tokens`` through every stage in ``prefill_chunk`` steps, after the ``offset`` tokens the
        session holds already (a retained session's); the last step's candidates (``logits``) or None;
        ``request.prefilled`` counts the prompt tokens on the stages. Raises ``StageFailure``."""
        out, chunk_len = None, self.settings.prefill_chunk
        for start in range(0, len(tokens), chunk_len):
            chunk = tokens[start:start + chunk_len]
            last = start + len(chunk) == len(tokens)
            t0 = time.perf_counter()
            out = await pipeline.step(session, chunk, offset + start, offset + start, 1 if last and logits else 0,
                                      top_k, self._timeout(len(chunk)))
            self.metrics.step.labels("prefill").observe(time.perf_counter() - t0)
            if request is not None:
                request.prefilled = offset + start + len(chunk)
        return out

    async def _fail_over(self, request: Request, failure: StageFailure, pipeline, session: str, slots: int,  # noqa: ANN001
                         visible: list[int]):  # noqa: ANN202
        """Move ``request`` to healthy workers after ``failure``: health-check the failed pipeline's
        workers now (a dead one is dropped with every pipeline using it), take the placement's
        pipeline of replicas, open a new session there and prefill the ``visible`` tokens again,
        so the lost KV is rebuilt from the tokens the coordinator owns (Petals' replay, Borzunov et
        al. 2023 §3.2; a fresh session, never a possibly corrupted cache). Returns (pipeline,
        session id). Raises ``StageFailure`` when the attempts are used up, when no replica serves
        a lost stage, or when every worker still answers (the failure was not a lost worker).
        """
        s = self.settings
        if request.failovers >= s.failover_attempts:
            raise failure
        self._close_in_background(pipeline, session)  # frees live stages' KV
        await self.registry.recheck(pipeline.addresses)
        try:
            new = await self.registry.pipeline()
        except PipelineUnavailable as exc:
            raise StageFailure(f"{failure.summary}; {exc.message}", detail=failure.detail, stage=failure.stage,
                               address=failure.address) from failure
        if new is pipeline:
            raise failure
        request.failovers += 1
        self.metrics.failovers.inc()
        session = f"{request.request_id}-{request.failovers}"
        log.warning("%s: %s; failing over to %s, prefilling its %d visible tokens again", request.request_id,
                    failure.message, " -> ".join(new.addresses), len(visible))
        await self._open_session(new, session, slots)
        try:
            await self._prefill(new, session, visible, 1, logits=False)
        except BaseException:
            await asyncio.shield(new.close_session(session, s.rpc_timeout_s))
            raise
        return new, session

    async def _generate(self, request: Request) -> AsyncIterator[TextDelta]:
        s, params = self.settings, request.params
        rng_at, draft_rng_at = _generators(params.seed)
        # greedy without penalties needs only the best candidate (bit-identical to plain argmax)
        top_k = 1 if params.temperature <= 0 and not params.penalties.active else s.sample_top_k
        top_k = max(top_k, params.logprobs or 0)  # the API refuses more than sample_top_k
        prompt = request.prompt_ids
        # physical KV slots (make_request capped max_tokens to the context): rejected drafts keep
        # theirs (masked, never trimmed) until a compaction, hence the slack
        slots = len(prompt) + params.max_tokens + (s.spec_slack if self.draft_source != "none" else 0)
        seat = await self._seat(request, slots)
        drafter = self._drafter(request, seat, slots)
        drafting = self.draft_source != "none" and (self.draft_model is None or drafter is not None)
        detok = IncrementalDetokenizer(self.tokenizer)
        text, sent = "", 0
        hold = max((len(x) for x in params.stop), default=1) - 1
        try:
            out = await self._prefill_all(request, seat, drafter, top_k)
            logical = len(prompt)  # visible tokens at every stage
            policy = AdaptiveK(self.step_costs, s.spec_k_max, fixed=s.spec_k or None)
            decided = [request.target(out.top_ids[-1], out.top_logprobs[-1]).sample(rng_at(len(prompt)))]
            while True:
                text = self._take(request, decided, detok, text, sent, hold)
                if request.finish_reason is not None:
                    break
                safe = len(text) - hold if params.stop else len(text)
                if safe > sent:
                    # a slow client blocks here; its group goes on without it
                    yield TextDelta(text[sent:safe], logprobs=request.take_logprobs(safe))
                    sent = safe
                if seat.group is None:  # decode in a batch group: one infer call per stage for all its sessions
                    await seat.join(logical)
                k = min(policy.choose(), params.max_tokens - len(request.output_ids)) if drafting else 0
                if k and seat.draft_prefill is not None and not seat.draft_prefill.done():
                    await seat.draft_prefill  # the draft must hold the prompt before it proposes
                t0 = time.perf_counter()
                draft, qs = await self._propose(request, seat.member, drafter, k, draft_rng_at)
                # feed the newest token; earlier ones in `decided` were fed as accepted drafts
                chunk = [decided[-1], *draft]
                t1 = time.perf_counter()
                out = await seat.step(chunk, logical, top_k)
                t2 = time.perf_counter()
                request.batch_max = max(request.batch_max, seat.group.last_rows)
                self.step_costs.observe(len(chunk), t2 - t1)
                self.metrics.step.labels("decode").observe(t2 - t1)
                if draft:
                    decided = self._verify(request, seat, out, draft, qs, logical, rng_at, policy, drafter,
                                           draft_s=t1 - t0, verify_s=t2 - t1)
                else:
                    decided = [request.target(out.top_ids[-1], out.top_logprobs[-1]).sample(rng_at(logical + 1))]
                logical += len(decided)  # the fed token and the accepted drafts
            yield TextDelta(text[sent:], request.finish_reason, request.take_logprobs())
        except (asyncio.CancelledError, GeneratorExit):
            # a consumer closing this generator after the last delta (the API does, streamed or not)
            # ends a finished request; only one closed before that was cancelled
            if request.status is not RequestStatus.FINISHED:
                request.status = RequestStatus.CANCELLED
            raise
        except BaseException as exc:
            request.status = RequestStatus.FAILED
            self.metrics.errors.labels(type(exc).__name__).inc()
            raise
        finally:
            await self._end(request, seat, drafter)

    def _drafter(self, request: Request, seat: _Seat, slots: int):  # noqa: ANN202 - DraftSession | None
        """The draft model's session for ``request``: the retained one of its seat's session (prefix
        cache) when that fits, else a fresh one; None without a draft model or when the prompt does not
        fit the draft's context."""
        if self.draft_model is None:
            return None
        drafter = self.draft_model.reopen(seat.draft, slots) if seat.draft is not None else None
        if drafter is None:
            drafter = self.draft_model.open(request.request_id, slots)
        if len(request.prompt_ids) + self.settings.spec_k_max + 1 > drafter.kv.max_context:
            return None
        return drafter

    async def _prefill_all(self, request: Request, seat: _Seat, drafter, top_k: int):  # noqa: ANN001, ANN202
        """Prefill the prompt on the stages and, at the same time, in the draft model (awaited before the
        first proposal, not before the first token); the candidates of the prompt's last position (a
        StepOutput)."""
        request.status = RequestStatus.PREFILL
        if drafter is not None:  # the draft prefills here while the stages prefill
            seat.draft_prefill = asyncio.ensure_future(self.draft_model.run(drafter.prefill, request.prompt_ids))
        out = await seat.prefill(request.prompt_ids, top_k)
        request.status = RequestStatus.DECODE
        return out

    def _take(self, request: Request, decided: list[int], detok: IncrementalDetokenizer, text: str, sent: int,
              hold: int) -> str:
        """Append the ``decided`` tokens to ``request`` until it finishes (end of sequence, a stop string,
        ``max_tokens``); returns its text so far, cut before a stop string (``sent`` characters of it went
        out already, the last ``hold`` are held back while a stop string may still begin there)."""
        params = request.params
        for token in decided:
            if token in self.eos_ids and not params.ignore_eos:
                request.finish(FinishReason.STOP)
                break
            request.append(token, len(text))
            text += detok.push(token)
            if params.stop:
                cut = min((i for i in (text.find(x, max(0, sent - hold)) for x in params.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    request.finish(FinishReason.STOP)
                    if request.logprobs is not None:
                        request.logprobs.cut(cut)
                    return text[:cut]
            if len(request.output_ids) >= params.max_tokens:
                request.finish(FinishReason.LENGTH)
                break
        return text

    async def _propose(self, request: Request, member: Member, drafter, k: int,  # noqa: ANN001 - DraftSession
                       draft_rng_at) -> tuple[list[int], list[SparseDist]]:  # noqa: ANN001
        """Up to ``k`` draft tokens for the next step to verify, with the distributions they were drawn
        from: from the draft model (``drafter``), or by prompt lookup (ngram), or none."""
        params, context = request.params, request.prompt_ids + request.output_ids
        if k and drafter is not None:
            member.drafting = True  # the group waits for this (and only this) past --batch-wait-ms
            try:
                return await self.draft_model.run(drafter.propose, context, k, params.temperature, params.top_p,
                                                  draft_rng_at)
            finally:
                member.drafting = False
        if k and self.draft_source == "ngram":
            draft = ngram_draft(context, k)
            return draft, [SparseDist.point(t) for t in draft]
        return [], []

    def _verify(self, request: Request, seat: _Seat, out, draft: list[int], qs: list[SparseDist],  # noqa: ANN001
                logical: int, rng_at, policy: AdaptiveK, drafter, *, draft_s: float,  # noqa: ANN001
                verify_s: float) -> list[int]:
        """The tokens a step that carried ``draft`` decided (accepted drafts, then the target's own
        token); counts the acceptance and hides the rejected drafts from the group's next step on."""
        # the penalized targets: position i's penalties count the drafts before it (its context if accepted)
        targets = [request.target(out.top_ids[i], out.top_logprobs[i], draft[:i]) for i in range(len(draft) + 1)]
        decided = verify(draft, qs, targets, [rng_at(logical + 1 + i) for i in range(len(draft) + 1)])
        accepted = len(decided) - 1
        request.record_verify(len(draft), accepted, draft_s * 1000, verify_s * 1000)
        if drafter is None:
            self.step_costs.observe_draft(len(draft), draft_s)
        elif drafter.seconds_per_token is not None:
            self.step_costs.observe_draft(1, drafter.seconds_per_token)
        policy.observe(len(draft), accepted)
        seat.group.reject(seat.member, len(draft) - accepted)  # hidden from the next step on, never trimmed
        return decided

    async def _end(self, request: Request, seat: _Seat, drafter) -> None:  # noqa: ANN001 - DraftSession | None
        """However ``request`` ended: count and log it, and keep its KV on every stage for a later prompt
        that begins with its tokens (a finished request, with the prefix cache on) or free it."""
        if seat.draft_prefill is not None and not seat.draft_prefill.done():
            seat.draft_prefill.cancel()
        seat.count_compactions()
        self.metrics.finished(request)
        log.info("%s: %s, prompt %d tokens (%d cached), completion %d tokens, TTFT %s ms, %.1f tok/s, drafts %d/%d "
                 "accepted in %d verify steps (draft %.1f ms, verify %.1f ms), %d compactions, %d failovers",
                 seat.session, request.finish_reason.value if request.finish_reason else request.status.value,
                 len(request.prompt_ids), request.cached_tokens, len(request.output_ids),
                 f"{request.ttft_ms:.0f}" if request.ttft_ms else "-", request.decode_tokens_per_s or 0.0,
                 request.accepted, request.drafted, request.verify_steps, request.draft_ms, request.verify_ms,
                 request.compactions, request.failovers)
        # everything above runs even when a client's disconnect cancels this task, whose every
        # await then raises again at once: the rest goes on in the background (a close then wakes
        # requests waiting for KV room)
        if self.prefix_cache is not None and request.status is RequestStatus.FINISHED:
            await asyncio.shield(self._in_background(self._retain(request, seat, drafter)))
        else:
            await asyncio.shield(self._in_background(self._free(seat)))

    async def _free(self, seat: _Seat) -> None:
        """Free the seat's KV on every stage: its batch group drops its row, or its session is closed."""
        if seat.leave():  # its group frees the KV (the merge may still be running); it no longer runs here
            seat.pipeline.forget(seat.session)
        else:
            await self._close_in_background(seat.pipeline, seat.session)

    async def _retain(self, request: Request, seat: _Seat, drafter) -> None:  # noqa: ANN001 - DraftSession | None
        """Keep a finished request's KV on the stages as a retained session (prefix cache): its row copied
        out of its batch group, or its solo session (prefilled only) kept with its reservation shrunk to
        what it holds; with the draft model's session for the same tokens. Frees it when that fails."""
        if seat.group is None and seat.member is not None:  # failed over and not back in a group: free it
            return await self._free(seat)
        # the tokens fed: the prompt, then the output but its newest token (decided, never fed); past the
        # output only drafts accepted after a stop (an end-of-sequence, a stop string) that no list holds
        context = request.prompt_ids + request.output_ids
        held = min(seat.member.visible, len(context)) if seat.group is not None else len(request.prompt_ids)
        tokens = context[:held]
        pipeline = seat.pipeline
        try:
            if seat.group is not None:
                session = new_session_id()
                copy = seat.detach(session, held)  # the member leaves its group (which frees its row) either way
                seat.pipeline.forget(seat.session)
                await copy
            else:
                session = seat.session
                await pipeline.open_session(session, held, self.settings.rpc_timeout_s, resume=True)
        except Exception as exc:  # noqa: BLE001 - retention is best effort
            log.warning("%s: its KV is not retained (%s)", seat.session, exc)
            if seat.group is None and seat.member is None:
                await self._close_in_background(pipeline, seat.session)
            return None
        draft = None
        if drafter is not None and seat.draft_prefill is not None and seat.draft_prefill.done():
            await self.draft_model.run(drafter.retain, request.prompt_ids + request.output_ids, held)
            draft = drafter
        self.prefix_cache.retain(Retained(session, pipeline, tokens, draft))
        return None

    def _in_background(self, coro) -> asyncio.Task:  # noqa: ANN001
        """``coro`` as a task that a cancellation of the caller does not stop."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _kv_freed(self) -> None:
        """Wake every request waiting for KV room (a session closed, or a batch group closed or dropped
        rows): they retry their ``OpenSession``."""
        self._kv_freed_event.set()
        self._kv_freed_event = asyncio.Event()

    def _close_in_background(self, pipeline, session: str) -> asyncio.Task:  # noqa: ANN001
        """Free ``session``'s KV on every stage of ``pipeline``, then wake requests waiting for room, in a
        task that a cancellation of the caller does not stop (close failures are logged, never raised)."""
        async def close() -> None:
            await pipeline.close_session(session, self.settings.rpc_timeout_s)
            self._kv_freed()

        return self._in_background(close())


async def _pull(deltas: AsyncIterator[TextDelta]) -> TextDelta | None:
    return await anext(deltas, None)


def _generators(seed: int | None):  # noqa: ANN202
    """(target's, draft's) generator makers: one generator per logical position, seeded by (seed, position),
    so a seeded run is reproducible, with point-mass drafts (greedy, ngram) whatever the draft lengths were
    (see speculative.verify); the draft's draws are independent of the target's. No seed: a random one."""
    seed = (seed if seed is not None else int(np.random.SeedSequence().entropy)) % 2**64

    def rng_at(position: int) -> np.random.Generator:
        return np.random.default_rng([seed, position])

    def draft_rng_at(position: int) -> np.random.Generator:
        return np.random.default_rng([seed, position, 1])
    return rng_at, draft_rng_at


class _Seat:
    """Where one request's KV lives: its pipeline and session, and its batch group row once it decodes.
    A stage failure moves it to replica workers (``Engine._fail_over``), which rebuild the KV from the
    tokens the coordinator owns."""

    def __init__(self, engine: Engine, request: Request, pipeline, slots: int,  # noqa: ANN001
                 session: str | None = None, cached: int = 0) -> None:
        self.engine, self.request, self.slots = engine, request, slots
        self.pipeline, self.session = pipeline, session or request.request_id
        self.cached = cached  # prompt tokens the session holds already (a retained session's KV)
        self.draft = None  # the retained draft session of those tokens (a DraftSession), if any
        self.draft_prefill: asyncio.Future | None = None
        self.group: BatchGroup | None = None
        self.member: Member | None = None
        self._joined_compactions = 0  # the group's compactions when it joined (the rest count for it)

    async def prefill(self, prompt: list[int], top_k: int):  # noqa: ANN201 - StepOutput
        """Prefill ``prompt`` on the stages after its ``cached`` tokens; the candidates of its last
        position. On a stage failure the prefill starts over on replicas (a fresh session, given the
        cached tokens again first)."""
        while True:
            try:
                return await self.engine._prefill(self.pipeline, self.session, prompt[self.cached:], top_k,
                                                  logits=True, request=self.request, offset=self.cached)
            except StageFailure as exc:
                await self._move(exc, prompt[:self.cached])

    async def join(self, logical: int) -> None:
        """Move the prefilled session (``logical`` tokens visible) into a batch group of its pipeline,
        failing over if need be."""
        while True:
            self.member = Member(self.session, self.slots, logical)
            self.group = self.engine.batcher.assign(self.pipeline)
            try:
                await self.group.join(self.member)
                self._joined_compactions = self.group.compactions
                return
            except StageFailure as exc:
                await self._fail_over(exc)

    async def step(self, chunk: list[int], logical: int, top_k: int):  # noqa: ANN201 - StepOutput
        """Run ``chunk`` (positions from ``logical``) in the group's next step; on a stage failure, fail
        over, join a group of the replicas and run it there."""
        while True:
            if self.group is None:
                await self.join(logical)
            try:
                return await self.group.step(self.member, chunk, logical, len(chunk), top_k)
            except StageFailure as exc:
                await self._fail_over(exc)

    async def _fail_over(self, failure: StageFailure) -> None:
        """Leave the (broken) group and move to replicas; the stages then hold prompt + output except the
        newest token, which the next chunk feeds."""
        await self._move(failure, self.request.prompt_ids + self.request.output_ids[:-1])

    async def _move(self, failure: StageFailure, visible: list[int]) -> None:
        self.leave()
        self.pipeline, self.session = await self.engine._fail_over(self.request, failure, self.pipeline,
                                                                   self.session, self.slots, visible)

    def count_compactions(self) -> None:
        """Count the group's compactions since the last count for the request."""
        if self.group is not None:
            self.request.compactions += self.group.compactions - self._joined_compactions
            self._joined_compactions = self.group.compactions

    def leave(self) -> bool:
        """Leave the batch group, if in one; True when the group holds the session's KV (and frees it)."""
        if self.group is None:
            return False
        owned = self.member.owned
        self.count_compactions()
        self.group.leave(self.member)
        self.group = None
        return owned

    def detach(self, session_id: str, tokens: int) -> asyncio.Future:
        """Leave the batch group with the first ``tokens`` of the session's KV copied into a new session
        ``session_id`` on every stage (``BatchGroup.detach``); the future the copy's outcome comes in."""
        self.count_compactions()
        group, self.group = self.group, None
        return asyncio.ensure_future(group.detach(self.member, session_id, tokens))
