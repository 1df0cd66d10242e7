"""The step loop's scheduler: given the state of one pipeline's requests and batch groups, what runs
next. Pure: no I/O, no clock; the loop (``loop.py``) runs what it returns and reports the outcomes
back into the state. Unit-tested with hand-made states (``tests/unit/test_scheduler.py``).

Each round it decides, for every request and group that has nothing running:
* a prefilling request: its next prompt chunk (``--prefill-chunk`` tokens) on its solo session;
* a prefilled request: which batch group it joins (the least loaded open group of its pipeline;
  a new group while the pipeline has fewer than ``groups``, or when all are full);
* a group: copy out the rows of finished requests to retain (prefix cache), else merge the joining
  sessions, else close its state when nobody is left, else compact when the next step would not fit
  or hidden slots are a large share, else step, once every member's next chunk is ready (a member
  whose drafts are being proposed is work the group waits for);
* a member whose next step carries draft-model drafts: the draft's prefill of its prompt, then the
  proposal.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from .group import BatchGroup, Chunk, Member, MergePlan, StepPlan
from .output import OutputProcessor
from .request import Request
from .sampling import SparseDist


class Phase(enum.Enum):
    PREFILL = "prefill"  # its solo session is being prefilled
    PREFILLED = "prefilled"  # waiting to be placed in a group
    JOINING = "joining"  # queued for (or in) a group's merge
    DECODE = "decode"  # a member of a group
    ENDED = "ended"


@dataclass(eq=False)
class Seq:
    """One request as its pipeline's loop holds it: where its KV is, what it feeds next.

    ``prefill`` tokens go through the solo session ``session`` from logical position ``start`` (the
    tokens it held already: a retained session's, prefix cache); ``logits``: whether the prefill's last
    chunk returns candidates (False when a failover replays the visible tokens). Then it decodes in
    ``group``, feeding ``[decided[-1], *draft]`` each step.
    """

    request: Request
    output: OutputProcessor
    pipeline: object  # Pipeline
    session: str
    slots: int  # physical KV slots it needs on its own
    top_k: int  # candidates wanted per position
    prefill: list[int]
    start: int = 0
    logits: bool = True
    phase: Phase = Phase.PREFILL
    done: int = 0  # prefill tokens on the stages so far
    busy: bool = False  # a prefill chunk or a proposal of it is running
    decided: list[int] = field(default_factory=list)  # tokens the last step decided; the newest is fed next
    logical: int = 0  # tokens visible at the stages
    k: int = 0  # drafts wanted for its next step
    draft: list[int] | None = None  # the next step's drafts, once proposed ([] for a plain step)
    qs: list[SparseDist] = field(default_factory=list)  # the distributions the drafts were drawn from
    draft_ms: float = 0.0  # what proposing them took
    masks: object = None  # np.ndarray [len(draft) + 1, words] int32: the next step's grammar masks, if any
    forced: bool = False  # its drafts are the tokens its grammar forces (point masses), not a draft's
    drafter: object = None  # its DraftSession in the draft model, if any
    draft_prefill: str = ""  # "", "wanted" (beside the stages' prefill), "running", "done" or "failed"
    group: BatchGroup | None = None
    member: object = None  # its group.Member
    joined_compactions: int = 0  # its group's compactions when it joined
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # TextDelta | Moved | BaseException
    owner: object = None  # the StepLoop running it
    released: asyncio.Future | None = None  # once finished: resolved when its KV is retained or freed

    @property
    def ready(self) -> bool:
        """Whether its next decode chunk is known."""
        return self.draft is not None

    def chunk(self) -> Chunk:
        tokens = [self.decided[-1], *self.draft]
        return Chunk(tokens, self.logical, len(tokens), self.top_k, self.masks)


# -- what a round starts (the loop runs each and reports its outcome) ------------------------------
@dataclass
class Prefill:
    seq: Seq
    tokens: list[int]
    position: int
    logits: int
    token_mask: object = None  # np.ndarray [1, words] int32: the first token's grammar mask, if any


@dataclass
class DraftPrefill:
    seq: Seq


@dataclass
class Propose:
    seq: Seq


@dataclass
class Merge:
    group: BatchGroup
    plan: MergePlan


@dataclass
class Compact:
    group: BatchGroup
    hide_rows: list[int]
    hide_slots: list[int]


@dataclass
class Step:
    group: BatchGroup
    seqs: list[Seq]
    plan: StepPlan


@dataclass
class CopyOut:
    group: BatchGroup
    detaching: list  # (member, session id, tokens)


@dataclass
class CloseGroup:
    group: BatchGroup


Action = Prefill | DraftPrefill | Propose | Merge | Compact | Step | CopyOut | CloseGroup


class Scheduler:
    """Decides one round for a pipeline: see the module's docstring. ``groups``: batch groups to keep
    per pipeline (0: one per stage of each pipeline, so a fleet re-planned to another stage count keeps
    every stage busy); ``max_rows``: sessions per group; ``prefill_chunk``: prompt tokens per prefill step;
    the rest configures the groups it creates (``group.BatchGroup``)."""

    def __init__(self, groups: int, max_rows: int, prefill_chunk: int, slack: int, compact_share: float,
                 compact_min_slots: int, context_limit: int = 1 << 30) -> None:
        self.target_groups = groups
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.slack, self.compact_share, self.compact_min_slots = slack, compact_share, compact_min_slots
        self.context_limit = context_limit

    def schedule(self, pipeline, seqs: list[Seq], groups: list[BatchGroup]) -> list[Action]:
        """This round's actions for ``seqs`` and ``groups`` (both of ``pipeline``). Marks what it starts
        busy; places prefilled requests in groups (appending new groups to ``groups``)."""
        actions: list[Action] = []
        for seq in seqs:
            if seq.draft_prefill == "wanted":  # beside the stages' prefill
                seq.draft_prefill = "running"
                actions.append(DraftPrefill(seq))
            if seq.phase is Phase.PREFILL and not seq.busy:
                actions.append(self._prefill(seq))
            elif seq.phase is Phase.PREFILLED:
                self._place(pipeline, seq, groups)
            elif seq.phase is Phase.DECODE and seq.draft is None and not seq.busy and (action := self._draft(seq)):
                actions.append(action)
        for group in groups:
            if not group.busy and group.broken is None and (action := self._group_action(group, seqs)):
                group.busy = True
                actions.append(action)
        return actions

    def _prefill(self, seq: Seq) -> Prefill:
        tokens = seq.prefill[seq.done:seq.done + self.prefill_chunk]
        last = seq.done + len(tokens) == len(seq.prefill)
        seq.busy = True
        logits = 1 if last and seq.logits else 0
        grammar = seq.request.grammar
        return Prefill(seq, tokens, seq.start + seq.done, logits, grammar.masks([])[1] if logits and grammar else None)

    def _place(self, pipeline, seq: Seq, groups: list[BatchGroup]) -> None:
        """Put a prefilled ``seq`` in a group of its pipeline: the least loaded open one, or a new one while
        the pipeline has fewer than ``groups`` or when all are full (broken and finished groups are dropped)."""
        groups[:] = [g for g in groups if g.broken is None and (g.load or g.rows or g.busy)]
        open_groups = [g for g in groups if g.open]
        if len(groups) < (self.target_groups or len(pipeline.addresses)) or not open_groups:
            group = BatchGroup(pipeline, self.slack, self.max_rows, self.compact_share, self.compact_min_slots,
                               self.context_limit)
            groups.append(group)
        else:
            group = min(open_groups, key=lambda g: g.load)
        seq.member = Member(seq.session, seq.slots, seq.logical)
        seq.group, seq.phase = group, Phase.JOINING
        group.join(seq.member)

    @staticmethod
    def _draft(seq: Seq) -> DraftPrefill | Propose | None:
        """The draft model's next work for ``seq``, which wants ``seq.k`` drafts (the loop sets
        ``seq.draft`` at once for plain steps and prompt lookup)."""
        if seq.draft_prefill == "":
            seq.draft_prefill = "running"
            return DraftPrefill(seq)
        if seq.draft_prefill == "done":
            seq.busy = True
            return Propose(seq)
        return None  # its prefill is running

    def _group_action(self, group: BatchGroup, seqs: list[Seq]):
        if group.detaching:
            detaching, group.detaching = group.detaching, []
            return CopyOut(group, detaching)
        if group.joining:
            return Merge(group, group.merge_plan())
        if not group.members:
            return CloseGroup(group) if group.rows else None
        stepping = [s for s in seqs if s.group is group and s.phase is Phase.DECODE]
        by_member = {s.member: s for s in stepping}
        ordered = [by_member.get(m) for m in group.members]
        if any(s is None or not s.ready for s in ordered):
            return None  # a member's drafts are being proposed
        chunks = [s.chunk() for s in ordered]
        if group.needs_compaction(max(len(c.tokens) for c in chunks)):
            return Compact(group, *group.compact_plan())
        return Step(group, ordered, group.step_plan(chunks))
