"""Batch groups: sessions that decode in lock-step, one infer call per stage for all of them.

A stage's decode step is weight-bound on these PCs: at batch 2 one call costs 1.12-1.27x batch 1
and batch 4 1.4-1.8x (seq 1, contexts 128-1024, one thread, ``bench/pipeline/batch_probe.py``), while copying
two sessions' KV into a batched request and back costs 8-51 ms, more than the step itself. So a
group's KV lives in *one* stateful request per stage with one row per session (``Merge`` RPC, once
when a session joins after its solo prefill), rows step together, and

* rows with shorter chunks (a plain step beside a K-token verify) are padded on the left with filler
  tokens whose slots are invisible from the start, so every row's real tokens end at the chunk's end;
* a session that leaves is dropped from the state by the next step's ``keep_rows`` (the ``beam_idx``
  Gather each KV read starts with), at no cost; the last one to leave closes the group;
* rejected drafts and fillers stay in the state, masked (mask-based rejection, docs/design-worker.md), until
  ``Compact`` repacks every row once their share is large.

This module is the groups' bookkeeping only, with no I/O: the scheduler (``scheduler.py``) decides
what a group does next, the step loop (``loop.py``) runs it on the pipeline and hands the outcome
back to the ``*_done`` methods here. Groups give interleaving too: a pipeline keeps several (default:
one per stage), so while stage 1 runs group A's step, stage 0 runs group B's (the two-stream
interleave, Berenbaum & Venkatachalam, arXiv 2608.19147 §5).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

from .pipeline import StepOutput


@dataclass(eq=False)
class Member:
    """One session's row in a group: ``visible`` tokens of it are in the KV state."""

    session_id: str
    slots: int  # physical KV slots the session needs on its own (prompt + completion + draft slack)
    visible: int  # tokens of the session in the state (its logical length)
    hide: list[int] = field(default_factory=list)  # slots of its row to hide from the next step on
    end: int = 0  # physical slot after its last chunk
    left: bool = False


@dataclass
class Chunk:
    """What one member feeds in a step: ``tokens`` from logical position ``start``, candidates
    wanted for its last ``logits`` tokens, ``top_k`` of them."""

    tokens: list[int]
    start: int
    logits: int
    top_k: int
    masks: np.ndarray | None = None  # [logits, ceil(V / 32)] int32: its grammar's allowed tokens (constraint.py)


@dataclass
class StepPlan:
    """One batched step as the pipeline's ``step`` takes it (``tokens``: [rows, seq] int64, left-padded)."""

    members: list[Member]
    chunks: list[Chunk]
    tokens: np.ndarray
    past_length: int
    starts: list[int]
    logits: int
    top_k: int
    pads: list[int]
    keep_rows: list[int]
    hide_rows: list[int]
    hide_slots: list[int]
    token_mask: np.ndarray | None = None  # [rows * logits, ceil(V / 32)] int32 when a member has a grammar


@dataclass
class MergePlan:
    """A merge of ``new`` members' solo sessions (and the group's own state, if any) into the group."""

    new: list[Member]
    sources: list[str]
    max_context: int


class BatchGroup:
    """Sessions stepping together as one KV state with one row per session on every stage.

    ``members`` step; ``rows`` is the row order of the state at the stages (it may still hold members
    that left, until the next step drops them); ``joining`` wait for a merge; ``detaching`` for a copy
    of their row into a session of its own (a finished request's KV retained, prefix cache).
    ``busy``: an action of the group is running (the scheduler starts one at a time).
    """

    def __init__(self, pipeline, slack: int, max_rows: int, compact_share: float,
                 compact_min_slots: int, context_limit: int = 1 << 30) -> None:
        self.pipeline = pipeline
        self.group_id = f"group-{uuid.uuid4().hex[:16]}"
        self.slack = slack  # extra slots so that the longest row plus the longest chunk always fit
        self.max_rows = max_rows
        self.compact_share, self.compact_min_slots = compact_share, compact_min_slots
        self.context_limit = context_limit  # the stages' KV slots per session: the group never asks for more
        self.members: list[Member] = []
        self.rows: list[Member] = []
        self.joining: list[Member] = []
        self.merging: list[Member] = []  # joining members whose Merge is running (counted in load)
        self.detaching: list[tuple[Member, str, int]] = []  # (member, new session id, tokens to copy)
        self.length = 0  # physical KV slots of the state at every stage
        self.max_context = 0
        self.compactions = 0
        self.steps = 0
        self.last_rows = 0  # members that took part in the last step
        self.busy = False
        self.broken: BaseException | None = None

    @property
    def load(self) -> int:
        return len(self.members) + len(self.joining) + len(self.merging)

    @property
    def open(self) -> bool:
        """Whether a new session may join."""
        return self.broken is None and self.load < self.max_rows and self.pipeline.healthy

    @property
    def idle(self) -> bool:
        """Nothing left to free at the stages and nothing running (a broken group closed its state)."""
        return not self.busy and (not self.rows or self.broken is not None)

    def join(self, member: Member) -> None:
        """Queue ``member``'s prefilled solo session for the group's next merge."""
        self.joining.append(member)

    def leave(self, member: Member) -> bool:
        """Take ``member`` out; its row is dropped by the next step (the group closes once empty).
        Returns whether its solo session is still its own to free (it had not been merged yet)."""
        member.left = True
        if member in self.joining:
            self.joining.remove(member)
            return True
        if member in self.members:
            self.members.remove(member)
        return False

    def detach(self, member: Member, session_id: str, tokens: int) -> None:
        """Queue a copy of ``member``'s first ``tokens`` visible tokens into session ``session_id``; it
        leaves the group (its row is dropped after the copy)."""
        self.leave(member)
        self.detaching.append((member, session_id, tokens))

    # -- merge ------------------------------------------------------------------------------------
    def merge_plan(self) -> MergePlan:
        """Start merging every joining member (the group is busy until ``merge_done``/``merge_failed``)."""
        new, self.joining = self.joining, []
        self.merging = new
        need = max([m.slots for m in new] + [m.slots for m in self.members]) + self.slack
        max_context = min(max(self.max_context, need), self.context_limit)
        sources = ([self.group_id] if self.rows else []) + [m.session_id for m in new]
        return MergePlan(new, sources, max_context)

    def merge_done(self, plan: MergePlan, length: int) -> None:
        """The merge of ``plan`` made a state of ``length`` slots. Every source ends at its last slot (shorter ones
        padded at the front: fleet_common/runtime.py ``merge``), so the group's own rows move ``length`` less
        its old length on, their pending hides with them."""
        shift = length - self.length if self.rows else 0
        for m in self.rows:
            m.hide = [slot + shift for slot in m.hide]
            m.end += shift
        self.merging = []
        self.rows += plan.new  # a member that left during the merge keeps a row until the next step drops it
        self.members += [m for m in plan.new if not m.left]
        self.length, self.max_context = length, plan.max_context

    def merge_failed(self) -> bool:
        """The merge failed; returns whether the group's own state is lost too (it had rows)."""
        self.merging = []
        return bool(self.rows)

    # -- compaction ------------------------------------------------------------------------------
    def needs_compaction(self, seq: int) -> bool:
        """Whether the next step (chunks of up to ``seq`` tokens) must compact first: it would not fit,
        or hidden slots are a large share of the state."""
        if not self.members:
            return False
        reclaim = self.length - max(m.visible for m in self.members)
        return self.length + seq > self.max_context or (
            reclaim > 0 and reclaim >= max(self.compact_min_slots, self.compact_share * self.length))

    def compact_plan(self) -> tuple[list[int], list[int]]:
        """(hide_rows, hide_slots) for a compaction: pending hides, and departed rows emptied."""
        for m in self.rows:
            if m not in self.members:
                m.hide = list(range(self.length))
        return _hides(self.rows)

    def compact_done(self, length: int) -> None:
        self.length = length
        for m in self.rows:
            m.hide = []
        self.compactions += 1

    # -- step ------------------------------------------------------------------------------------
    def step_plan(self, chunks: list[Chunk]) -> StepPlan:
        """The batched step of every member, ``chunks[i]`` being ``members[i]``'s."""
        members = list(self.members)
        seq = max(len(c.tokens) for c in chunks)
        keep = [self.rows.index(m) for m in members] if self.rows != members else []
        hide_rows, hide_slots = _hides(members)
        filler = chunks[0].tokens[0]
        pads = [seq - len(c.tokens) for c in chunks]
        tokens = np.array([[filler] * pad + c.tokens for c, pad in zip(chunks, pads)], dtype=np.int64)
        logits = max(c.logits for c in chunks)
        return StepPlan(members, chunks, tokens, self.length, [c.start for c in chunks], logits,
                        max(c.top_k for c in chunks), pads, keep, hide_rows, hide_slots, _token_mask(chunks, logits))

    def step_done(self, plan: StepPlan, out: StepOutput) -> tuple[list[StepOutput], bool]:
        """Apply a finished step; each member's candidates (in ``plan.members`` order) and whether the
        step dropped departed rows (their KV is freed at the stages)."""
        dropped = len(self.rows) > len(plan.members)
        self.rows = plan.members
        self.length += plan.tokens.shape[1]
        self.steps += 1
        self.last_rows = len(plan.members)
        count = plan.logits
        ids = out.top_ids.reshape(len(plan.members), count, -1)
        logprobs = out.top_logprobs.reshape(len(plan.members), count, -1)
        outs = []
        for r, (m, c) in enumerate(zip(plan.members, plan.chunks)):
            m.hide = []
            m.visible += len(c.tokens)
            m.end = self.length
            outs.append(StepOutput(ids[r, count - c.logits:], logprobs[r, count - c.logits:]))
        return outs, dropped

    def reject(self, member: Member, count: int) -> None:
        """Hide the last ``count`` tokens ``member`` sent in the step that just ran (rejected drafts)."""
        member.visible -= count
        member.hide.extend(range(member.end - count, member.end))

    def closed(self) -> None:
        """The group's state was closed at the stages."""
        self.rows, self.length, self.max_context = [], 0, 0


def _hides(rows: list[Member]) -> tuple[list[int], list[int]]:
    """(row index, slot) pairs of every row's pending hides, as the two parallel lists the RPCs take."""
    return [r for r, m in enumerate(rows) for _ in m.hide], [s for m in rows for s in m.hide]


def _token_mask(chunks: list[Chunk], logits: int) -> np.ndarray | None:
    """The step's allowed-token bitmasks, [rows * logits, words] int32 row-major (every token allowed where a
    row has no grammar, or for a shorter chunk's leading positions, whose candidates are not used); None when
    no member has a grammar."""
    masked = [c.masks for c in chunks if c.masks is not None]
    if not masked:
        return None
    out = np.full((len(chunks), logits, masked[0].shape[1]), -1, dtype=np.int32)
    for r, c in enumerate(chunks):
        if c.masks is not None:
            out[r, logits - c.logits:] = c.masks
    return out.reshape(len(chunks) * logits, -1)
