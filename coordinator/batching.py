"""Batch groups: sessions that decode in lock-step, one infer call per stage for all of them.

A stage's decode step is weight-bound on these PCs: at batch 2 one call costs 1.12-1.27x batch 1
and batch 4 1.4-1.8x (seq 1, contexts 128-1024, one thread, ``bench/batch_probe.py``), while copying
two sessions' KV into a batched request and back costs 8-51 ms, more than the step itself. So a
group's KV lives in *one* stateful request per stage with one row per session (``Merge`` RPC, once
when a session joins after its solo prefill), rows step together, and

* rows with shorter chunks (a plain step beside a K-token verify) are padded on the left with filler
  tokens whose slots are invisible from the start, so every row's real tokens end at the chunk's end;
* a session that leaves is dropped from the state by the next step's ``keep_rows`` (the ``beam_idx``
  Gather each KV read starts with), at no cost; the last one to leave closes the group;
* rejected drafts and fillers stay in the state, masked (design §5), until ``Compact`` repacks
  every row once their share is large;
* a step waits for every member's chunk; a member that has not sent one ``wait_s`` after the first
  came and is not drafting (its client reads slowly, say) sits that step out on a fully padded row,
  and the group stops waiting for it until it submits again. No session can stall the others.

Groups give interleaving too: the coordinator keeps ``groups`` of them (default: one per stage), so
while stage 1 runs group A's step, stage 0 runs group B's (the paper's two-stream interleave,
Berenbaum & Venkatachalam, arXiv 2608.19147 §5), and batching fills each step beyond one row.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fleet_common.cli import awaiting

from .errors import StageFailure
from .pipeline import Pipeline, StepOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Member:
    """One session's row in a group: ``visible`` tokens of it are in the KV state."""

    session_id: str
    slots: int  # physical KV slots the session needs on its own (prompt + completion + draft slack)
    visible: int  # tokens of the session in the state (its logical length)
    hide: list[int] = field(default_factory=list)  # slots of its row to hide from the next step on
    late: bool = False  # missed the last step: the group does not wait for it until it is back
    end: int = 0  # physical slot after its last chunk
    left: bool = False
    drafting: bool = False  # proposing its next chunk's drafts: work the group waits for
    owned: bool = False  # the group holds (or is merging) the session's KV and frees it, not the session


@dataclass
class _Submission:
    tokens: list[int]
    start_position: int
    logits_count: int
    top_k: int
    future: asyncio.Future


class BatchGroup:
    """Sessions stepping together as one KV state with one row per session on every stage.

    Members call ``join`` (after their solo prefill), then ``step`` once per decode step and ``reject``
    after verifying drafts, and ``leave`` however they end. A step runs when every member has
    submitted one. Errors: ``StageFailure`` (the group is then broken for every member).
    """

    def __init__(self, pipeline: Pipeline, slack: int, compact_share: float, compact_min_slots: int,
                 timeout_s, max_rows: int, wait_s: float,  # noqa: ANN001 - timeout_s: tokens -> seconds
                 on_freed: Callable[[], None] = lambda: None, context_limit: int = 1 << 30) -> None:
        self.pipeline = pipeline
        self.context_limit = context_limit  # the stages' KV slots per session: the group never asks for more
        self.on_freed = on_freed  # called whenever this group frees KV at the stages (a row dropped, a close)
        self.group_id = f"group-{uuid.uuid4().hex[:16]}"
        self.slack = slack  # extra slots so that the longest row plus the longest chunk always fit
        self.compact_share, self.compact_min_slots = compact_share, compact_min_slots
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.wait_s = wait_s
        self._timer: asyncio.TimerHandle | None = None
        self._waited = False  # the wait for the members' chunks ran out
        self.members: list[Member] = []  # active members
        self.rows: list[Member] = []  # the row order of the state at the stages (may hold departed ones)
        self.length = 0  # physical KV slots of the state at every stage
        self.max_context = 0
        self.compactions = 0
        self.steps = 0
        self.last_rows = 0  # members that took part in the last step
        self.broken: BaseException | None = None
        self._joining: list[tuple[Member, asyncio.Future]] = []
        self._detaching: list[tuple[Member, str, int, asyncio.Future]] = []  # rows to copy out before the next step
        self._merging: list[Member] = []  # joining members whose Merge is in flight (counted in load)
        self._pending: dict[Member, _Submission] = {}
        self._task: asyncio.Task | None = None

    @property
    def load(self) -> int:
        return len(self.members) + len(self._joining) + len(self._merging)

    @property
    def idle(self) -> bool:
        """Nothing left to free at the stages and no task running (a broken group closed its state)."""
        return self._task is None and (not self.rows or self.broken is not None)

    @property
    def open(self) -> bool:
        return self.broken is None and self.load < self.max_rows and self.pipeline.healthy

    async def join(self, member: Member) -> None:
        """Move ``member``'s prefilled solo session into the group (between steps). Raises
        ``StageFailure`` when a stage refuses the merge."""
        if self.broken is not None:
            raise self._failure()
        future = asyncio.get_running_loop().create_future()
        self._joining.append((member, future))
        self._kick()
        await self._wait(future, "the merge")

    async def step(self, member: Member, tokens: list[int], start_position: int, logits_count: int,
                   top_k: int) -> StepOutput:
        """Run ``tokens`` of ``member`` (logical positions from ``start_position``) in the group's next
        step; returns candidates for its last ``logits_count`` tokens."""
        if self.broken is not None:
            raise self._failure()
        future = asyncio.get_running_loop().create_future()
        self._pending[member] = _Submission(tokens, start_position, logits_count, top_k, future)
        self._kick()
        return await self._wait(future, "the step")

    async def detach(self, member: Member, session_id: str, tokens: int) -> int:
        """Copy ``member``'s first ``tokens`` visible tokens out of the group into a new session ``session_id`` on every
        stage (between steps: the ``Copy`` RPC, packed), then take it out of the group as ``leave``
        does: a finished request's KV is retained this way. Returns the tokens copied. Raises
        ``StageFailure`` or ``Overloaded`` (no room for the copy); the member has left either way."""
        if self.broken is not None:
            self.leave(member)
            raise self._failure()
        future = asyncio.get_running_loop().create_future()
        self._detaching.append((member, session_id, tokens, future))
        self._kick()
        try:
            return await self._wait(future, "the copy")
        finally:
            self.leave(member)

    def _failure(self) -> StageFailure:
        """What a member of the broken group is told: the stage failure that broke it, or (a bug) that a
        step failed unexpectedly."""
        if isinstance(self.broken, StageFailure):
            return self.broken.again()
        return StageFailure("a decode step failed unexpectedly (see the coordinator's log); send the request again",
                            detail=f"batch group {self.group_id}: {self.broken!r}")

    async def _wait(self, future: asyncio.Future, what: str):  # noqa: ANN202
        """``future``'s result, or ``StageFailure`` (logged with the group's state) if the group has not
        resolved it within a bound no healthy group reaches: every RPC the group makes has a deadline,
        so this catches a scheduling bug instead of leaving the request waiting forever."""
        bound = 3 * (self.timeout_s(self.max_rows * self.slack) + 2 * self.pipeline.link_rtt_s()) + self.wait_s
        try:
            async with asyncio.timeout(bound):  # one timer; wait_for added a future and callbacks per step
                return await future
        except TimeoutError:
            log.error("%s: %s not resolved in %.0f s: %s", self.group_id, what, bound, self._state())
            raise StageFailure(f"batch group {self.group_id} did not run {what} in {bound:.0f} s") from None

    def _state(self) -> str:
        task = "idle" if self._task is None else " <- ".join(awaiting(self._task.get_coro()))
        return (f"{len(self.members)} members ({sum(m.late for m in self.members)} late, "
                f"{sum(m.drafting for m in self.members)} drafting), {len(self._pending)} pending, "
                f"{len(self._joining)} joining, {len(self._merging)} merging, rows {len(self.rows)}, "
                f"timer {'set' if self._timer else 'none'}, waited {self._waited}, broken {self.broken!r}, task {task}")

    def reject(self, member: Member, count: int) -> None:
        """Hide the last ``count`` tokens ``member`` sent in the step that just ran (rejected drafts)."""
        member.visible -= count
        member.hide.extend(range(member.end - count, member.end))

    def leave(self, member: Member) -> None:
        """Take ``member`` out; its row is dropped by the next step, or the group closes if it was last."""
        member.left = True
        self._joining = [(m, f) for m, f in self._joining if m is not member]
        if member in self.members:
            self.members.remove(member)
        self._pending.pop(member, None)
        self._kick()

    # -- the group's one worker task --------------------------------------------------------------
    def _ready(self) -> bool:
        if self._joining or self._detaching:
            return True
        if not self.members:
            return bool(self.rows)  # close the state at the stages
        if not self._pending:
            return False
        missing = [m for m in self.members if m not in self._pending and not m.late]
        # past the wait, go without members that are not drafting (stuck handing text to a client
        # that reads slowly, say); one that is drafting is work the group waits for
        return not missing or (self._waited and not any(m.drafting for m in missing))

    def _expire(self) -> None:
        self._timer, self._waited = None, True
        self._kick()

    def _kick(self) -> None:
        if self._task is not None or self.broken is not None:
            return
        if self._ready():
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waited = None, False
            self._task = asyncio.create_task(self._run(), name=self.group_id)
        elif self._pending and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire)

    async def _run(self) -> None:
        try:
            if self._detaching:
                await self._copy_out()
            elif self._joining:
                await self._merge()
            elif not self.members:
                await self._close()
            else:
                await self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiter learns of it
            self.broken = exc if not isinstance(exc, asyncio.CancelledError) else StageFailure("group cancelled")
            waiting = [f for _, f in self._joining] + [sub.future for sub in self._pending.values()]
            for future in waiting + [f for *_, f in self._detaching]:
                if not future.done():
                    future.set_exception(self._failure())
            self._joining, self._pending, self._detaching = [], {}, []
            if not isinstance(exc, (StageFailure, asyncio.CancelledError)):
                log.exception("%s failed", self.group_id)
            await self._close_session(self.group_id, 5.0)
        finally:
            self._task = None
            self._kick()

    async def _merge(self) -> None:
        joining, self._joining = self._joining, []
        new = [m for m, _ in joining]
        for m in new:  # from here a member that leaves must not close its session: the merge is using it
            m.owned = True
        self._merging = new
        try:
            await self._merge_rows(joining, new)
        finally:
            self._merging = []

    async def _merge_rows(self, joining: list[tuple[Member, asyncio.Future]], new: list[Member]) -> None:
        need = max([m.slots for m in new] + [m.slots for m in self.members]) + self.slack
        max_context = min(max(self.max_context, need), self.context_limit)
        sources = ([self.group_id] if self.rows else []) + [m.session_id for m in new]
        try:
            length = await self.pipeline.merge(self.group_id, sources, max_context, self.timeout_s(0))
        except BaseException as exc:
            for m in new:
                m.owned = False
            for _, future in joining:
                if not future.done():
                    future.set_exception(exc)
            for m in new:  # left during the merge: no request is left to free its session's KV
                if m.left:
                    await self._close_session(m.session_id, self.timeout_s(0))
            if self.rows:  # the group's state is unknown now
                raise
            # stages where the rename went through hold the session under the group's id
            await self._close_session(self.group_id, self.timeout_s(0))
            return
        self.rows += new  # a member that left during the merge keeps a row until the next step drops it
        self.members += [m for m in new if not m.left]
        self.length, self.max_context = length, max_context
        for _, future in joining:
            if not future.done():
                future.set_result(None)

    async def _copy_out(self) -> None:
        """Run the queued detaches, one ``Copy`` per member (a failed copy fails that member's detach
        only: the group's state is untouched by a copy)."""
        detaching, self._detaching = self._detaching, []
        for member, session_id, tokens, future in detaching:
            if member not in self.rows:
                future.set_exception(StageFailure(f"{member.session_id} has no row in {self.group_id}"))
                continue
            try:
                await self.pipeline.copy(session_id, self.group_id, self.rows.index(member), tokens, tokens,
                                         self.timeout_s(tokens), detach=True)
            except Exception as exc:  # noqa: BLE001 - the member learns of it
                if not future.done():
                    future.set_exception(exc)
                continue
            if not future.done():
                future.set_result(tokens)
            else:  # its request gave up waiting: nobody will retain the copy
                await self._close_session(session_id, self.timeout_s(0))

    async def _close(self) -> None:
        self.rows, self.length, self.max_context = [], 0, 0
        await self._close_session(self.group_id, self.timeout_s(0))

    async def _close_session(self, session_id: str, timeout_s: float) -> None:
        """Close ``session_id`` on every stage (shielded from the caller's cancellation), then tell
        ``on_freed``: requests waiting for KV room retry."""
        await asyncio.shield(self.pipeline.close_session(session_id, timeout_s))
        self.on_freed()

    async def _compact(self) -> None:
        for r, m in enumerate(self.rows):  # departed rows are emptied: the next step drops them
            if m not in self.members:
                m.hide = list(range(self.length))
        hide_rows, hide_slots = _hides(self.rows)
        self.length = await self.pipeline.compact(self.group_id, self.length, hide_slots, self.timeout_s(0),
                                                  hide_rows=hide_rows)
        for m in self.rows:
            m.hide = []
        self.compactions += 1

    async def _step(self) -> None:
        members = list(self.members)
        subs = [self._pending.pop(m, None) for m in members]  # None: late, sits this step out
        if all(s is None for s in subs):  # whoever submitted left between the kick and this task's start
            return
        try:
            await self._step_rows(members, subs)
        except BaseException as exc:
            # the submissions are out of _pending now, so _run's handler cannot reach them: whatever
            # failed (the compaction before the step, the step, reading its result), fail them here
            for s in subs:
                if s is not None and not s.future.done():
                    s.future.set_exception(exc.again() if isinstance(exc, StageFailure) else StageFailure(
                        "a decode step failed unexpectedly (see the coordinator's log); send the request again",
                        detail=f"batch group {self.group_id}: {exc!r}"))
            raise

    async def _step_rows(self, members: list[Member], subs: list[_Submission | None]) -> None:
        seq = max(len(s.tokens) for s in subs if s is not None)
        reclaim = self.length - max(m.visible for m in members)
        if self.length + seq > self.max_context or (
                reclaim > 0 and reclaim >= max(self.compact_min_slots, self.compact_share * self.length)):
            await self._compact()
        keep = [self.rows.index(m) for m in members] if self.rows != members else []
        hide_rows, hide_slots = _hides(members)
        filler = next(s.tokens[0] for s in subs if s is not None)
        pads = [seq - len(s.tokens) if s is not None else seq for s in subs]
        tokens = np.array([[filler] * pad + (s.tokens if s is not None else []) for s, pad in zip(subs, pads)],
                          dtype=np.int64)
        starts = [s.start_position if s is not None else m.visible for m, s in zip(members, subs)]
        count = max(s.logits_count for s in subs if s is not None)
        top_k = max(s.top_k for s in subs if s is not None)
        out = await self.pipeline.step(
            self.group_id, tokens, self.length, starts, count, top_k, self.timeout_s(seq * len(subs)),
            hide_slots=hide_slots, hide_rows=hide_rows, pads=pads, keep_rows=keep)
        dropped = len(self.rows) > len(members)
        self.rows = members
        self.length += seq
        if dropped:  # the stages freed the departed rows' KV
            self.on_freed()
        self.steps += 1
        self.last_rows = sum(s is not None for s in subs)
        ids = out.top_ids.reshape(len(members), count, -1)
        logprobs = out.top_logprobs.reshape(len(members), count, -1)
        for r, (m, s) in enumerate(zip(members, subs)):
            m.hide = []
            m.late = s is None
            if s is None:
                continue
            m.visible += len(s.tokens)
            m.end = self.length
            n = s.logits_count
            if not s.future.done():
                s.future.set_result(StepOutput(ids[r, count - n:], logprobs[r, count - n:]))


def _hides(rows: list[Member]) -> tuple[list[int], list[int]]:
    """(row index, slot) pairs of every row's pending hides, as the two parallel lists the RPCs take."""
    return [r for r, m in enumerate(rows) for _ in m.hide], [s for m in rows for s in m.hide]


class Batcher:
    """Places sessions into batch groups: up to ``groups`` groups per pipeline (more only when all are
    full), each of at most ``max_rows`` sessions, a new session joining the least-loaded open group."""

    def __init__(self, groups: int, max_rows: int, slack: int, compact_share: float, compact_min_slots: int,
                 timeout_s, wait_s: float, on_freed: Callable[[], None] = lambda: None,  # noqa: ANN001
                 context_limit: int = 1 << 30) -> None:
        self.target_groups = groups
        self._new_group = functools.partial(BatchGroup, slack=slack, compact_share=compact_share,
                                            compact_min_slots=compact_min_slots, timeout_s=timeout_s,
                                            max_rows=max_rows, wait_s=wait_s, on_freed=on_freed,
                                            context_limit=context_limit)
        self.groups: list[BatchGroup] = []

    def assign(self, pipeline: Pipeline) -> BatchGroup:
        """The group a new session of ``pipeline`` should join (each pipeline, i.e. each set of
        replicas, has its own groups)."""
        self.groups = [g for g in self.groups if g.broken is None and g.pipeline.healthy
                       and (g.load or g.rows or g._task is not None)]
        mine = [g for g in self.groups if g.pipeline is pipeline]
        open_groups = [g for g in mine if g.open]
        if len(mine) < self.target_groups or not open_groups:
            group = self._new_group(pipeline)
            self.groups.append(group)
            return group
        return min(open_groups, key=lambda g: g.load)
