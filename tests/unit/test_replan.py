"""coordinator/replan.py's rule for a worker that joins a planned fleet (issue 30 item 3): re-plan only when the
model fits now and did not, or when the planner predicts decode >= 15 % faster; computed on empty workers'
capacities (fleet_common.discovery.Capacity: memory, device, ms per GB) with the real planner."""

from __future__ import annotations

from compiler.planner import ModelDims, ModelSource
from coordinator.planned_fleet import plan_fleet
from coordinator.replan import SPEEDUP, join_decision, worth_replanning
from fleet_common.discovery import Capacity
from tests.unit.test_planner import CONFIG

SOURCE = ModelSource(ModelDims.from_config(CONFIG, "m"), "fp16", "f16")
BIG, SMALL = 8 * 2**30, 1400 * 2**20  # the demo-shaped model needs 1810 MiB on one PC, 1146 on each of two


def caps(**workers: tuple[int, float]) -> dict[str, Capacity]:
    return {name: Capacity(memory, "CPU", ms_per_gb) for name, (memory, ms_per_gb) in workers.items()}


def current(**workers: tuple[int, float]):  # noqa: ANN201 - Plan
    return plan_fleet(SOURCE.dims, caps(**workers))


def test_a_third_equal_worker_speeds_decode_enough_to_replan():
    before = current(a=(BIG, 10.0), b=(BIG, 10.0))
    why, new = join_decision(SOURCE, caps(a=(BIG, 10.0), b=(BIG, 10.0), c=(BIG, 10.0)), before)
    assert new is not None and len(new.stages) == 3
    assert new.bottleneck.ms_per_token <= (1 - SPEEDUP) * before.bottleneck.ms_per_token
    assert why is not None and "faster" in why and f"{before.bottleneck.ms_per_token:.2f}" in why


def test_a_slow_worker_joining_is_not_worth_a_replan():
    before = current(a=(BIG, 10.0), b=(BIG, 10.0))
    why, new = join_decision(SOURCE, caps(a=(BIG, 10.0), b=(BIG, 10.0), slow=(BIG, 400.0)), before)
    assert new is not None and new.bottleneck.ms_per_token > (1 - SPEEDUP) * before.bottleneck.ms_per_token
    assert why is None


def test_a_worker_that_makes_the_model_fit_is_worth_a_replan():
    lone = caps(a=(SMALL, 10.0))
    assert join_decision(SOURCE, lone, None) == (None, None)  # one small PC: the model does not fit
    why, new = join_decision(SOURCE, {**lone, **caps(b=(SMALL, 10.0))}, None)
    assert new is not None and why is not None and why.startswith("the model fits the fleet now")


def test_just_under_the_threshold_keeps_the_plan():
    before = current(a=(BIG, 10.0), b=(BIG, 10.0))
    slower = plan_fleet(SOURCE.dims, caps(a=(BIG, 10.0 / (1 - SPEEDUP) * 0.99), b=(BIG, 10.0 / (1 - SPEEDUP) * 0.99)))
    assert worth_replanning(before, slower) is None  # slower: never
    faster = plan_fleet(SOURCE.dims, caps(a=(BIG, 10.0 * (1 - SPEEDUP) * 1.01), b=(BIG, 10.0 * (1 - SPEEDUP) * 1.01)))
    assert worth_replanning(before, faster) is None  # 14.85 % faster: kept
    faster = plan_fleet(SOURCE.dims, caps(a=(BIG, 10.0 * (1 - SPEEDUP) * 0.99), b=(BIG, 10.0 * (1 - SPEEDUP) * 0.99)))
    assert worth_replanning(before, faster) is not None  # 15.85 % faster: re-planned
    assert worth_replanning(before, None) is None  # a plan that does not fit never replaces one that does
