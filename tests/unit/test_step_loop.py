"""The step loop over a fake pipeline: batch groups from prefill to close, each request getting its own
rows' results; a failure anywhere in a group's step reaching every member at once; a request that
ends before its step runs breaking nothing; every KV free reported; a client that stops reading
stalling nobody. (Over real workers: tests/integration/test_batching.py and the API tests.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.errors import StageFailure
from coordinator.engine.loop import LoopContext, Moved, StepLoop
from coordinator.engine.metrics import CoordinatorMetrics
from coordinator.engine.output import OutputProcessor
from coordinator.engine.pipeline import StepOutput
from coordinator.engine.request import FinishReason, Request, SamplingParams, TextDelta
from coordinator.engine.scheduler import Scheduler, Seq
from coordinator.engine.speculative import StepCostsByLoad

VOCAB = 1000


def successor(t: int) -> int:
    """The fake model's greedy next token after ``t``."""
    return (10 * t + 1) % VOCAB


class FakePipeline:
    """The calls a step loop makes; ``fail`` maps a call to the exception it raises. A step's candidates
    are row-specific: for each of a row's last ``count`` tokens t, the one id ``successor(t)`` (so a
    request given another row's result, or another position's, shows it)."""

    healthy = True
    addresses = ("127.0.0.1:1", "127.0.0.1:2")
    path = "coordinator->stage0->stage1->coordinator"

    def __init__(self, fail: dict[str, BaseException] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None  # when set, group steps wait for it

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    async def merge(self, session_id, sources, max_context, timeout_s):
        self._call("merge")
        return max_context  # a full state: the group's first step must compact first

    async def compact(self, session_id, past_length, hide_slots, timeout_s, hide_rows=()):
        self._call("compact")
        return 8

    async def step(self, session_id, tokens, past_length, starts, count, top_k, timeout_s, **kw):
        grouped = session_id.startswith("group-")
        if grouped and self.gate is not None:
            await self.gate.wait()
        self._call("step" if grouped else "prefill")
        rows = np.asarray(tokens).reshape(-1 if grouped else 1, np.asarray(tokens).shape[-1])
        if count == 0:
            return None
        last = rows[:, -count:].reshape(-1, 1)
        return StepOutput(((10 * last + 1) % VOCAB).astype(np.int32), np.zeros_like(last, np.float32))

    async def close_session(self, session_id, timeout_s):
        self.calls.append("close")

    def forget(self, session_id) -> None:
        pass


class Digits:
    """A tokenizer for the output processor: token t is the text ``<t>``."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in ids)


def make_loop(pipeline: FakePipeline, frees: list | None = None, max_rows: int = 4) -> tuple[StepLoop, StepCostsByLoad]:
    costs = StepCostsByLoad(lambda: 1)
    ctx = LoopContext(lambda tokens: 20.0, CoordinatorMetrics(), costs, None, "none", None,
                      (lambda: frees.append(pipeline.calls[-1])) if frees is not None else (lambda: None), 20.0)
    scheduler = Scheduler(1, max_rows, 64, slack=2, compact_share=0.5, compact_min_slots=64)
    return StepLoop(pipeline, scheduler, ctx), costs


def make_seq(pipeline: FakePipeline, costs: StepCostsByLoad, name: str, prompt: list[int], max_tokens: int) -> Seq:
    request = Request(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    output = OutputProcessor(request, Digits(), set(), costs, 4, None, drafting=False)
    return Seq(request, output, pipeline, name, slots=len(prompt) + max_tokens + 2, top_k=1, prefill=prompt)


async def drain(seq: Seq, bound_s: float = 2.0) -> list:
    """Every item of ``seq``'s outbox up to its last delta (or a Moved / an exception)."""
    items = []
    while True:
        item = await asyncio.wait_for(seq.outbox.get(), bound_s)
        items.append(item)
        if not isinstance(item, TextDelta) or item.finish_reason is not None:
            return items


async def close_when_idle(loop: StepLoop) -> None:
    """Wait (up to 1 s) until ``loop`` holds nothing at the stages, then stop it."""
    for _ in range(100):
        if loop.idle:
            break
        await asyncio.sleep(0.01)
    loop.close()


def expected(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = successor(t)
        out.append(t)
    return out


def test_requests_in_one_group_each_get_their_own_rows():
    async def scenario() -> tuple[dict, list[str]]:
        pipeline = FakePipeline()
        loop, costs = make_loop(pipeline)
        seqs = {"a": make_seq(pipeline, costs, "a", [5], 4), "b": make_seq(pipeline, costs, "b", [7, 8, 9], 6)}
        for seq in seqs.values():
            loop.submit(seq)
        items = {name: await drain(seq) for name, seq in seqs.items()}
        for seq in seqs.values():
            await asyncio.wait_for(loop.end(seq, retain=False), 2.0)
        await close_when_idle(loop)
        return {n: (s.request.output_ids, items[n][-1].finish_reason) for n, s in seqs.items()}, pipeline.calls

    got, calls = asyncio.run(scenario())
    assert got["a"] == (expected([5], 4), FinishReason.LENGTH)
    assert got["b"] == (expected([9], 6), FinishReason.LENGTH)
    assert calls[:2] == ["prefill", "prefill"] and "merge" in calls and calls[-1] == "close"
    assert calls[calls.index("merge") + 1] == "compact"  # the merged state is full: a compaction comes first


@pytest.mark.parametrize("where, error", [
    ("compact", StageFailure("stage 1 at 127.0.0.1:1: compaction failed: UNAVAILABLE")),
    ("compact", RuntimeError("bug")),
    ("step", StageFailure("stage 1 at 127.0.0.1:1: pipeline step failed: UNAVAILABLE")),
])
def test_a_failed_step_reaches_every_member_at_once(where, error):
    async def scenario() -> list:
        pipeline = FakePipeline({where: error})
        loop, costs = make_loop(pipeline)
        seqs = [make_seq(pipeline, costs, n, [3], 8) for n in "ab"]
        for seq in seqs:
            loop.submit(seq)
        ends = [(await drain(seq))[-1] for seq in seqs]
        loop.close()
        return ends

    ends = asyncio.run(scenario())
    assert all(isinstance(e, Moved) and isinstance(e.failure, StageFailure) for e in ends), ends


def test_a_request_ending_before_its_step_runs_breaks_nothing():
    async def scenario() -> tuple:
        pipeline = FakePipeline()
        pipeline.gate = asyncio.Event()
        loop, costs = make_loop(pipeline)
        a, b = make_seq(pipeline, costs, "a", [3], 8), make_seq(pipeline, costs, "b", [4], 3)
        loop.submit(a)
        loop.submit(b)
        await asyncio.wait_for(a.outbox.get(), 2.0)  # a's first token (its prefill); its group step now waits
        await asyncio.wait_for(b.outbox.get(), 2.0)
        await asyncio.sleep(0.05)
        end = loop.end(a, retain=False)  # a's client goes away while a step of its group is running
        pipeline.gate.set()
        await asyncio.wait_for(end, 2.0)
        rest = await drain(b)
        loop.close()
        return b.request.output_ids, rest[-1].finish_reason, [g.broken for g in loop.groups]

    output, reason, broken = asyncio.run(scenario())
    assert output == expected([4], 3) and reason is FinishReason.LENGTH
    assert broken == [None] * len(broken)


def test_the_loop_reports_each_kv_free():
    """Requests waiting for KV room are woken by the loop: when a departed member's row is dropped and
    when the group's state closes."""
    async def scenario() -> list[str]:
        pipeline = FakePipeline()
        frees: list[str] = []
        loop, costs = make_loop(pipeline, frees)
        a, b = make_seq(pipeline, costs, "a", [3], 2), make_seq(pipeline, costs, "b", [4], 4)
        loop.submit(a)
        loop.submit(b)
        await drain(a)
        await asyncio.wait_for(loop.end(a, retain=False), 2.0)
        await drain(b)
        await asyncio.wait_for(loop.end(b, retain=False), 2.0)
        await close_when_idle(loop)
        return frees

    assert asyncio.run(scenario()) == ["step", "close"]


def test_a_client_that_stops_reading_stalls_nobody():
    async def scenario() -> tuple:
        pipeline = FakePipeline()
        loop, costs = make_loop(pipeline)
        slow, fast = make_seq(pipeline, costs, "slow", [3], 40), make_seq(pipeline, costs, "fast", [4], 12)
        loop.submit(slow)
        loop.submit(fast)
        await drain(fast)  # never reads slow's outbox meanwhile
        queued = slow.outbox.qsize()
        await drain(slow)
        loop.close()
        return queued, slow.request.output_ids

    queued, output = asyncio.run(scenario())
    assert queued >= 10  # its deltas waited for it; the group stepped on
    assert output == expected([3], 40)
