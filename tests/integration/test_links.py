"""The per-token path between stages (issue 17): one ``Link`` stream per upstream, failures answered as
``LinkAck`` messages that name the stage, a broken link below reported to every upstream that used it,
deadlines carried in each step, garbage on the stream refused. Real workers of the 2-stage demo build
on loopback (no mDNS), driven over real gRPC streams."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from fleet_common.wire import to_tensor
from tests.conftest import start_worker

pytestmark = pytest.mark.integration

TIMEOUT_S = 20.0


@pytest.fixture()
def workers(build_2, tmp_path):
    procs = [start_worker(build_2, stage, tmp_path, "--no-announce") for stage in range(2)]
    yield procs, load_manifest(build_2).sha256
    for proc, _ in procs:
        proc.stop()


def step(session: str, step_id: int, route: list[str], sha: str, **kw) -> pb.ForwardRequest:
    base = dict(session_id=session, step_id=step_id, stage=0, input=to_tensor(np.array([[1, 2, 3]], np.int64)),
                route=route, manifest_sha256=sha, logits_count=1, top_k=4, reply_to="sub", timeout_ms=10_000)
    return pb.ForwardRequest(**{**base, **kw})


async def _open(address: str, session: str, sha: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.StageStub(channel).OpenSession(pb.OpenSessionRequest(session_id=session, manifest_sha256=sha),
                                                     timeout=TIMEOUT_S)


def test_a_link_runs_steps_in_order_and_answers_failures_naming_the_stage(workers):
    (_, a0), (_, a1) = workers[0]
    sha = workers[1]

    async def run() -> None:
        for address in (a0, a1):
            await _open(address, "s", sha)
        async with grpc.aio.insecure_channel(a1) as c1, grpc.aio.insecure_channel(a0) as c0:
            results = pb_grpc.StageStub(c1).Subscribe(pb.SubscribeRequest(subscriber_id="sub"))
            assert not (await results.read()).session_id  # subscribed
            link = pb_grpc.StageStub(c0).Link()
            # two steps of one session back to back: run in order (the second one's past_length needs the first)
            await link.write(step("s", 1, [a1], sha))
            await link.write(step("s", 2, [a1], sha, input=to_tensor(np.array([[4]], np.int64)), past_length=3,
                                  start_position=3))
            got = [await asyncio.wait_for(results.read(), TIMEOUT_S) for _ in range(2)]
            assert [r.step_id for r in got] == [1, 2]
            assert all(len(r.handle_ms) == 2 and min(r.handle_ms) > 0 for r in got)  # both stages' times
            ids = np.frombuffer(got[1].top_ids.data, np.int32)
            assert ids.shape == (4,) and len(set(ids.tolist())) == 4
            # a failure at stage 0 and one at stage 1 come back on the link, each naming its stage
            await link.write(step("nobody", 3, [a1], sha))
            ack = await asyncio.wait_for(link.read(), TIMEOUT_S)
            assert (ack.session_id, ack.step_id, ack.code) == ("nobody", 3, grpc.StatusCode.NOT_FOUND.value[0])
            assert not ack.details.startswith("stage 1 at")
            await _open(a0, "only0", sha)  # a session stage 1 does not hold
            await link.write(step("only0", 4, [a1], sha))
            ack = await asyncio.wait_for(link.read(), TIMEOUT_S)
            assert ack.step_id == 4 and ack.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert ack.details.startswith(f"stage 1 at {a1}: ")
            # a step whose deadline passed is not passed on
            await link.write(step("s", 5, [a1], sha, input=to_tensor(np.array([[6]], np.int64)), past_length=4,
                                  start_position=4, timeout_ms=1e-3))
            ack = await asyncio.wait_for(link.read(), TIMEOUT_S)
            assert ack.step_id == 5 and ack.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            link.cancel()
            results.cancel()

    asyncio.run(run())


def test_a_broken_link_below_is_reported_to_the_upstream(workers):
    (_, a0), (p1, a1) = workers[0]
    sha = workers[1]

    async def run() -> None:
        for address in (a0, a1):
            await _open(address, "s", sha)
        async with grpc.aio.insecure_channel(a0) as c0:
            link = pb_grpc.StageStub(c0).Link()
            await link.write(step("s", 1, [a1], sha, logits_count=0, reply_to=""))  # opens stage 0's link to a1
            await asyncio.sleep(1.0)
            p1.popen.kill()
            ack = await asyncio.wait_for(link.read(), TIMEOUT_S)
            assert ack.session_id == "" and ack.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert ack.details.startswith(f"stage 1 at {a1}: ")
            link.cancel()

    asyncio.run(run())


def test_garbage_on_a_link_is_refused_and_the_worker_serves_on(workers):
    (_, a0), _ = workers[0]
    sha = workers[1]

    async def run() -> None:
        async with grpc.aio.insecure_channel(a0) as c0:
            raw = c0.stream_stream("/fleet.v1.Stage/Link", request_serializer=None,
                                   response_deserializer=pb.LinkAck.FromString)()
            await raw.write(b"\xff\x00\x13garbage" * 10)
            ack = await asyncio.wait_for(raw.read(), TIMEOUT_S)
            assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "malformed" in ack.details
            assert await asyncio.wait_for(raw.read(), TIMEOUT_S) == grpc.aio.EOF  # the stream is closed
            info = await pb_grpc.StageStub(c0).Info(pb.InfoRequest(), timeout=TIMEOUT_S)
            assert info.manifest_sha256 == sha

    asyncio.run(run())


def test_a_bad_token_mask_is_refused_before_any_stage_runs_the_step(workers, build_2):
    """Grammar-constrained steps carry an allowed-token bitmask for the last stage: one of the wrong shape,
    or allowing no token at some position, is refused (INVALID_ARGUMENT, at stage 0) and no stage's KV moved;
    a good one makes every candidate an allowed token, with logprobs over the allowed ones."""
    (_, a0), (_, a1) = workers[0]
    sha = workers[1]
    words = (load_manifest(build_2).manifest.architecture.vocab_size + 31) // 32

    async def run() -> None:
        for address in (a0, a1):
            await _open(address, "m", sha)
        async with grpc.aio.insecure_channel(a1) as c1, grpc.aio.insecure_channel(a0) as c0:
            results = pb_grpc.StageStub(c1).Subscribe(pb.SubscribeRequest(subscriber_id="sub"))
            assert not (await results.read()).session_id
            link = pb_grpc.StageStub(c0).Link()
            none = np.zeros((1, words), np.int32)
            for step_id, mask, problem in [(1, np.full((2, words), -1, np.int32), "shape"),
                                           (2, np.full((1, words - 1), -1, np.int32), "shape"), (3, none, "no token")]:
                await link.write(step("m", step_id, [a1], sha, token_mask=to_tensor(mask)))
                ack = await asyncio.wait_for(link.read(), TIMEOUT_S)
                assert ack.step_id == step_id and ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], ack
                assert problem in ack.details and not ack.details.startswith("stage 1")
            allowed = [5, 77, 1000, 40000]
            mask = none.copy()
            for t in allowed:
                mask[0, t >> 5] |= np.int32(1 << (t & 31)) if t & 31 != 31 else np.int32(-(1 << 31))
            await link.write(step("m", 4, [a1], sha, token_mask=to_tensor(mask), top_k=6))  # past_length 0: nothing moved
            got = await asyncio.wait_for(results.read(), TIMEOUT_S)
            assert got.step_id == 4
            ids = np.frombuffer(got.top_ids.data, np.int32)
            logprobs = np.frombuffer(got.top_logprobs.data, np.float32)
            assert sorted(ids[:4].tolist()) == allowed and np.all(np.isneginf(logprobs[4:]))
            assert np.exp(logprobs[:4]).sum() == pytest.approx(1.0, abs=1e-5)  # a distribution over the allowed
            link.cancel()
            results.cancel()

    asyncio.run(run())
