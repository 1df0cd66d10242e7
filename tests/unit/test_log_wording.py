"""What the logs of a fleet with nothing on the PCs say (real objects, no mocks): stage indices named with their
range; an empty worker joining a ``serve --model SOURCE`` fleet is told as planned in (INFO), a static fleet's as
waiting for a shipped stage; a missing stage's advice per mode (no ``--shard`` for a planned fleet); a worker's log
lines name the stage it loaded, not ``empty``."""

from __future__ import annotations

import io
import logging

import pytest

from coordinator.errors import stages_phrase
from coordinator.engine.pipeline import Channels
from coordinator.fleet.registry import Registry
from fleet_common import PROTOCOL_VERSION
from fleet_common import fleet_pb2 as pb
from fleet_common.manifest import load_manifest
from fleet_common.security import Security
from tests.conftest import MODELS
from worker.log_role import RoleFilter, set_role


def test_stage_indices_say_what_they_are():
    assert stages_phrase([1], 3) == "stage 1 (of stages 0..2)"
    assert stages_phrase([0, 2], 4) == "stages 0, 2 (of stages 0..3)"


@pytest.fixture
def registry():
    build = next((p for p in MODELS.glob("smollm2-2stage*") if (p / "manifest.json").is_file()), None)
    if build is None:
        pytest.skip("no 2-stage demo build under models/test (built by the integration tests)")
    return Registry(load_manifest(build), Channels(Security()))


def test_an_empty_worker_and_a_missing_stage_are_worded_per_mode(registry):
    empty = pb.InfoReply(protocol_version=PROTOCOL_VERSION, empty=True, memory_available_bytes=4 << 30,
                         device="CPU", ms_per_gb=5.0)
    assert "not used until a stage of this build is shipped" in registry.refusal("10.0.0.2:50051", empty)
    assert "fleet-worker --shard 1" in registry.missing_message([1])
    registry.planned = True
    assert "plans it in" in registry.refusal("10.0.0.2:50051", empty)
    message = registry.missing_message([1])
    assert "stage 1 (of stages 0..1)" in message and "--shard" not in message and "re-plans" in message


def test_a_workers_log_lines_name_the_stage_it_loaded():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("worker[%(worker_role)s] %(message)s"))
    handler.addFilter(RoleFilter())
    log = logging.getLogger("test_log_wording")
    log.addHandler(handler)
    try:
        set_role("empty")
        log.warning("before")
        set_role("1")  # as LoadStage does
        log.warning("after")
    finally:
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == ["worker[empty] before", "worker[1] after"]


def test_a_worker_that_does_not_prove_the_secret_is_refused_by_the_health_check(registry):
    """With --secret the health check's Info carries a challenge; a worker whose answer proves no key (any host
    on the LAN without it, static or empty) is refused: no request goes through it."""
    served = pb.InfoReply(protocol_version=PROTOCOL_VERSION, manifest_sha256=registry.loaded.sha256, stage=0)
    assert registry.refusal("10.0.0.3:50051", served, proven=True) is None
    refused = registry.refusal("10.0.0.3:50051", served, proven=False)
    assert "10.0.0.3:50051" in refused and "does not hold this fleet's --secret" in refused
