"""A ``serve --model SOURCE`` coordinator before its fleet is ready (real processes, real mDNS on loopback, real
HTTP): a worker started with another ``--secret`` is named in ``/health``'s preparing state with its refusal, and
the coordinator logs that refusal once per 10 s (counting the others), not at every 0.5 s round of Info calls; the
coordinator is announced by zeroconf while it prepares, so ``fleet-chat`` without ``--url`` finds it and waits."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bench import harness
from coordinator.fleet.local import free_port
from coordinator.fleet.planned import collect_capacities
from coordinator.fleet.preparing import Preparation
from fleet_common.security import Security
from tests.integration.test_shipping import serving, spawn_worker

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


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


def test_a_preparing_coordinator_is_found_by_zeroconf_and_fleet_chat_waits(tmp_path, demo_hf):
    name = f"preparing-{uuid.uuid4().hex[:8]}"  # a name no other coordinator announces
    nobody = f"127.0.0.1:{free_port()}"  # the one --peer never answers: the coordinator stays collecting
    port, stack = free_port(), ExitStack()
    proc = harness.spawn([*harness.tool("fleet-coordinator"), "serve", "--model", str(harness.demo_gguf(demo_hf)),
                          "--port", str(port), "--announce", "--no-discover", "--peer", nobody, "--served-model-name",
                          name, "--workers-timeout-s", "120", "--build-cache-dir", str(tmp_path / "builds")],
                         tmp_path / "coordinator.log", stack)
    url = f"http://127.0.0.1:{port}"
    proc.wait_for(r"announced the API", 60)  # while it prepares (collecting: no --peer answers)
    try:
        deadline = time.monotonic() + 60
        # preparing, and past "starting" (reading the GGUF: 7 s and more on a loaded host) to collecting the workers
        while not (fleet := httpx.get(f"{url}/health", timeout=5).json().get("fleet", {})).get(
                "progress", "").startswith("collecting"):
            assert time.monotonic() < deadline, f"the coordinator never said it collects its workers: {fleet}"
            assert fleet.get("state") in (None, "preparing"), fleet
            time.sleep(0.5)
        run = subprocess.run([str(BIN / "fleet-chat"), "--model", name, "--wait-s", "3", "-p", "hi"],
                             capture_output=True, text=True, timeout=60)
    finally:
        stack.close()
    assert "no coordinator" not in run.stderr, run.stderr
    assert run.returncode == 2 and f"the fleet at {url} is still being prepared after 3 s" in run.stderr, run.stderr
    assert f"waiting for the fleet at {url}" in run.stderr and "collecting the empty --peer workers" in run.stderr
