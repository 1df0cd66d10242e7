"""The generation engine's front: admission, placement, failover and shutdown around the step loops.

A request comes from the API (``api/``), waits here for a request slot, is placed on a pipeline
(``fleet/registry.py``) with its session opened on every stage (admission by the workers' KV budgets, a
retained session reused when its prompt begins with one: ``prefix_cache.py``), and is handed to that
pipeline's step loop (``loop.py``), which runs it to the end; its text deltas come back here from
the loop's output processor and go to the API. The coordinator owns each session's tokens; workers
own only KV state, so a stage failure moves the request to replicas, which rebuild its KV from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fleet_common.manifest import LoadedManifest

from .constraint import Grammars
from .grammar_check import GrammarChecker
from .draft import DraftModel
from ..errors import (ContextLengthExceeded, CopyRefused, InvalidRequest, Overloaded, PipelineUnavailable, ShuttingDown,
                     StageFailure)
from .loop import LoopContext, Moved, StepLoop
from .metrics import CoordinatorMetrics
from .output import OutputProcessor
from .prefix_cache import PrefixCache, Retained
from .request import Request, RequestStatus, SamplingParams, TextDelta
from .sampling import generation_defaults
from .scheduler import Scheduler, Seq
from ..settings import CoordinatorSettings
from .speculative import StepCostsByLoad
from ..tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from ..fleet.registry import Registry  # the engine asks it for pipelines; cli.py makes it

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
        self.grammars = Grammars(tokenizer.tokenizer.to_str, self.manifest.architecture.vocab_size, self.eos_ids)
        # every constraint is tried within budgets in a process of its own before it is compiled here
        self.grammar_check = GrammarChecker(tokenizer.tokenizer.to_str, self.manifest.architecture.vocab_size,
                                            self.eos_ids, settings.grammar_check_s, settings.grammar_check_mb,
                                            settings.queue_timeout_s)
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
        self._cutting = False  # running requests end now (cut)
        self._pulling: set[asyncio.Task] = set()  # tasks waiting in _next for a request's next delta
        # pipeline step wall time by chunk length and the draft's cost per token, at each load, for adaptive K
        self.step_costs = StepCostsByLoad(lambda: self.running)
        self.scheduler = Scheduler(settings.batch_groups, settings.max_batch,
                                   settings.prefill_chunk, settings.spec_k_max + 1, settings.compact_share,
                                   settings.compact_min_slots, context_limit=self.max_context)
        self.loops: dict[int, StepLoop] = {}  # one per pipeline (by id: a pipeline is replaced, never mutated)
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
        self.replan = None  # a planned fleet's replan.Replanner (serve --model SOURCE sets it): placement waits on it
        self._context = LoopContext(self._timeout, self.metrics, self.step_costs, self.draft_model,
                                    self.draft_source, self.prefix_cache, self._kv_freed, settings.rpc_timeout_s)

    @property
    def queued(self) -> int:
        """Requests waiting for a request slot."""
        return self._queued

    def _loop(self, pipeline) -> StepLoop:
        """The step loop of ``pipeline`` (made on first use; loops of pipelines gone are dropped)."""
        loop = self.loops.get(id(pipeline))  # a loop holds its pipeline: the id is not reused meanwhile
        if loop is None:
            for key, old in list(self.loops.items()):
                if not old.pipeline.healthy and old.idle:
                    old.close()
                    del self.loops[key]
            loop = self.loops[id(pipeline)] = StepLoop(pipeline, self.scheduler, self._context)
        return loop

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
        for loop in self.loops.values():
            loop.close()
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
                        sum(not g.idle for loop in self.loops.values() for g in loop.groups))

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
        return not self._background and all(loop.idle for loop in self.loops.values())

    @staticmethod
    async def _settled(timeout_s: float, done) -> bool:
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
        return s.rpc_timeout_s + tokens * s.per_token_timeout_s * self.registry.num_stages  # the build served now

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
        if request.params.constraint is not None and request.grammar is None:  # before it takes a slot
            await self.grammar_check.check([request.params.constraint])
            request.grammar = await asyncio.to_thread(self.grammars.matcher, request.params.constraint)
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
                async for delta in deltas:
                    yield delta
        finally:
            self.running -= 1
            self._slots.release()

    async def _next(self, seq: Seq) -> TextDelta | Moved:
        """The next item of ``seq``'s outbox (a delta, or ``Moved``; an exception put there is raised),
        or ``ShuttingDown`` when the coordinator ends running requests first (``cut``).

        Runs in the caller's task (a task per token cost ~50 us of the coordinator's CPU, issue 17):
        ``cut`` cancels that task while it waits here, and the cancellation becomes ``ShuttingDown``."""
        task = asyncio.current_task()
        if not self._cutting:
            self._pulling.add(task)
            try:
                item = await seq.outbox.get()
            except asyncio.CancelledError:
                if not (self._cutting and task.uncancel() == 0):
                    raise  # cancelled from outside (its client left), not or not only by the cut: that wins
            else:
                if isinstance(item, BaseException):
                    raise item
                return item
            finally:
                self._pulling.discard(task)
        raise ShuttingDown(f"the coordinator is shutting down: this answer was cut short after "
                           f"{len(seq.request.output_ids)} tokens; send the request again once it is back (or to "
                           "another coordinator)")

    async def _open_session(self, pipeline, session: str, slots: int, resume: bool = False) -> None:
        """Open ``session`` with ``slots`` KV slots on every stage (``resume``: a retained session it
        takes over), waiting while a stage has no room (``_admitted``). Raises ``Overloaded``."""
        await self._admitted(session, lambda: pipeline.open_session(session, slots, self.settings.rpc_timeout_s, resume))

    async def _admitted(self, session: str, attempt) -> None:
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

    async def _seat(self, request: Request, slots: int, top_k: int, again: bool = False) -> Seq:
        """``request`` as a ``Seq`` on the pipeline placement picks, its session open on every stage.
        Raises ``Overloaded``, ``PipelineUnavailable``, or ``StageFailure`` (saying which stage has no
        worker left, when a health check of the failed one finds so; a planned fleet instead seats it
        ``again`` once, after the re-plan that stage needs)."""
        try:
            pipeline = await self._placement(request)
            seq = await self._seat_on_retained(request, slots, top_k, pipeline)
            if seq is None:
                if not pipeline.healthy:  # a worker of it failed when its retained KV was reused
                    pipeline = await self._placement(request)
                await self._open_session(pipeline, request.request_id, slots)
                seq = self._seq(request, pipeline, request.request_id, slots, top_k, 0)
        except StageFailure as failure:
            if failure.address is not None:
                await self.registry.recheck([failure.address])
            if (missing := self.registry.missing_stages()) and self.replan is not None and not again:
                return await self._seat(request, slots, top_k, again=True)
            if missing:
                raise StageFailure(f"{failure.summary}; {self.registry.missing_message(missing)}",
                                   detail=failure.detail, stage=failure.stage, address=failure.address) from failure
            raise
        return seq

    def _seq(self, request: Request, pipeline, session: str, slots: int, top_k: int, cached: int,
             draft=None) -> Seq:
        """The loop's state of ``request`` on ``session`` (holding its first ``cached`` prompt tokens),
        with its output processor and its draft model session."""
        s = self.settings
        drafter = self._drafter(request, draft, slots)
        drafting = self.draft_source != "none" and (self.draft_model is None or drafter is not None)
        output = OutputProcessor(request, self.tokenizer, self.eos_ids, self.step_costs, s.spec_k_max,
                                 s.spec_k or None, drafting)
        return Seq(request, output, pipeline, session, slots, top_k, request.prompt_ids[cached:], start=cached,
                   drafter=drafter)

    async def _placement(self, request: Request | None = None):
        """The pipeline placement picks for a new session (``Registry.pipeline``), with link metrics. In a
        planned fleet (``replan``) a stage with no worker is waited for while the fleet re-plans, ``request``
        in status REPLAN_WAIT meanwhile (its stream gets ``: replanning`` comments: completions.Generation)."""
        try:
            if self.replan is not None and self.replan.holding:  # a worker joined: the plan is being replaced
                raise PipelineUnavailable("the fleet is re-planning")
            pipeline = await self.registry.pipeline()
        except PipelineUnavailable:
            if self.replan is None:
                raise
            before = request.status if request is not None else None
            if request is not None:
                request.status = RequestStatus.REPLAN_WAIT
            try:
                await self.replan.settle(self.settings.replan_wait_s)
            finally:
                if request is not None:
                    request.status = before
            pipeline = await self.registry.pipeline()
        if pipeline.observe_link is None:
            pipeline.observe_link = self.metrics.link.labels(pipeline.path).observe
        return pipeline

    async def _seat_on_retained(self, request: Request, slots: int, top_k: int, placed) -> Seq | None:
        """A ``Seq`` on a retained session's KV when ``request``'s prompt begins with one (prefix cache):
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
        except CopyRefused as exc:  # the entry is intact: only this prefix is not held (sliding-window layers)
            log.info("%s: %d cached tokens of %s cannot be copied (%s); prefilling the whole prompt",
                     request.request_id, hit.tokens, entry.session_id, exc)
            return None
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
        return self._seq(request, entry.pipeline, session, slots, top_k, hit.tokens, entry.draft if hit.take else None)

    async def _fail_over(self, seq: Seq, failure: StageFailure) -> None:
        """Move ``seq`` to healthy workers after ``failure`` (its loop freed its KV at the old stages):
        health-check the failed pipeline's workers now (a dead one is dropped with every pipeline using
        it), take the placement's pipeline of replicas, open a new session there and hand the request to
        that pipeline's loop, which prefills its visible tokens again, so the lost KV is rebuilt from the
        tokens the coordinator owns (Petals' replay, Borzunov et al. 2023 §3.2; a fresh session, never a
        possibly corrupted cache). Raises ``StageFailure`` when the attempts are used up, when no replica
        serves a lost stage, or when every worker still answers (the failure was not a lost worker)."""
        request, old = seq.request, seq.pipeline
        if request.failovers >= self.settings.failover_attempts:
            raise failure
        await self.registry.recheck(old.addresses)
        try:
            new = await self._placement(request)
        except PipelineUnavailable as exc:
            raise StageFailure(f"{failure.summary}; {exc.message}", detail=failure.detail, stage=failure.stage,
                               address=failure.address) from failure
        if new is old:
            raise failure
        request.failovers += 1
        self.metrics.failovers.inc()
        session = f"{request.request_id}-{request.failovers}"
        # the stages then hold the prompt and the output but its newest token, which the next step feeds;
        # without output yet, the prompt is prefilled again in full
        visible = request.prompt_ids + request.output_ids[:-1]
        # the summary, not the message: the request goes on there, nobody needs to send it again
        log.warning("%s: %s; failing over to %s, prefilling its %d visible tokens again (the request goes on)",
                    request.request_id, failure.summary, " -> ".join(new.addresses), len(visible))
        try:
            await self._open_session(new, session, seq.slots)
        except asyncio.CancelledError:
            self._close_in_background(new, session)
            raise
        seq.pipeline, seq.session, seq.prefill, seq.start = new, session, visible, 0
        seq.logits = not request.output_ids
        # drafts proposed for the step that failed stay valid: that step runs again there
        seq.decided, seq.group, seq.member = request.output_ids[-1:], None, None
        self._loop(new).submit(seq)

    async def _generate(self, request: Request) -> AsyncIterator[TextDelta]:
        s, params = self.settings, request.params
        # greedy without penalties needs only the best candidate (bit-identical to plain argmax)
        top_k = 1 if params.temperature <= 0 and not params.penalties.active else s.sample_top_k
        top_k = max(top_k, params.logprobs or 0)  # the API refuses more than sample_top_k
        # physical KV slots (make_request capped max_tokens to the context): rejected drafts keep
        # theirs (masked, never trimmed) until a compaction, hence the slack
        slots = len(request.prompt_ids) + params.max_tokens + (s.spec_slack if self.draft_source != "none" else 0)
        seq = await self._seat(request, slots, top_k)
        self._loop(seq.pipeline).submit(seq)
        try:
            while True:
                item = await self._next(seq)
                if isinstance(item, Moved):
                    await self._fail_over(seq, item.failure)
                    continue
                yield item  # a slow client blocks here; the loop goes on without waiting for it
                if item.finish_reason is not None:
                    return
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
            await self._end(seq)

    def _drafter(self, request: Request, draft, slots: int):
        """The draft model's session for ``request``: ``draft``, the retained one of the session it
        takes (prefix cache), when that fits, else a fresh one; None without a draft model or when the
        prompt does not fit the draft's context."""
        if self.draft_model is None:
            return None
        drafter = self.draft_model.reopen(draft, slots) if draft is not None else None
        if drafter is None:
            drafter = self.draft_model.open(request.request_id, slots)
        if len(request.prompt_ids) + self.settings.spec_k_max + 1 > drafter.kv.max_context:
            return None
        return drafter

    async def _end(self, seq: Seq) -> None:
        """However ``seq``'s request ended: count and log it, and have its loop keep its KV for a later
        prompt that begins with its tokens (a finished request, with the prefix cache on) or free it."""
        request = seq.request
        self.metrics.finished(request)
        log.info("%s: %s, prompt %d tokens (%d cached), completion %d tokens, TTFT %s ms, %.1f tok/s, drafts %d/%d "
                 "accepted in %d verify steps (draft %.1f ms, verify %.1f ms), %d compactions, %d failovers",
                 seq.session, request.finish_reason.value if request.finish_reason else request.status.value,
                 len(request.prompt_ids), request.cached_tokens, len(request.output_ids),
                 f"{request.ttft_ms:.0f}" if request.ttft_ms else "-", request.decode_tokens_per_s or 0.0,
                 request.accepted, request.drafted, request.verify_steps, request.draft_ms, request.verify_ms,
                 request.compactions, request.failovers)
        loop = self.loops.get(id(seq.pipeline))
        if loop is not None:
            # this runs even when a client's disconnect cancels this task: the loop frees or retains the
            # KV whatever happens here (a close then wakes requests waiting for KV room)
            retain = request.status is RequestStatus.FINISHED
            await asyncio.shield(loop.end(seq, retain))

    def _in_background(self, coro) -> asyncio.Task:
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

    def _close_in_background(self, pipeline, session: str) -> asyncio.Task:
        """Free ``session``'s KV on every stage of ``pipeline``, then wake requests waiting for room, in a
        task that a cancellation of the caller does not stop (close failures are logged, never raised)."""
        async def close() -> None:
            await pipeline.close_session(session, self.settings.rpc_timeout_s)
            self._kv_freed()

        return self._in_background(close())


