"""coordinator/planned_fleet.py on real processes (issue 30 item 2, first piece): two empty ``fleet-worker``s
on loopback (--no-announce) answer Info with their capacity; collect_capacities finds both and the planner
splits the demo-shaped model over them. Building, shipping and ``serve --model SOURCE`` are not wired yet."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import pytest

from compiler.planner import ModelDims
from coordinator.planned_fleet import collect_capacities, plan_fleet
from fleet_common.security import Security
from tests.integration.test_shipping import serving, spawn_worker
from tests.unit.test_planner import CONFIG

pytestmark = pytest.mark.integration


def test_two_empty_workers_are_collected_and_planned(tmp_path):
    with ExitStack() as stack:
        addresses = [serving(spawn_worker(tmp_path / f"w{i}.log", stack, "--cache-dir", str(tmp_path / f"c{i}")),
                             empty=True) for i in range(2)]
        found = asyncio.run(collect_capacities(addresses, Security(), expect=2, timeout_s=30))
    assert sorted(a for a, _ in found.values()) == sorted(addresses)
    assert all(c.memory_available_bytes > 0 and c.ms_per_gb > 0 for _, c in found.values())
    p = plan_fleet(ModelDims.from_config(CONFIG, "m"), {w: c for w, (_, c) in found.items()})
    assert len(p.stages) == 2 and p.stages[0].start == 0 and p.stages[-1].end == CONFIG["num_hidden_layers"]
