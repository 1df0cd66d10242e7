"""A ``serve --model SOURCE`` coordinator before its fleet is ready (real processes, real mDNS on loopback, real
HTTP): a worker started with another ``--secret`` is named in ``/health``'s preparing state with its refusal, and
the coordinator logs that refusal once per 10 s (counting the others), not at every 0.5 s round of Info calls."""

from __future__ import annotations

import asyncio
import logging
from contextlib import ExitStack

import pytest

from coordinator.planned_fleet import collect_capacities
from coordinator.preparing import Preparation
from fleet_common.security import Security
from tests.integration.test_shipping import serving, spawn_worker

pytestmark = pytest.mark.integration


def test_a_worker_refusing_the_secret_is_logged_once_per_10_s_and_named_in_health(tmp_path, caplog):
    (tmp_path / "theirs").write_text("the worker's secret 7c1f")
    (tmp_path / "ours").write_text("the coordinator's secret 0b9e")
    prep = Preparation("m.gguf")
    with ExitStack() as stack:
        address = serving(spawn_worker(tmp_path / "w.log", stack, "--secret", str(tmp_path / "theirs"),
                                       "--stages-dir", str(tmp_path / "stages")), empty=True)
        caplog.set_level(logging.ERROR, logger="fleet_common.security")
        with pytest.raises(TimeoutError, match="UNAUTHENTICATED"):  # 12 rounds of Info, 0.5 s apart
            asyncio.run(collect_capacities([address], Security.load(tmp_path / "ours"), expect=1, timeout_s=6,
                                           on_round=prep.heard))
    refusals = [r.getMessage() for r in caplog.records if "refused this caller's credentials" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert prep.status()["candidates"] == [{"address": address, "worker_id": None, "counted": False,
                                            "why": prep.candidates[0]["why"]}]
    assert "UNAUTHENTICATED" in prep.candidates[0]["why"], prep.candidates

