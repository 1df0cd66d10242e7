"""coordinator/planned_fleet.py: empty workers' capacities become planner nodes and a plan; a too-small
fleet is refused naming the worker; the build key follows source, ranges and weights."""

from __future__ import annotations

import pytest

from compiler.planner import ModelDims, PlanRefused
from coordinator.planned_fleet import build_key, nodes_from_capacities, plan_fleet
from fleet_common.discovery import Capacity
from tests.unit.test_planner import CONFIG

DIMS = ModelDims.from_config(CONFIG, "m")


def test_capacities_plan_the_faster_worker_more_layers():
    caps = {"pc-a": Capacity(8 * 2**30, "CPU", 10.0), "pc-b": Capacity(8 * 2**30, "CPU", 20.0)}
    nodes = nodes_from_capacities(caps, DIMS)
    assert [n.name for n in nodes] == ["pc-a", "pc-b"]
    assert nodes[0].ms_per_layer == pytest.approx(10.0 * DIMS.layer_params * 2 / 1e9)
    p = plan_fleet(DIMS, caps)
    a, b = p.stages
    assert a.end - a.start > b.end - b.start


def test_too_small_worker_is_refused_by_name():
    caps = {"pc-a": Capacity(8 * 2**30, "CPU", 10.0), "pc-tiny": Capacity(2**20, "CPU", 10.0)}
    with pytest.raises(PlanRefused) as exc:
        plan_fleet(DIMS, caps)
    assert exc.value.node == "pc-tiny" and exc.value.shortfall_bytes > 0


def test_build_key():
    assert build_key("ab", "0-14,15-29", "fp16") == build_key("ab", "0-14,15-29", "fp16")
    assert build_key("ab", "0-14,15-29", "fp16") != build_key("ab", "0-13,14-29", "fp16")
    assert build_key("ab", "0-14,15-29", "fp16") != build_key("ab", "0-14,15-29", "int8")


def test_collect_times_out_naming_what_was_not_found():
    import asyncio
    import socket

    from coordinator.planned_fleet import collect_capacities
    from fleet_common.security import Security

    with socket.socket() as s:  # a free port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError) as exc:
        asyncio.run(collect_capacities([address], Security(), expect=1, timeout_s=0.5))
    assert "expected 1 empty workers, 0 answered" in str(exc.value) and address in str(exc.value)
