"""Generation engine: one request's life from chat messages to streamed text, over the pipeline.

The coordinator owns each session's tokens; workers own only KV state. Prefill is chunked
(``prefill_chunk`` tokens per step) so a long prompt never builds one huge message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fleet_common.manifest import LoadedManifest

from .batching import Batcher, Member
from .draft import DraftModel
from .errors import (ContextLengthExceeded, InvalidRequest, Overloaded, PipelineUnavailable, ShuttingDown,
                     StageFailure)
from .metrics import CoordinatorMetrics
from .prefix_cache import PrefixCache, Retained, new_session_id
from .registry import Registry
from .request import FinishReason, Request, RequestStatus, SamplingParams, TextDelta, position_generators
from .sampling import SparseDist, generation_defaults
from .seat import Seat
from .settings import CoordinatorSettings
from .speculative import AdaptiveK, StepCostsByLoad, ngram_draft, verify
from .tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)


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
        self._decode_step_seconds = self.metrics.step.labels("decode")  # resolved once: labels() costs ~10 us a step
        self._kv_freed_event = asyncio.Event()  # set (and replaced) whenever KV is freed at the stages
        self.model_name = settings.served_model_name or self.manifest.model_id
        self._background: set[asyncio.Task] = set()  # best-effort closes of sessions left behind
        self.stopping = False  # shutting down: new requests are refused
        self._cutting = False  # running requests end now (cut)
        self._pulling: set[asyncio.Task] = set()  # tasks waiting in _next for a request's next delta
        # pipeline step wall time by chunk length and the draft's cost per token, at each load, for adaptive K
        self.step_costs = StepCostsByLoad(lambda: self.running)
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
        self._sweeper: asyncio.Task | None = None  # evicts idle retained sessions and those of dead workers
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
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.draft_model is not None:
            self.draft_model.close()

    async def _sweep(self) -> None:
        """Every health interval: free retained sessions idle past ``--prefix-cache-idle-s`` or held on a
        pipeline that lost a worker (so their KV does not wait for the next request to go)."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            self.prefix_cache.sweep()

    async def drain(self, grace_s: float, bound_s: float = 10.0) -> None:
        """Shut down generation: refuse new requests (``ShuttingDown``) from now on, give running ones
        ``grace_s`` to finish, then end the rest (``cut``), and wait up to ``bound_s`` until every
        session they held is closed at the stages."""
        self.stopping = True
        if await self._settled(grace_s, self._requests_gone):
            await self._free_retained(bound_s)
            return
        log.warning("shutting down: ending %d running request(s) and %d queued", self.running, self._queued)
        self.cut()
        if not await self._settled(bound_s, self._requests_gone):
            log.warning("shutting down: %d request(s) still running after %.0f s", self.running, bound_s)
        await self._free_retained(bound_s)
        if not await self._settled(bound_s, self._sessions_freed):
            log.warning("shutting down: sessions of %d batch group(s) may be left open at the stages",
                        sum(not g.idle for g in self.batcher.groups))

    async def _free_retained(self, bound_s: float) -> None:
        """Free every retained session (prefix cache) at the stages, waiting up to ``bound_s``."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            await self._settled(bound_s, lambda: not self._background)

    def cut(self) -> None:
        """End every running request now: its stream raises ``ShuttingDown`` and its sessions are freed.
        A request waiting for its next delta is cancelled there; one handing a delta to its client
        ends when it asks for the next."""
        self._cutting = True
        for task in self._pulling:
            task.cancel()

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
        if self.prefix_cache is not None and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())
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
        ends running requests first (``cut``): ``deltas`` is then cancelled, which frees its sessions.

        Runs in the caller's task (a task per token cost ~50 us of the coordinator's CPU, issue 17):
        ``cut`` cancels that task while it waits here, and the cancellation becomes ``ShuttingDown``."""
        task = asyncio.current_task()
        if not self._cutting:
            self._pulling.add(task)
            try:
                return await anext(deltas, None)
            except asyncio.CancelledError:
                if not (self._cutting and task.uncancel() == 0):
                    raise  # cancelled from outside (its client left), not or not only by the cut: that wins
            finally:
                self._pulling.discard(task)
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

    async def _seat(self, request: Request, slots: int) -> Seat:
        """A pipeline for ``request`` with its session open on every stage. Raises ``Overloaded``,
        ``PipelineUnavailable``, or ``StageFailure`` (saying which stage has no worker left, when a
        health check of the failed one finds so)."""
        try:
            pipeline = await self._placement()
            seat = await self._seat_on_retained(request, slots, pipeline)
            if seat is None:
                if not pipeline.healthy:  # a worker of it failed when its retained KV was reused
                    pipeline = await self._placement()
                await self._open_session(pipeline, request.request_id, slots)
                seat = Seat(self, request, pipeline, slots)
        except StageFailure as failure:
            if failure.address is not None:
                await self.registry.recheck([failure.address])
            if missing := self.registry.missing_stages():
                raise StageFailure(f"{failure.summary}; {self.registry.missing_message(missing)}",
                                   detail=failure.detail, stage=failure.stage, address=failure.address) from failure
            raise
        return seat

    async def _placement(self):  # noqa: ANN202 - Pipeline
        """The pipeline placement picks for a new session (``Registry.pipeline``), with link metrics."""
        pipeline = await self.registry.pipeline()
        if pipeline.observe_link is None:
            pipeline.observe_link = self.metrics.link.labels(pipeline.path).observe
        return pipeline

    async def _seat_on_retained(self, request: Request, slots: int, placed) -> Seat | None:  # noqa: ANN001
        """A seat on a retained session's KV when ``request``'s prompt begins with one (prefix cache):
        the session itself when the prompt extends it (wherever it is: its conversation's KV), else a
        copy of the common prefix when it is on ``placed``, the pipeline placement picked (a copy does
        not outweigh spreading the load); None when nothing is reused (or the reuse failed: the prompt
        is then prefilled in full). Raises ``Overloaded`` when the stages have no room for it."""
        if self.prefix_cache is None:
            return None
        hit = self.prefix_cache.lookup(request.prompt_ids,
                                       lambda e: e.pipeline.healthy and e.scope == request.cache_scope)
        if hit is not None and not hit.take and hit.entry.pipeline is not placed:
            self.prefix_cache.copied(hit)
            hit = None
        if hit is None:
            return None
        if hit.entry.ready is not None and not await asyncio.shield(hit.entry.ready):  # its retention failed
            self.prefix_cache.copied(hit)
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
            if hit.take or not isinstance(exc, Overloaded):  # a failed copy too: its KV may be gone at a stage
                self.prefix_cache.discard(entry)
            if isinstance(exc, Overloaded):
                raise
            if isinstance(exc, StageFailure):  # a worker holding it may be gone: the next pipeline leaves it out
                await self.registry.recheck(entry.pipeline.addresses)
            log.warning("%s: could not reuse %d cached tokens of %s (%s); prefilling the whole prompt",
                        request.request_id, hit.tokens, entry.session_id, exc)
            return None
        finally:
            self.prefix_cache.copied(hit)
        request.cached_tokens = hit.tokens
        seat = Seat(self, request, entry.pipeline, slots, session=session, cached=hit.tokens)
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
        rng_at, draft_rng_at = position_generators(params.seed)
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
            policy = AdaptiveK(self.step_costs, s.spec_k_max, fixed=s.spec_k or None)
            # the draft prefills beside the stages only if drafting pays on this fleet's measured costs:
            # else it would take CPU from stages that share its cores for tokens never drafted; it
            # prefills when K first becomes > 0 (a probe, or the costs changed)
            out = await self._prefill_all(request, seat, drafter if policy.would_draft() else None, top_k)
            logical = len(prompt)  # visible tokens at every stage
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
                if k and drafter is not None:
                    if seat.draft_prefill is None:
                        self._start_draft_prefill(request, seat, drafter)
                    if not seat.draft_prefill.done():
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
                self._decode_step_seconds.observe(t2 - t1)
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

    def _drafter(self, request: Request, seat: Seat, slots: int):  # noqa: ANN202 - DraftSession | None
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

    async def _prefill_all(self, request: Request, seat: Seat, drafter, top_k: int):  # noqa: ANN001, ANN202
        """Prefill the prompt on the stages and, at the same time, in the draft model if ``drafter`` is
        given (awaited before the first proposal, not before the first token); the candidates of the
        prompt's last position (a StepOutput)."""
        request.status = RequestStatus.PREFILL
        if drafter is not None:  # the draft prefills here while the stages prefill
            self._start_draft_prefill(request, seat, drafter)
        out = await seat.prefill(request.prompt_ids, top_k)
        request.status = RequestStatus.DECODE
        return out

    def _start_draft_prefill(self, request: Request, seat: Seat, drafter) -> None:  # noqa: ANN001 - DraftSession
        """The draft model's prefill of the prompt, started on its thread as ``seat.draft_prefill``."""
        seat.draft_prefill = asyncio.ensure_future(self.draft_model.run(drafter.prefill, request.prompt_ids))

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

    def _verify(self, request: Request, seat: Seat, out, draft: list[int], qs: list[SparseDist],  # noqa: ANN001
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

    async def _end(self, request: Request, seat: Seat, drafter) -> None:  # noqa: ANN001 - DraftSession | None
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

    async def _free(self, seat: Seat) -> None:
        """Free the seat's KV on every stage: its batch group drops its row, or its session is closed."""
        if seat.leave():  # its group frees the KV (the merge may still be running); it no longer runs here
            seat.pipeline.forget(seat.session)
        else:
            await self._close_in_background(seat.pipeline, seat.session)

    async def _retain(self, request: Request, seat: Seat, drafter) -> None:  # noqa: ANN001 - DraftSession | None
        """Keep a finished request's KV on the stages as a retained session (prefix cache): its row copied
        out of its batch group, or its solo session (prefilled only) kept with its reservation shrunk to
        what it holds; with the draft model's session for the same tokens. Frees it when that fails."""
        if seat.group is None and seat.member is not None:  # failed over and not back in a group: free it
            return await self._free(seat)
        # the tokens fed: the prompt, then the output but its newest token (decided, never fed); past the
        # output only drafts accepted after a stop (an end-of-sequence, a stop string) that no list holds
        context = request.prompt_ids + request.output_ids
        held = min(seat.member.visible, len(context)) if seat.group is not None else len(request.prompt_ids)
        pipeline = seat.pipeline
        session = new_session_id() if seat.group is not None else seat.session
        # matchable at once (the client's next request may come before the copy is made: it waits for it)
        entry = Retained(session, pipeline, context[:held], scope=request.cache_scope, copying=1,
                         ready=asyncio.get_running_loop().create_future())
        if not self.prefix_cache.retain(entry):
            return await self._free(seat)
        try:
            if seat.group is not None:
                copy = seat.detach(session, held)  # the member leaves its group (which frees its row) either way
                seat.pipeline.forget(seat.session)
                await copy
            else:
                await pipeline.open_session(session, held, self.settings.rpc_timeout_s, resume=True)
        except Exception as exc:  # noqa: BLE001 - retention is best effort
            log.warning("%s: its KV is not retained (%s)", seat.session, exc)
            self.prefix_cache.forget(entry)
            entry.copying -= 1
            entry.ready.set_result(False)
            if seat.group is None and seat.member is None:
                await self._close_in_background(pipeline, seat.session)
            return None
        draft, prefill = None, seat.draft_prefill
        if drafter is not None and prefill is not None and prefill.done() and not prefill.cancelled() \
                and prefill.exception() is None:
            try:
                await self.draft_model.run(drafter.retain, context, held)
                draft = drafter
            except Exception as exc:  # noqa: BLE001 - the stages' KV is retained without the draft's
                log.warning("%s: the draft model's KV is not retained (%s)", seat.session, exc)
        pipeline.forget(session)  # held KV, not a running request: placement counts only those
        entry.draft = draft
        entry.copying -= 1
        entry.ready.set_result(True)
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


