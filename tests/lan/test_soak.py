"""The long run of issue 18 (opt-in: ``FLEET_LAN_SOAK_REQUESTS=500``): 3- and 4-stage fleets across PCs,
that many requests each with idle gaps longer than gRPC's keepalive every 50: no stall, every request
answered or cleanly refused. The default suite runs a short variant (test_discovery.py, 30 requests)."""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import demo_build

from .conftest import LanCoordinator, start_workers, stop_all

REQUESTS = int(os.environ.get("FLEET_LAN_SOAK_REQUESTS", "0"))
GAP_EVERY = 50
KEEPALIVE_S = 10.0  # fleet_common.wire.GRPC_OPTIONS' grpc.keepalive_time_ms

pytestmark = [pytest.mark.lan,
              pytest.mark.skipif(not REQUESTS, reason="long LAN soak: set FLEET_LAN_SOAK_REQUESTS (e.g. 500)")]


@pytest.mark.parametrize("stages", [3, 4])
def test_many_requests_with_idle_gaps_across_pcs(stages, lan, demo_hf, early_exit_draft, tmp_path):
    build = demo_build(demo_hf, stages, ("self-int4", str(early_exit_draft)))
    names = [f"s{stages}w{i}" for i in range(stages)]
    for pc in (f"s{stages}coord", *names):
        lan.add_pc(pc)
    workers = start_workers(lan, build, tmp_path, {pc: i for i, pc in enumerate(names)})
    coord = LanCoordinator(lan, f"s{stages}coord", build, tmp_path)
    try:
        coord.wait_ready(workers=stages)
        pool, statuses, slowest = lan.executor(coord.pc), [], 0.0

        def one(i: int) -> tuple[int, float]:
            start = time.monotonic()
            r = coord.chat(f"Count to {i % 7 + 2}.", max_tokens=4)
            assert r.status_code == 200 or (r.status_code in (429, 503) and r.json()["error"]["message"]), r.text
            return r.status_code, time.monotonic() - start

        for burst in range(0, REQUESTS, GAP_EVERY):
            if burst:
                time.sleep(KEEPALIVE_S + 2)
            for f in [pool.submit(one, i) for i in range(burst, min(burst + GAP_EVERY, REQUESTS))]:
                status, took = f.result(timeout=120)
                statuses.append(status)
                slowest = max(slowest, took)
        print(f"LAN soak, {stages} stages: {len(statuses)} requests, {statuses.count(200)} answered, "
              f"slowest {slowest:.2f} s")
        assert statuses.count(200) == REQUESTS, statuses
    finally:
        coord.stop()
        stop_all(workers.values())
