"""The step loop's pure scheduler, on hand-made states: what each round starts, with no I/O."""

from __future__ import annotations

import numpy as np

from coordinator.engine.group import BatchGroup, Member
from coordinator.engine.pipeline import StepOutput
from coordinator.engine.request import Request, SamplingParams
from coordinator.engine.scheduler import (
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


class Pipe:
    healthy = True


PIPE = Pipe()


def scheduler(groups: int = 2, max_rows: int = 4, prefill_chunk: int = 4) -> Scheduler:
    return Scheduler(groups, max_rows, prefill_chunk, slack=2, compact_share=0.5, compact_min_slots=4)


def seq(name: str, prompt: int = 10, phase: Phase = Phase.PREFILL, logits: bool = True) -> Seq:
    request = Request(name, list(range(1, prompt + 1)), SamplingParams(max_tokens=8, temperature=0.0))
    s = Seq(request, None, PIPE, name, slots=prompt + 8, top_k=1, prefill=request.prompt_ids, logits=logits)
    s.phase = phase
    if phase is not Phase.PREFILL:
        s.logical, s.decided = prompt, [7]
    return s


def decoding(sched: Scheduler, seqs: list[Seq], groups: list[BatchGroup], length: int = 12) -> BatchGroup:
    """Place ``seqs`` (prefilled) and run their merge: members of one group with ``length`` slots."""
    (merge,) = sched.schedule(PIPE, seqs, groups)
    group = merge.group
    assert all(s.group is group for s in seqs)
    group.merge_done(merge.plan, length)
    group.busy = False
    for s in seqs:
        s.phase = Phase.DECODE
    return group


def test_prefill_runs_in_chunks_with_logits_only_at_the_end():
    sched, s = scheduler(prefill_chunk=4), seq("a", prompt=10)
    chunks = []
    while s.done < len(s.prefill):
        (action,) = sched.schedule(PIPE, [s], [])
        assert isinstance(action, Prefill) and s.busy
        assert sched.schedule(PIPE, [s], []) == []  # one chunk of a request at a time
        chunks.append((action.tokens, action.position, action.logits))
        s.busy, s.done = False, s.done + len(action.tokens)
    assert chunks == [([1, 2, 3, 4], 0, 0), ([5, 6, 7, 8], 4, 0), ([9, 10], 8, 1)]
    replay = seq("b", prompt=3, logits=False)  # a failover's replay: no candidates wanted
    assert sched.schedule(PIPE, [replay], [])[0].logits == 0


def test_a_retained_prefix_is_not_prefilled_again():
    sched, s = scheduler(prefill_chunk=64), seq("a", prompt=10)
    s.prefill, s.start = s.request.prompt_ids[6:], 6  # the session holds the first 6 tokens already
    (action,) = sched.schedule(PIPE, [s], [])
    assert (action.tokens, action.position) == ([7, 8, 9, 10], 6)


def test_placement_opens_one_group_per_target_then_fills_the_least_loaded():
    sched, groups = scheduler(groups=2, max_rows=2), []
    seqs = [seq(n, phase=Phase.PREFILLED) for n in "abcde"]
    for s in seqs:
        sched.schedule(PIPE, [s], groups)
        groups_seen = {id(g) for g in groups}
        # placed: merging at once, or queued while the group merges another
        assert s.phase is Phase.JOINING and s.member in s.group.merging + s.group.joining
        assert len(groups_seen) == len(groups)
    a, b, c, d, e = seqs
    assert a.group is not b.group  # a second group while fewer than 2
    assert c.group in (a.group, b.group) and d.group in (a.group, b.group) and c.group is not d.group
    assert e.group not in (a.group, b.group)  # both full (2 rows each): a third
    assert len(groups) == 3


class StagedPipe:
    """A pipeline of ``n`` stages (what the scheduler reads of it: ``addresses``)."""

    healthy = True

    def __init__(self, n: int) -> None:
        self.addresses = [f"w{i}:1" for i in range(n)]


def test_groups_0_keeps_one_group_per_stage_of_each_pipeline():
    """The default (``--batch-groups 0``) follows the pipeline: after a re-plan from 3 stages to 2, a new
    pipeline gets 2 groups, not the 3 the fleet started with."""
    sched = scheduler(groups=0, max_rows=8)
    for stages in (3, 2):
        pipe, groups = StagedPipe(stages), []
        for n in "abcdef":
            s = seq(n, phase=Phase.PREFILLED)
            s.pipeline = pipe
            sched.schedule(pipe, [s], groups)
        assert len(groups) == stages  # rows to spare (8 each): one group per stage, no more


def test_a_group_merges_its_joiners_then_steps_when_every_member_is_ready():
    sched, groups = scheduler(groups=1), []
    a, b = seq("a", phase=Phase.PREFILLED), seq("b", prompt=6, phase=Phase.PREFILLED)
    (merge,) = sched.schedule(PIPE, [a, b], groups)  # placed and merged in one round
    assert isinstance(merge, Merge) and merge.plan.sources == ["a", "b"] and merge.group.busy
    assert merge.plan.max_context == max(a.slots, b.slots) + 2
    assert sched.schedule(PIPE, [a, b], groups) == []  # busy: nothing more for the group
    group = merge.group
    group.merge_done(merge.plan, 10)
    group.busy = False
    a.phase = b.phase = Phase.DECODE
    a.draft = [3, 4]  # a verifies two drafts; b's are being proposed
    b.draft_prefill, b.busy = "done", True
    assert sched.schedule(PIPE, [a, b], groups) == []
    b.draft, b.busy = [], False
    (step,) = sched.schedule(PIPE, [a, b], groups)
    assert isinstance(step, Step) and step.seqs == [a, b]
    plan = step.plan
    assert plan.tokens.tolist() == [[7, 3, 4], [7, 7, 7]]  # b's one token padded on the left (filler: a's first)
    assert plan.pads == [0, 2] and plan.starts == [10, 6] and plan.logits == 3 and plan.past_length == 10
    out = StepOutput(np.arange(6, dtype=np.int32).reshape(6, 1), np.zeros((6, 1), np.float32))
    outs, dropped = group.step_done(plan, out)
    assert [o.top_ids.ravel().tolist() for o in outs] == [[0, 1, 2], [5]] and not dropped
    assert (a.member.visible, b.member.visible, group.length) == (13, 7, 13)


def test_a_step_that_would_not_fit_compacts_first():
    sched, groups = scheduler(groups=1), []
    a = seq("a", phase=Phase.PREFILLED)
    group = decoding(sched, [a], groups, length=10)
    group.length = group.max_context  # full
    a.draft = []
    (action,) = sched.schedule(PIPE, [a], groups)
    assert isinstance(action, Compact)
    group.compact_done(10)
    group.busy = False
    (action,) = sched.schedule(PIPE, [a], groups)
    assert isinstance(action, Step) and group.compactions == 1


def test_hidden_slots_past_their_share_compact_and_departed_rows_are_emptied():
    sched, groups = scheduler(groups=1), []
    a, b = seq("a", phase=Phase.PREFILLED), seq("b", phase=Phase.PREFILLED)
    group = decoding(sched, [a, b], groups, length=10)
    group.reject(a.member, 0)
    a.member.visible = b.member.visible = 4  # 6 of 10 slots hidden in both rows: past half
    group.leave(b.member)
    a.draft = []
    (action,) = sched.schedule(PIPE, [a], groups)
    assert isinstance(action, Compact)
    assert action.hide_rows == [1] * 10 and action.hide_slots == list(range(10))  # b's row emptied


def test_copies_out_come_before_merges_and_an_empty_group_closes():
    sched, groups = scheduler(groups=1), []
    a, b = seq("a", phase=Phase.PREFILLED), seq("b", phase=Phase.PREFILLED)
    group = decoding(sched, [a], groups)
    group.detach(a.member, "kv-1", 10)  # a finished: its row is copied out to retain it
    (copy,) = sched.schedule(PIPE, [b], groups)  # b joins the same group, which copies a out first
    assert b.group is group and b.member in group.joining
    assert isinstance(copy, CopyOut) and copy.detaching == [(a.member, "kv-1", 10)]
    group.busy = False
    (merge,) = sched.schedule(PIPE, [b], groups)
    assert isinstance(merge, Merge) and merge.plan.sources == [group.group_id, "b"]
    group.merge_done(merge.plan, 12)
    group.busy = False
    group.leave(b.member)
    (close,) = sched.schedule(PIPE, [], groups)
    assert isinstance(close, CloseGroup)
    group.closed()
    group.busy = False
    assert sched.schedule(PIPE, [], groups) == [] and group.idle


def test_a_draft_model_prefills_before_its_first_proposal():
    sched, groups = scheduler(groups=1), []
    a = seq("a", phase=Phase.PREFILLED)
    decoding(sched, [a], groups)
    a.k, a.draft = 3, None
    (action,) = sched.schedule(PIPE, [a], groups)
    assert isinstance(action, DraftPrefill) and a.draft_prefill == "running"
    assert sched.schedule(PIPE, [a], groups) == []  # its prefill runs; the group waits for the drafts
    a.draft_prefill = "done"
    (action,) = sched.schedule(PIPE, [a], groups)
    assert isinstance(action, Propose) and a.busy
    assert sched.schedule(PIPE, [a], groups) == []


def test_a_draft_prefill_wanted_beside_the_stages_starts_with_the_first_chunk():
    sched, s = scheduler(), seq("a")
    s.draft_prefill = "wanted"
    kinds = {type(a) for a in sched.schedule(PIPE, [s], [])}
    assert kinds == {DraftPrefill, Prefill}


def test_group_leave_says_whose_session_is_still_its_own():
    group = BatchGroup(PIPE, slack=2, max_rows=4, compact_share=0.5, compact_min_slots=4)
    joining, merged = Member("j", 8, 4), Member("m", 8, 4)
    group.join(merged)
    plan = group.merge_plan()
    group.merge_done(plan, 6)
    group.join(joining)
    assert group.leave(joining) is True  # not merged: its solo session is still its own to free
    assert group.leave(merged) is False and merged in group.rows  # the next step drops its row
    assert group.load == 0 and group.rows == [merged]


def test_a_merge_longer_than_the_group_moves_its_rows_pending_hides():
    """The stages right-align a merge's sources (fleet_common/runtime.py ``merge``): when a joiner's session is longer
    than the group's state, the group's rows move on by the difference, and so do their pending hides."""
    sched, groups = scheduler(groups=1), []
    a = seq("a", prompt=6, phase=Phase.PREFILLED)
    group = decoding(sched, [a], groups, length=10)
    member = group.members[0]
    member.end, member.hide = 10, [8, 9]  # a's last two drafts were rejected
    b = seq("b", prompt=14, phase=Phase.PREFILLED)
    a.busy = True  # proposing: the group merges b before its next step
    (merge,) = sched.schedule(PIPE, [a, b], groups)
    assert isinstance(merge, Merge) and merge.plan.sources == [group.group_id, "b"]
    group.merge_done(merge.plan, 14)  # b's 14 slots: the group's 10 now end at slot 14 too
    assert (member.end, member.hide) == (14, [12, 13])
