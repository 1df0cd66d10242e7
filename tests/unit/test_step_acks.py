"""What a failed step's ``LinkAck`` is taken for (coordinator/engine/pipeline.py ``Pipeline.ack_failure``): the
innermost stage a relayed failure names is blamed; a stage that reports the step's deadline passed at it answered,
so it is slow, not lost (no stage named, so the engine neither re-checks nor fails over from it)."""

from __future__ import annotations

import grpc

from coordinator.engine.pipeline import Pipeline, queued_deadline_s
from fleet_common import fleet_pb2 as pb

ADDRESSES = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]


def ack(code: grpc.StatusCode, details: str) -> pb.LinkAck:
    return pb.LinkAck(session_id="s", step_id=1, code=code.value[0], details=details)


def test_a_stage_that_ran_past_the_deadline_is_slow_not_lost():
    pipeline = Pipeline(ADDRESSES, channels=None, manifest_sha256="x")
    for details, stage in [("stage 0: the step's deadline passed before it could be passed on", 0),
                           (f"stage 1 at {ADDRESSES[1]}: stage 1: the step's deadline passed before it could be "
                            "passed on", 1)]:
        failure = pipeline.ack_failure(ack(grpc.StatusCode.DEADLINE_EXCEEDED, details))
        assert failure.stage is None and failure.address is None, failure.summary
        assert f"past its deadline at stage {stage}" in failure.message and "send the request again" in failure.message
        assert "(worker" not in failure.message and "stopped answering" not in failure.message


def test_a_stage_that_cannot_reach_the_next_one_blames_the_innermost():
    pipeline = Pipeline(ADDRESSES, channels=None, manifest_sha256="x")
    relayed = f"stage 1 at {ADDRESSES[1]}: stage 2 at {ADDRESSES[2]}: the link broke"
    failure = pipeline.ack_failure(ack(grpc.StatusCode.UNAVAILABLE, relayed))
    assert (failure.stage, failure.address) == (2, ADDRESSES[2])
    assert f"stage 2 (worker {ADDRESSES[2]}) stopped answering" in failure.message
    failure = pipeline.ack_failure(ack(grpc.StatusCode.INTERNAL, "stage 0: inference failed: boom"))
    assert (failure.stage, failure.address) == (0, ADDRESSES[0]) and "failed a pipeline step" in failure.message


def test_deadlines_count_the_steps_in_flight_ahead():
    """A step or KV operation waits at each stage behind the steps in flight: its deadline is the configured one
    (or 4 x the slowest recent step, where longer) once for each of them and once for itself, plus the links'
    round trips."""
    assert queued_deadline_s(5.0, slowest_s=0.0, in_flight=0, link_rtt_s=0.0) == 5.0
    assert queued_deadline_s(5.0, slowest_s=2.0, in_flight=0, link_rtt_s=0.0) == 8.0  # a slow PC: 4 x 2 s leads
    assert queued_deadline_s(5.0, slowest_s=2.0, in_flight=2, link_rtt_s=0.0) == 24.0  # two steps ahead
    assert queued_deadline_s(5.0, slowest_s=0.5, in_flight=2, link_rtt_s=0.25) == 15.5  # each link crossed once
