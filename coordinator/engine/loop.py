"""One step loop per pipeline: schedule -> execute -> update, the shape of vLLM's v1 engine core.

Requests are passive state (``scheduler.Seq``) fed through the loop's event queue. Each turn the
loop applies what happened (a request came or ended, an action finished), asks the pure scheduler
(``scheduler.py``) what to start, and starts it: the pipeline's RPCs (``pipeline.py``) and the draft
model's thread are this module's only I/O. Several actions run at once (a prefill chunk beside
another group's step: that is the pipeline's interleave), but each group has at most one, and each
request at most one on the stages (its draft model's prefill may run beside its stages' prefill). Step results go through the request's output processor (``output.py``), whose deltas go
to the request's ``outbox``, which the engine (``engine.py``) hands to the API. The loop never
waits for a client: a slow reader's deltas queue up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .constraint import GrammarError
from ..errors import StageFailure
from .group import BatchGroup, Member
from .prefix_cache import PrefixCache, Retained, new_session_id
from .request import RequestStatus
from .sampling import SparseDist
from .scheduler import (
    Action,
    CloseGroup,
    Compact,
    CopyOut,
    DraftPrefill,
    Merge,
    Phase,
    Prefill,
    Propose,
    Scheduler,
    Seq,
    Step,
)
from .speculative import StepCostsByLoad, ngram_draft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Moved:
    """Sent to a request's outbox when a stage failed under it: the engine moves it to replicas."""

    failure: StageFailure


@dataclass
class LoopContext:
    """What every loop shares: the timeout for a step of ``tokens`` tokens (seconds), metrics, the
    fleet's step costs, the draft model (None: none; ``draft_source`` "ngram": prompt lookup), the
    prefix cache (None: off), and ``on_freed``, called whenever KV is freed at the stages (requests
    waiting for room retry)."""

    timeout_s: Callable[[int], float]
    metrics: object  # CoordinatorMetrics
    step_costs: StepCostsByLoad
    draft_model: object  # DraftModel | None
    draft_source: str
    prefix_cache: PrefixCache | None
    on_freed: Callable[[], None]
    rpc_timeout_s: float


def _unexpected(exc: BaseException, where: str) -> StageFailure:
    return StageFailure("a decode step failed unexpectedly (see the coordinator's log); send the request again",
                        detail=f"{where}: {exc!r}")


class StepLoop:
    """The step loop of one ``pipeline``: ``submit`` a request's ``Seq``, read its ``outbox``, ``end``
    it however it ends (its KV is then retained or freed)."""

    def __init__(self, pipeline, scheduler: Scheduler, ctx: LoopContext) -> None:
        self.pipeline, self.scheduler, self.ctx = pipeline, scheduler, ctx
        self.seqs: list[Seq] = []
        self.groups: list[BatchGroup] = []
        self._events: asyncio.Queue = asyncio.Queue()
        self._ending: dict[Seq, tuple[bool, asyncio.Future]] = {}  # ends waiting for a running prefill
        self._background: set[asyncio.Task] = set()
        self._copies: dict[Member, tuple] = {}  # rows being copied out: (seq, entry, context, held, done)
        self._decode_seconds = ctx.metrics.step.labels("decode")  # labels() costs ~10 us a step
        self._prefill_seconds = ctx.metrics.step.labels("prefill")
        self._task = asyncio.create_task(self._run(), name=f"loop-{'->'.join(pipeline.addresses)}")

    # -- what the engine calls ---------------------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        """Start ``seq``: its session is open on every stage of this pipeline."""
        self._events.put_nowait((self._submitted, seq))

    def end(self, seq: Seq, retain: bool) -> asyncio.Future:
        """``seq`` ended (finished, failed, cancelled): keep its KV for the prefix cache (``retain``) or
        free it; the future resolves once that is done."""
        done = asyncio.get_running_loop().create_future()
        self._events.put_nowait((self._ended, seq, retain, done))
        return done

    @property
    def idle(self) -> bool:
        """No request and no group state left at the stages."""
        return not self.seqs and not self._background and all(g.idle for g in self.groups)

    def close(self) -> None:
        """Stop the loop (the coordinator is stopping)."""
        self._task.cancel()

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        events = self._events
        while True:
            handler, *args = await events.get()
            self._apply(handler, args)
            while not events.empty():
                handler, *args = events.get_nowait()
                self._apply(handler, args)
            self._apply(self._schedule, [])

    def _schedule(self) -> None:
        for action in self.scheduler.schedule(self.pipeline, self.seqs, self.groups):
            self._spawn(self._execute(action))

    def _apply(self, handler, args: list) -> None:
        try:
            handler(*args)
        except Exception as exc:  # a bug: fail what this loop runs rather than hang it
            log.exception("step loop of %s: %s failed", self.pipeline.path, handler.__name__)
            for group in list(self.groups):
                if group.broken is None:
                    self._break(group, _unexpected(exc, handler.__name__))
            for seq in list(self.seqs):
                self._fail(seq, _unexpected(exc, handler.__name__))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _execute(self, action: Action) -> None:
        """Run ``action``'s I/O; its outcome (a result or the exception) goes back through the queue."""
        t0 = time.perf_counter()
        try:
            result = await self._io(action)
        except Exception as exc:  # noqa: BLE001 - the update decides what it means
            result = exc
        self._events.put_nowait((self._finished, action, result, time.perf_counter() - t0))

    async def _io(self, action: Action):
        pipeline, timeout_s = self.pipeline, self.ctx.timeout_s
        match action:
            case Prefill(seq, tokens, position, logits, token_mask):
                return await pipeline.step(seq.session, tokens, position, position, logits, seq.top_k,
                                           timeout_s(len(tokens)), token_mask=token_mask)
            case Step(group, _, plan):
                return await pipeline.step(group.group_id, plan.tokens, plan.past_length, plan.starts, plan.logits,
                                           plan.top_k, timeout_s(plan.tokens.size), hide_slots=plan.hide_slots,
                                           hide_rows=plan.hide_rows, pads=plan.pads, keep_rows=plan.keep_rows,
                                           token_mask=plan.token_mask)
            case Merge(group, plan):
                return await pipeline.merge(group.group_id, plan.sources, plan.max_context, timeout_s(0))
            case Compact(group, hide_rows, hide_slots):
                return await pipeline.compact(group.group_id, group.length, hide_slots, timeout_s(0),
                                              hide_rows=hide_rows)
            case CopyOut(group, detaching):
                results = []
                for member, session_id, tokens in detaching:  # a failed copy fails that retention only
                    try:
                        await pipeline.copy(session_id, group.group_id, group.rows.index(member), tokens, tokens,
                                            timeout_s(tokens), detach=True)
                        results.append(None)
                    except Exception as exc:  # noqa: BLE001
                        results.append(exc)
                return results
            case CloseGroup(group):
                return await asyncio.shield(pipeline.close_session(group.group_id, timeout_s(0)))
            case DraftPrefill(seq):
                return await self.ctx.draft_model.run(seq.drafter.prefill, seq.request.prompt_ids)
            case Propose(seq):
                request, params = seq.request, seq.request.params
                return await self.ctx.draft_model.run(seq.drafter.propose, request.prompt_ids + request.output_ids,
                                                      seq.k, params.temperature, params.top_p, seq.output.draft_rng_at,
                                                      request.grammar)
        raise TypeError(f"unknown action {action!r}")

    def _finished(self, action: Action, result, seconds: float) -> None:
        seq = getattr(action, "seq", None)
        if seq is not None and seq.owner is not self and not isinstance(action, DraftPrefill):
            return  # it moved to another pipeline's loop meanwhile: this outcome is stale
        match action:
            case Prefill():
                self._prefilled(action, result, seconds)
            case Step():
                self._stepped(action, result, seconds)
            case Merge(group, plan):
                self._merged(group, plan, result)
            case Compact(group):
                group.busy = False
                if isinstance(result, Exception):
                    self._break(group, result)
                else:
                    group.compact_done(result)
            case CopyOut(group, detaching):
                group.busy = False
                if isinstance(result, Exception):
                    self._break(group, result)
                    result = [result] * len(detaching)
                for (member, _, _), outcome in zip(detaching, result):
                    self._copied(member, outcome)
            case CloseGroup(group):
                group.busy = False
                group.closed()
                self.ctx.on_freed()
            case DraftPrefill(seq):
                if isinstance(result, Exception):
                    log.warning("%s: the draft model's prefill failed (%s); decoding without drafts",
                                seq.request.request_id, result)
                    seq.draft_prefill, seq.output.drafting = "failed", False
                    if seq.draft is None and seq.phase is Phase.DECODE:
                        self._set_draft(seq, [], [])
                else:
                    seq.draft_prefill = "done"
            case Propose(seq):
                seq.busy = False
                if isinstance(result, Exception):
                    self._fail(seq, result)
                elif seq.phase is Phase.DECODE:
                    self._set_draft(seq, *result, draft_ms=seconds * 1000)

    # -- updates -----------------------------------------------------------------------------------
    def _submitted(self, seq: Seq) -> None:
        self.seqs.append(seq)
        seq.owner = self
        seq.phase, seq.done, seq.busy = Phase.PREFILL, 0, False
        if seq.logits:
            seq.request.status = RequestStatus.PREFILL
        if seq.drafter is not None and seq.draft_prefill == "" and seq.output.policy.would_draft():
            # the draft prefills beside the stages only if drafting pays on this fleet's measured
            # costs: else it would take CPU from stages that share its cores for tokens never
            # drafted; it prefills when K first becomes > 0 (a probe, or the costs changed)
            seq.draft_prefill = "wanted"

    def _prefilled(self, action: Prefill, result, seconds: float) -> None:
        seq = action.seq
        seq.busy = False
        if seq in self._ending:
            return self._ended(seq, *self._ending.pop(seq))
        if seq.phase is not Phase.PREFILL:
            return None
        if isinstance(result, Exception):
            return self._moved_or_failed(seq, result)
        self._prefill_seconds.observe(seconds)
        seq.done += len(action.tokens)
        if seq.logits:
            seq.request.prefilled = seq.start + seq.done
        if seq.done < len(seq.prefill):
            return None
        seq.logical = seq.start + len(seq.prefill)
        seq.phase = Phase.PREFILLED
        if seq.logits:
            seq.request.status = RequestStatus.DECODE
            seq.decided = seq.output.first(result)
            self._deliver(seq, seq.decided)
        return None

    def _merged(self, group: BatchGroup, plan, result) -> None:
        group.busy = False
        seqs = {s.member: s for s in self.seqs if s.group is group}
        if not isinstance(result, Exception):
            group.merge_done(plan, result)
            for member in plan.new:
                seq = seqs.get(member)
                if seq is None or member.left:  # it ended during the merge: the next step drops its row
                    self.pipeline.forget(member.session_id)
                    continue
                seq.phase, seq.joined_compactions = Phase.DECODE, group.compactions
                if seq.draft is None:  # else a failover kept the drafts of the step that failed
                    self._next_chunk(seq)
            return
        lost = group.merge_failed()
        for member in plan.new:
            seq = seqs.get(member)
            if seq is None or member.left:  # no request is left to free its session's KV
                self._close(member.session_id)
            else:
                seq.group = seq.member = None
                self._moved_or_failed(seq, result)
        if lost:
            self._break(group, result)
        else:  # stages where the rename went through hold the session under the group's id
            self._close(group.group_id)

    def _stepped(self, action: Step, result, seconds: float) -> None:
        group = action.group
        group.busy = False
        if isinstance(result, Exception):
            return self._break(group, result)
        outs, dropped = group.step_done(action.plan, result)
        if dropped:  # the stages freed the departed rows' KV
            self.ctx.on_freed()
        self._decode_seconds.observe(seconds)
        costs = self.ctx.step_costs
        for seq, out in zip(action.seqs, outs):
            if seq.phase is not Phase.DECODE:  # it ended while the step ran
                continue
            request, draft = seq.request, seq.draft
            request.batch_max = max(request.batch_max, group.last_rows)
            request.compactions += group.compactions - seq.joined_compactions
            seq.joined_compactions = group.compactions
            costs.observe(len(draft) + 1, seconds)
            if draft:
                decided = seq.output.verify(out, draft, seq.qs, seq.logical, seq.draft_ms, seconds * 1000, seq.forced)
                if seq.forced:  # the grammar's tokens: no draft cost to learn
                    pass
                elif seq.drafter is None:
                    costs.observe_draft(len(draft), seq.draft_ms / 1000)
                elif seq.drafter.seconds_per_token is not None:
                    costs.observe_draft(1, seq.drafter.seconds_per_token)
                group.reject(seq.member, len(draft) + 1 - len(decided))  # hidden from the next step on
            else:
                decided = seq.output.decide(out, seq.logical)
            seq.logical += len(decided)  # the fed token and the accepted drafts
            seq.decided, seq.draft = decided, None
            if self._deliver(seq, decided):
                self._next_chunk(seq)
        return None

    def _deliver(self, seq: Seq, decided: list[int]) -> bool:
        """Hand ``decided`` to the output processor and its delta to the client; whether it goes on. A
        finished request leaves at once (its KV retained or freed), whenever its client reads the end."""
        delta = seq.output.take(decided)
        if delta is not None:
            seq.outbox.put_nowait(delta)
        if not seq.output.finished:
            return True
        seq.released = asyncio.get_running_loop().create_future()
        self._ended(seq, True, seq.released)
        return False

    def _next_chunk(self, seq: Seq) -> None:
        """Decide the next step's drafts: none, by prompt lookup at once, or by the draft model (the
        scheduler starts its proposal)."""
        seq.k = k = seq.output.next_k()
        if forced := seq.output.forced_draft():
            self._set_draft(seq, forced, [SparseDist.point(t) for t in forced], forced=True)
        elif k and self.ctx.draft_model is not None and seq.drafter is not None:
            seq.draft = None  # the scheduler starts the draft's prefill, then the proposal
        elif k and self.ctx.draft_source == "ngram":
            t0 = time.perf_counter()
            draft = ngram_draft(seq.request.prompt_ids + seq.request.output_ids, k)
            self._set_draft(seq, draft, [SparseDist.point(t) for t in draft],
                            draft_ms=(time.perf_counter() - t0) * 1000)
        else:
            self._set_draft(seq, [], [])

    def _set_draft(self, seq: Seq, draft: list[int], qs: list[SparseDist], draft_ms: float = 0.0,
                   forced: bool = False) -> None:
        """The next step's drafts (drawn from ``qs``); under a grammar, with its masks, cut before the first
        draft the grammar refuses (prompt lookup's; the draft model's are drawn under the masks). A grammar
        that allows nothing more fails its request alone."""
        if (grammar := seq.request.grammar) is not None:
            try:
                allowed, seq.masks = grammar.masks(draft)
            except GrammarError as exc:
                self._fail(seq, exc)
                return
            draft, qs = draft[:allowed], qs[:allowed]
        seq.draft, seq.qs, seq.draft_ms, seq.forced = draft, qs, draft_ms, forced

    # -- ends, failures, retention -----------------------------------------------------------------
    def _ended(self, seq: Seq, retain: bool, done: asyncio.Future) -> None:
        if seq not in self.seqs:  # finished, moved or failed already
            if seq.released is not None and not seq.released.done():  # its KV is being retained
                seq.released.add_done_callback(lambda _: done.done() or done.set_result(None))
            elif not done.done():
                done.set_result(None)
            return
        if seq.busy and seq.phase is Phase.PREFILL:  # its session is in use: end it once the chunk is back
            self._ending[seq] = (retain, done)
            return
        self.seqs.remove(seq)
        phase, seq.phase = seq.phase, Phase.ENDED
        group, member = seq.group, seq.member
        retain = retain and self.ctx.prefix_cache is not None
        if phase is Phase.DECODE and group is not None and group.broken is None:
            if retain:
                return self._retain_row(seq, done)
            group.leave(member)  # the group frees its row
            self.pipeline.forget(seq.session)
            done.set_result(None)
            return None
        solo = group is None or group.leave(member)  # not merged yet: the solo session is still its own
        if not solo:  # merging (its row is dropped after the merge) or in a broken group (closed)
            self.pipeline.forget(seq.session)
            done.set_result(None)
        elif retain and phase is Phase.PREFILLED:
            self._spawn(self._retain_solo(seq, done))
        else:
            self._close(seq.session, done)
        return None

    def _moved_or_failed(self, seq: Seq, exc: BaseException) -> None:
        if isinstance(exc, StageFailure):
            self._move(seq, exc)
        else:
            self._fail(seq, exc)

    def _move(self, seq: Seq, failure: StageFailure) -> None:
        """A stage failed under ``seq``: it leaves this loop (its KV here is freed) and its engine moves it."""
        self._drop(seq)
        seq.outbox.put_nowait(Moved(failure))

    def _fail(self, seq: Seq, exc: BaseException) -> None:
        self._drop(seq)
        seq.outbox.put_nowait(exc)

    def _drop(self, seq: Seq) -> None:
        if seq not in self.seqs:
            return
        self.seqs.remove(seq)
        seq.owner = None
        if seq.group is not None:
            if seq.group.leave(seq.member) or seq.group.broken is not None:
                self._close(seq.session)
            else:
                self.pipeline.forget(seq.session)
        else:
            self._close(seq.session)
        seq.group = seq.member = None
        if seq in self._ending:
            self._ending.pop(seq)[1].set_result(None)

    def _break(self, group: BatchGroup, exc: BaseException) -> None:
        """``group`` failed: its state is closed and every member moves (a stage failure) or fails."""
        group.broken = exc
        for seq in [s for s in self.seqs if s.group is group]:
            failure = exc.again() if isinstance(exc, StageFailure) else _unexpected(exc, group.group_id)
            self._move(seq, failure)
        for member, _, _ in group.detaching:
            self._copied(member, exc)
        group.detaching, group.joining = [], []
        if not isinstance(exc, StageFailure):
            log.error("%s failed: %r", group.group_id, exc)
        self._close(group.group_id, timeout_s=5.0)
        group.closed()

    def _close(self, session_id: str, done: asyncio.Future | None = None, timeout_s: float | None = None) -> None:
        """Free ``session_id`` on every stage in the background (failures are logged, never raised)."""
        async def close() -> None:
            await self.pipeline.close_session(session_id, self.ctx.timeout_s(0) if timeout_s is None else timeout_s)
            self.ctx.on_freed()
            if done is not None and not done.done():
                done.set_result(None)
        self._spawn(close())

    def _retain_row(self, seq: Seq, done: asyncio.Future) -> None:
        """Keep a finished request's KV: its row copied out of its group into a retained session."""
        request = seq.request
        # the tokens fed: the prompt, then the output but its newest token (decided, never fed); past the
        # output only drafts accepted after a stop (an end-of-sequence, a stop string) that no list holds
        context = request.prompt_ids + request.output_ids
        held = min(seq.member.visible, len(context))
        entry = self._new_entry(seq, new_session_id(), context[:held])
        if entry is None:
            seq.group.leave(seq.member)
            self.pipeline.forget(seq.session)
            done.set_result(None)
            return
        seq.group.detach(seq.member, entry.session_id, held)
        self._copies[seq.member] = (seq, entry, context, held, done)

    def _copied(self, member: Member, outcome) -> None:
        seq, entry, context, held, done = self._copies.pop(member)
        self.pipeline.forget(seq.session)
        if outcome is not None:
            self._not_retained(seq, entry, outcome, done)
        else:
            self._spawn(self._retain_draft(seq, entry, context, held, done))

    def _new_entry(self, seq: Seq, session_id: str, tokens: list[int]) -> Retained | None:
        # matchable at once (the client's next request may come before the copy is made: it waits for it)
        entry = Retained(session_id, self.pipeline, tokens, scope=seq.request.cache_scope, copying=1,
                         ready=asyncio.get_running_loop().create_future())
        return entry if self.ctx.prefix_cache.retain(entry) else None

    async def _retain_solo(self, seq: Seq, done: asyncio.Future) -> None:
        """Keep a request that finished after its prefill: its solo session, shrunk to its prompt."""
        request = seq.request
        held = len(request.prompt_ids)
        entry = self._new_entry(seq, seq.session, (request.prompt_ids + request.output_ids)[:held])
        if entry is None:
            return self._close(seq.session, done)
        try:
            await self.pipeline.open_session(seq.session, held, self.ctx.rpc_timeout_s, resume=True)
        except Exception as exc:  # noqa: BLE001 - retention is best effort
            self._not_retained(seq, entry, exc, done)
            return self._close(seq.session)
        await self._retain_draft(seq, entry, request.prompt_ids + request.output_ids, held, done)
        return None

    def _not_retained(self, seq: Seq, entry: Retained, exc: BaseException, done: asyncio.Future) -> None:
        log.warning("%s: its KV is not retained (%s)", seq.session, exc)
        self.ctx.prefix_cache.forget(entry)
        self.ctx.prefix_cache.done_copying(entry)
        entry.ready.set_result(False)
        done.set_result(None)

    async def _retain_draft(self, seq: Seq, entry: Retained, context: list[int], held: int,
                            done: asyncio.Future) -> None:
        """The draft model's session of the same tokens kept with the entry; then the entry is ready."""
        if seq.drafter is not None and seq.draft_prefill == "done":
            try:
                await self.ctx.draft_model.run(seq.drafter.retain, context, held)
                entry.draft = seq.drafter
            except Exception as exc:  # noqa: BLE001 - the stages' KV is retained without the draft's
                log.warning("%s: the draft model's KV is not retained (%s)", seq.session, exc)
        self.pipeline.forget(entry.session_id)  # held KV, not a running request: placement counts only those
        entry.ready.set_result(True)
        self.ctx.prefix_cache.done_copying(entry)
        done.set_result(None)
