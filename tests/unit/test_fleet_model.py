"""The fleet model (bench/wan/fleet_model.py) on hand-made fleets: its simulator's physics (bench/wan/fleet_sim.py:
processor sharing, fleet-wan timers, the benchmark's window), its calibration and draft deconvolution on a
synthetic sweep, the paper checks; and bench/wan/sweep.py's pooling of repeated runs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench.wan import fleet_model as fm
from bench.wan import fleet_sim as sim


def _flat(ms: float):  # noqa: ANN202 - a stage curve
    return lambda seq: ms


def test_separate_pcs_step_is_the_sum_of_compute_and_hops():
    # 2 PCs, one user: a step = both stages' compute + 3 hops of (delay + overhead), nothing shared
    fleet = sim.Fleet(stage_ms=(_flat(10.0), _flat(10.0)), stage_core=(0, 1), hidden_size=64, delay_ms=5.0,
                     hop_ms=1.0)
    assert sim.simulate(fleet, steps_per_user=50)["tok_s"] == pytest.approx(1000 / (20 + 3 * 6), rel=1e-3)


def test_processor_sharing_and_unpinned_work():
    machine = sim.Machine(2)
    done: dict[str, float] = {}
    machine.work(0, 10.0, lambda: done.setdefault("a", machine.now))
    machine.work(0, 10.0, lambda: done.setdefault("b", machine.now))
    machine.work(None, 4.0, lambda: done.setdefault("float", machine.now))  # goes to the idle core
    machine.run()
    assert done["a"] == pytest.approx(20.0) and done["b"] == pytest.approx(20.0)  # two jobs, half speed each
    assert done["float"] == pytest.approx(4.0)


def test_shared_cores_only_when_asked():
    # two users on 2 stages: on separate PCs the hop overhead is a latency and the users' steps
    # overlap freely; on one 2-core machine it is work that competes with the stages for the cores
    base = sim.Fleet(stage_ms=(_flat(10.0),) * 2, stage_core=(0, 1), hidden_size=64, hop_ms=8.0, hop_work_ms=8.0,
                    users=2)
    pcs = sim.simulate(base)["tok_s"]
    assert pcs == pytest.approx(2 * 1000 / (20 + 3 * 8), rel=0.02)  # two users, twice one user's rate
    assert sim.simulate(replace(base, shared_cores=2))["tok_s"] < 0.9 * pcs
    one = replace(base, users=1)
    # one user on a shared machine: nothing else runs, the hop overhead is as fast as a latency
    assert sim.simulate(replace(one, shared_cores=2))["tok_s"] == pytest.approx(sim.simulate(one)["tok_s"], rel=1e-3)


def test_fleet_wan_timer_rounds_up_to_whole_milliseconds():
    assert sim.timer_release(0.010, 0.0) == 0.010  # due before the loop looks: no timer
    assert sim.timer_release(0.019, 0.0) == pytest.approx(sim.LINK_TIMER_EPS_MS[False] + 1)
    assert sim.timer_release(10.0 + 0.04, 10.0) == pytest.approx(sim.LINK_TIMER_EPS_MS[True] + 11)
    assert sim.timer_release(10.0 + 0.02, 10.0) == pytest.approx(sim.LINK_TIMER_EPS_MS[True] + 10)


def test_bench_window_counts_whole_steps():
    # 24 tokens: the first from the prefill, then 23 at 6 per verify step take 4 steps, not 3.83
    fleet = sim.Fleet(stage_ms=(_flat(10.0), _flat(10.0)), stage_core=(0, 1), hidden_size=64, k=5.0,
                     tokens_per_step=6.0, bench_tokens=24)
    assert sim.simulate(fleet)["tok_s"] == pytest.approx(23 / (4 * 20.0) * 1000, rel=1e-6)
    # plain steps (adaptive K decoding without drafts) emit one token each
    half = replace(fleet, verify_share=0.5)
    assert sim.simulate(half)["tok_s"] < sim.simulate(fleet)["tok_s"]


def _synthetic_sweep(hop_ms: float, draft_service_ms: float, speed: float = 1.0) -> dict:
    """Cells 'measured' by the model itself with a known hop overhead, draft service time and speed."""
    profile = {"seqs": list(range(1, 10)), "stage_ms": [[12.0 + s for s in range(9)], [10.0 + s for s in range(9)]],
               "draft_seqs": [1, 2, 48], "draft_ms": [8.0, 9.0, 60.0]}
    sweep = {"tokens": 24, "hidden_size": 576, "machine": {"nproc": 2}, "stage_profiles": {"2": profile},
             "prompt_tokens": [40, 46], "cells": []}
    modes = {"naive": (1, False), "+spec": (1, True), "+interleave": (2, False), "full stack": (2, True)}
    for rate in (1000.0, 20.0):
        for delay in (0.0, 10.0, 50.0):
            for mode, (users, spec) in modes.items():
                cell = {"stages": 2, "rate_mbit": rate, "delay_ms": delay, "mode": mode, "users": users,
                        "speculation": spec, "mean_k": 2.0 if spec else 0.0, "tokens_per_step": 3.0 if spec else 1.0,
                        "draft_ms_per_token": draft_service_ms if spec else None, "tok_s": 1.0}
                fleet = fm.local_fleet(profile, cell, sweep, hop_ms, speed)
                if spec:
                    fleet = replace(fleet, draft_ms_per_token=draft_service_ms)
                result = sim.simulate(fleet)
                cell["tok_s"] = result["tok_s"]
                if spec:  # what the coordinator reports: wall time per drafted token, queueing included
                    cell["draft_ms_per_token"] = result["draft_wall_ms_per_token"]
                sweep["cells"].append(cell)
    return sweep


def test_validate_recovers_the_hop_overhead_and_the_draft_service_time():
    sweep = _synthetic_sweep(hop_ms=4.0, draft_service_ms=20.0)
    cells = fm.validate(sweep)
    assert {round(c["hop_ms"], 2) for c in cells} == {4.0} and {c["speed"] for c in cells} == {1.0}
    assert all(abs(c["error"]) < 1e-3 for c in cells if c["mode"] != "full stack")
    full = [c for c in cells if c["mode"] == "full stack"]
    assert all(c["draft_ms_per_token"] > 20.2 for c in full)  # two users queue for the one draft thread
    # the wait depends on how the two users' steps align, so another service time may explain the same
    # wall time: the deconvolution is exact on most cells and a few percent off on the others
    assert sum(c["draft_service_ms"] == pytest.approx(20.0, rel=0.01) for c in full) >= len(full) // 2
    assert all(abs(c["error"]) < 0.05 for c in full)


def test_validate_calibrates_a_machine_faster_than_its_profile():
    # runs 25% faster than the profile with no hop overhead: no hop >= 0 fits at the profile's speed,
    # so the calibration finds the speed (naive cells alone hardly tell speed from hop otherwise)
    sweep = _synthetic_sweep(hop_ms=0.0, draft_service_ms=20.0, speed=1.25)
    cells = fm.validate(sweep)
    assert all(c["speed"] == pytest.approx(1.25) for c in cells)
    assert all(abs(c["error"]) < 1e-3 for c in cells if c["mode"] != "full stack")


def test_paper_checks_and_predictions():
    checks = {c["case"]: c for c in fm.paper_checks()}
    for case in ("8B, 1 node, 1 stream", "8B, 2 nodes, 2 streams, spec K=3"):
        assert checks[case]["model_tok_s"] == pytest.approx(checks[case]["paper_tok_s"], rel=0.15)
    rows = fm.predictions()
    assert {(r["model"], r["nodes"]) for r in rows} >= {("Llama-3.1-8B", n) for n in range(1, 5)} | {
        ("Llama-3.1-70B", n) for n in range(4, 9)}
    assert all(math.isfinite(r["tok_s"]) and r["tok_s"] > 0 for r in rows)


def test_wan_sweep_pools_repeated_runs():
    from bench.wan.sweep import pool_runs

    runs = [{"tok_s": t, "ttft_ms": 200.0 + t, "drafted": 10, "accepted": 9, "verify_steps": 5, "plain_steps": 1,
             "draft_ms": 250.0} for t in (20.0, 25.0, 22.0)]
    cell = pool_runs(runs)
    assert cell["tok_s"] == 22.0 and cell["runs"] == 3 and cell["tok_s_runs"] == [20.0, 25.0, 22.0]
    assert cell["tok_s_spread"] == pytest.approx(5 / 22)
    assert cell["mean_k"] == 2.0 and cell["tokens_per_step"] == pytest.approx((27 + 15) / 15)
    assert cell["acceptance_rate"] == 0.9 and cell["draft_ms_per_token"] == 25.0
    assert cell["verify_steps"] == 15 and cell["plain_steps"] == 3
