"""BatchGroup scheduling against a fake pipeline: a failure anywhere in a group's step reaches every
member that submitted to it at once (not after the group's stall guard), and a member that leaves
before its step runs breaks nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.batching import BatchGroup, Member
from coordinator.errors import StageFailure
from coordinator.pipeline import StepOutput


class FakePipeline:
    """The calls a BatchGroup makes; ``compact``/``step`` raise ``fail`` when it is set. A step's candidates
    are row-specific: for each of a row's last ``count`` tokens t, the one id ``10 t + 1`` with logprob
    ``-t`` (so a member given another row's result, or another position's, shows it)."""

    healthy = True

    def __init__(self, fail: dict[str, BaseException] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[str] = []

    @staticmethod
    def link_rtt_s() -> float:
        return 0.0

    async def merge(self, session_id, sources, max_context, timeout_s):  # noqa: ANN001, ANN201
        self.calls.append("merge")
        return max_context  # a full state: the next step must compact first

    async def compact(self, session_id, past_length, hide_slots, timeout_s, hide_rows=()):  # noqa: ANN001, ANN201
        self.calls.append("compact")
        if "compact" in self.fail:
            raise self.fail["compact"]
        return 8

    async def step(self, session_id, tokens, past_length, starts, count, top_k, timeout_s, **kw):  # noqa: ANN001, ANN201
        self.calls.append("step")
        if "step" in self.fail:
            raise self.fail["step"]
        last = np.asarray(tokens)[:, -count:].reshape(-1, 1)  # [rows * count, 1]: each row's last count tokens
        return StepOutput((10 * last + 1).astype(np.int32), (-last).astype(np.float32))

    async def close_session(self, session_id, timeout_s):  # noqa: ANN001, ANN201
        self.calls.append("close")


async def _two_members_step(pipeline: FakePipeline) -> list:
    # a guard bound of ~3 x 20 s: a member left waiting for it would fail the 2 s wait below
    group = BatchGroup(pipeline, slack=2, compact_share=0.5, compact_min_slots=1, timeout_s=lambda tokens: 20.0,
                       max_rows=4, wait_s=0.05)
    a, b = Member("a", slots=8, visible=4), Member("b", slots=8, visible=4)
    await asyncio.gather(group.join(a), group.join(b))
    steps = [group.step(m, [1], m.visible, 1, 1) for m in (a, b)]
    return await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), 2.0)


@pytest.mark.parametrize("where, error", [
    ("compact", StageFailure("stage 1 at 127.0.0.1:1: compaction failed: UNAVAILABLE")),  # the soak's stall
    ("compact", RuntimeError("bug")),
    ("step", StageFailure("stage 1 at 127.0.0.1:1: pipeline step failed: UNAVAILABLE")),
])
def test_a_failed_step_fails_every_member_at_once(where, error):
    pipeline = FakePipeline({where: error})
    results = asyncio.run(_two_members_step(pipeline))
    assert all(isinstance(r, StageFailure) for r in results), results
    assert pipeline.calls[:2] == ["merge", "compact"]  # the merged state is full: a compaction comes first


def test_a_step_after_compaction_answers_every_member():
    pipeline = FakePipeline()
    results = asyncio.run(_two_members_step(pipeline))
    assert all(isinstance(r, StepOutput) for r in results), results
    assert pipeline.calls == ["merge", "compact", "step"]


def test_each_member_gets_its_own_rows():
    """Two members step together with chunks of different lengths (one padded on the left) and logits for
    different numbers of positions: each gets the candidates of its own row, for its own last positions."""
    async def scenario() -> list:
        group = BatchGroup(FakePipeline(), slack=2, compact_share=0.5, compact_min_slots=64,
                           timeout_s=lambda tokens: 20.0, max_rows=4, wait_s=0.05)
        a, b, c = (Member(name, slots=8, visible=4) for name in "abc")
        await asyncio.gather(*(group.join(m) for m in (a, b, c)))
        steps = [group.step(a, [5], a.visible, 1, 1), group.step(b, [7, 8, 9], b.visible, 3, 1),
                 group.step(c, [2, 3], c.visible, 1, 1)]
        return await asyncio.wait_for(asyncio.gather(*steps), 2.0)

    out_a, out_b, out_c = asyncio.run(scenario())
    assert out_a.top_ids.tolist() == [[51]] and out_a.top_logprobs.tolist() == [[-5.0]]
    assert out_b.top_ids.tolist() == [[71], [81], [91]] and out_b.top_logprobs.tolist() == [[-7.0], [-8.0], [-9.0]]
    assert out_c.top_ids.tolist() == [[31]] and out_c.top_logprobs.tolist() == [[-3.0]]


def test_a_member_leaving_before_its_step_runs_does_not_break_the_group():
    async def scenario() -> tuple:
        pipeline = FakePipeline()
        group = BatchGroup(pipeline, slack=2, compact_share=0.5, compact_min_slots=1,
                           timeout_s=lambda tokens: 20.0, max_rows=4, wait_s=0.05)
        a, b = Member("a", slots=8, visible=4), Member("b", slots=8, visible=4)
        await asyncio.gather(group.join(a), group.join(b))
        b.late = True  # missed a step: the group does not wait for it
        step_a = asyncio.ensure_future(group.step(a, [1], a.visible, 1, 1))
        await asyncio.sleep(0)  # a's step is submitted and the group's task created, not yet started
        assert group._task is not None and not group._task.done()
        group.leave(a)  # a's client goes away (the engine leaves, then the cancellation lands)
        step_a.cancel()
        await asyncio.sleep(0.01)
        broken = group.broken
        out = await asyncio.wait_for(group.step(b, [1], b.visible, 1, 1), 2.0)
        return broken, out

    broken, out = asyncio.run(scenario())
    assert broken is None
    assert isinstance(out, StepOutput)


def test_the_group_reports_each_kv_free_to_the_engine():
    """Requests waiting for KV room are woken by the group: when a departed member's row is dropped
    and when the last member's leaving closes the group's state (the admission wait's lost wake-up:
    a third request waited out its whole 60 s queue timeout)."""
    async def scenario() -> list[str]:
        pipeline = FakePipeline()
        frees: list[str] = []
        group = BatchGroup(pipeline, slack=2, compact_share=0.5, compact_min_slots=64,
                           timeout_s=lambda tokens: 20.0, max_rows=4, wait_s=0.05,
                           on_freed=lambda: frees.append(pipeline.calls[-1]))
        a, b = Member("a", slots=8, visible=4), Member("b", slots=8, visible=4)
        await asyncio.gather(group.join(a), group.join(b))
        await asyncio.wait_for(asyncio.gather(*(group.step(m, [1], m.visible, 1, 1) for m in (a, b))), 2.0)
        assert frees == []
        group.leave(a)
        await asyncio.wait_for(group.step(b, [1], b.visible, 1, 1), 2.0)  # drops a's row
        group.leave(b)
        for _ in range(100):  # the group's task closes its state
            if len(frees) == 2:
                break
            await asyncio.sleep(0.01)
        return frees

    assert asyncio.run(scenario()) == ["step", "close"]
