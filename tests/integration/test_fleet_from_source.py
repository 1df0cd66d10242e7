"""coordinator/planned_fleet.py on real processes (issue 30 item 2): two empty ``fleet-worker``s on loopback
(--no-announce) answer Info with their capacity; collect_capacities finds both and the planner splits the
demo-shaped model over them; the plan's build is cached; each worker is shipped only its stage; and
``fleet-coordinator serve --model SOURCE`` over them answers, and after a restart ships nothing."""

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
        addresses = [serving(spawn_worker(tmp_path / f"w{i}.log", stack, "--cache-dir", str(tmp_path / f"c{i}"),
                                          "--stages-dir", str(tmp_path / f"s{i}")),
                             empty=True) for i in range(2)]
        found = asyncio.run(collect_capacities(addresses, Security(), expect=2, timeout_s=30))
    assert sorted(a for a, _ in found.values()) == sorted(addresses)
    assert all(c.memory_available_bytes > 0 and c.ms_per_gb > 0 for _, c in found.values())
    p = plan_fleet(ModelDims.from_config(CONFIG, "m"), {w: c for w, (_, c) in found.items()})
    assert len(p.stages) == 2 and p.stages[0].start == 0 and p.stages[-1].end == CONFIG["num_hidden_layers"]


def test_build_for_plan_is_cached_by_source_plan_and_weights(tmp_path, demo_hf):
    import time

    from compiler.planner import read_model
    from coordinator.planned_fleet import build_for_plan
    from fleet_common.discovery import Capacity
    from fleet_common.manifest import load_manifest

    dims = read_model(demo_hf).dims
    p = plan_fleet(dims, {"pc-a": Capacity(4 * 2**30, "CPU", 10.0), "pc-b": Capacity(4 * 2**30, "CPU", 10.0)})
    out = build_for_plan(demo_hf, p, tmp_path)
    stages = load_manifest(out).manifest.stages
    assert [(s.start, s.end) for s in stages] == [(s.start, s.end) for s in p.stages]
    stamp = (out / "manifest.json").stat().st_mtime_ns
    t0 = time.monotonic()
    assert build_for_plan(demo_hf, p, tmp_path) == out  # the same plan again: nothing built
    assert (out / "manifest.json").stat().st_mtime_ns == stamp and time.monotonic() - t0 < 30


def test_ship_plan_sends_each_worker_only_its_stage_then_nothing(tmp_path, demo_hf):
    import json

    from compiler.planner import read_model
    from coordinator.planned_fleet import build_for_plan, ship_plan
    from fleet_common.manifest import load_manifest

    with ExitStack() as stack:
        addresses = [serving(spawn_worker(tmp_path / f"w{i}.log", stack, "--cache-dir", str(tmp_path / f"c{i}"),
                                          "--stages-dir", str(tmp_path / f"s{i}")),
                             empty=True) for i in range(2)]
        found = asyncio.run(collect_capacities(addresses, Security(), expect=2, timeout_s=30))
        p = plan_fleet(read_model(demo_hf).dims, {w: c for w, (_, c) in found.items()})
        out = build_for_plan(demo_hf, p, tmp_path / "coord")
        by_id = [found[s.node.name][0] for s in p.stages]
        manifest = load_manifest(out).manifest
        reports = asyncio.run(ship_plan(out, by_id, Security(), progress=False))
        for stage, report in enumerate(reports):
            assert report.sent_bytes > 0 and report.held_bytes == 0
            assert set(report.files) <= {f for f in json.loads((out / "manifest.json").read_text())["files"]}
            assert manifest.stages[stage].xml in report.files
            assert not any(s.xml in report.files for s in manifest.stages if s.index != stage)
        again = asyncio.run(ship_plan(out, by_id, Security(), progress=False))
        assert [r.sent_bytes for r in again] == [0, 0]
        print("ship MB/s:", [round(r.mb_per_s, 1) for r in reports])


def test_serve_model_source_over_empty_workers_then_restart_ships_nothing(tmp_path, demo_hf):
    import time

    from tests.conftest import chat, start_coordinator, wait_ready

    with ExitStack() as stack:
        texts = []
        for run in range(2):  # the second: the workers restarted empty, their caches holding the stages
            addresses = [serving(spawn_worker(tmp_path / f"w{run}{i}.log", stack, "--cache-dir",
                                              str(tmp_path / f"c{i}"), "--stages-dir", str(tmp_path / f"s{i}")),
                                 empty=True) for i in range(2)]
            peers = [arg for a in addresses for arg in ("--peer", a)]
            t0 = time.monotonic()
            (tmp_path / f"coord{run}").mkdir()
            proc, url = start_coordinator(demo_hf, tmp_path / f"coord{run}", "--no-discover", *peers,
                                          "--build-cache-dir", str(tmp_path / "builds"))
            wait_ready(url, 120, proc)
            reply = chat(url, "Say hi.", max_tokens=8)
            print(f"run {run}: empty workers to first answer {time.monotonic() - t0:.1f} s")
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["message"]["content"])
            if run == 1:
                assert proc.text().count("stage 0: sent 0.0 MB") == 1 and "stage 1: sent 0.0 MB" in proc.text()
            proc.stop()
            stack.close()
        assert texts[0] == texts[1] and texts[0]
