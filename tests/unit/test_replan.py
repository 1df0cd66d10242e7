"""coordinator/fleet/replan.py's rule for a worker that joins a planned fleet (issue 30 item 3): re-plan only when the
model fits now and did not, or when the planner predicts decode >= 15 % faster; computed on empty workers'
capacities (fleet_common.discovery.Capacity: memory, device, ms per GB) with the real planner."""

from __future__ import annotations

from compiler.planner import ModelDims, ModelSource
from coordinator.fleet.planned import plan_fleet
from coordinator.fleet.replan import SPEEDUP, join_decision, worth_replanning
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


class StandInRegistry:
    """What ``Replanner`` reads of a ``Registry``: stage 1's worker is gone once ``lost`` is set."""

    num_stages, missed_limit, health_interval_s = 2, 1, 0.05

    def __init__(self) -> None:
        self.lost = False
        self.workers: dict = {}

    def missing_stages(self) -> list[int]:
        return [1] if self.lost else []

    async def wait_ready(self, timeout_s: float) -> bool:
        return not self.lost


def test_a_worker_left_too_small_for_the_model_refuses_with_its_name_and_bytes(tmp_path, monkeypatch):
    """The Info round is stood in (no workers here): the one worker left answers 1400 MiB, which the demo-shaped
    model does not fit; the fleet stays up refusing with the planner's reason, and waits no longer."""
    import asyncio

    import pytest

    from coordinator.fleet import replan
    from coordinator.errors import PipelineUnavailable
    from coordinator.fleet.planned import PlannedFleet
    from coordinator.settings import CoordinatorSettings

    two = caps(a=(SMALL, 10.0), b=(SMALL, 10.0))

    async def answering(addresses, security, peers, model_id, timeout):  # noqa: ANN001, ANN202 - planned.answering
        return {"a": ("127.0.0.1:1", two["a"])}, ["127.0.0.1:2: UNAVAILABLE"]

    monkeypatch.setattr(replan, "answering", answering)

    async def run() -> tuple[str, dict]:
        registry = StandInRegistry()
        fleet = PlannedFleet(tmp_path, plan_fleet(SOURCE.dims, two), SOURCE,
                             {w: (f"127.0.0.1:{i + 1}", c) for i, (w, c) in enumerate(two.items())}, tmp_path)
        replanner = replan.Replanner(CoordinatorSettings(model=tmp_path, health_interval_s=0.05), fleet, registry)
        replanner.start()
        await asyncio.sleep(0.1)  # armed: every stage served once
        registry.lost = True
        with pytest.raises(PipelineUnavailable) as refused:
            await replanner.settle(30)
        status = replanner.status()
        await replanner.stop()
        return refused.value.message, status

    message, status = asyncio.run(run())
    assert status["state"] == "refused" and "stage 1 (of stages 0..1) has no worker left" in status["reason"]
    assert "node 'a'" in message and "MiB" in message and "short" in message, message
    assert "workers left: a at 127.0.0.1:1 (" in message, message
