"""coordinator/fleet/planned.py on real processes (issue 30 item 2): two empty ``fleet-worker``s on loopback
(--no-announce) answer Info with their capacity; collect_capacities finds both and the planner splits the
demo-shaped model over them; the plan's build is cached; each worker is shipped only its stage; and
``fleet-coordinator serve --model SOURCE`` over them answers, and after a restart ships nothing; while it
prepares, the chat page (headless Chromium) and /health show each phase and the API answers 503."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import pytest

from compiler.planner import ModelDims
from coordinator.fleet.planned import collect_capacities, plan_fleet
from fleet_common.security import Security
from tests.integration.test_shipping import serving, spawn_worker
from tests.integration.test_web_page import browser  # noqa: F401 - the module's Chromium fixture
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
    from coordinator.fleet.planned import build_for_plan
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
    from coordinator.fleet.planned import build_for_plan, ship_plan
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
        reports = asyncio.run(ship_plan(out, by_id, Security()))
        for stage, report in enumerate(reports):
            assert report.sent_bytes > 0 and report.held_bytes == 0
            assert set(report.files) <= {f for f in json.loads((out / "manifest.json").read_text())["files"]}
            assert manifest.stages[stage].xml in report.files
            assert not any(s.xml in report.files for s in manifest.stages if s.index != stage)
        again = asyncio.run(ship_plan(out, by_id, Security()))
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


PANEL = """return [document.getElementById('fleet-plan').dataset.state || '',
                   document.getElementById('fleet-plan').textContent, document.getElementById('fleet-state').textContent,
                   document.getElementById('model-name').textContent];"""


def test_the_page_and_health_show_the_preparation_until_the_fleet_serves(tmp_path, demo_hf, browser):  # noqa: F811
    """While ``serve --model SOURCE`` collects, plans, builds and ships (coordinator/api/preparing_page.py), its port
    serves the chat page and ``/health`` (503, ``fleet.state`` preparing with each phase), and the API answers
    503 with the progress and Retry-After; then the API takes the port and the page, open all along, shows
    the fleet serving and the model's name."""
    import time

    import httpx

    from bench import harness
    from coordinator.fleet.local import free_port
    from tests.integration.test_web_page import wait_until

    with ExitStack() as stack:
        addresses = [serving(spawn_worker(tmp_path / f"w{i}.log", stack, "--cache-dir", str(tmp_path / f"c{i}"),
                                          "--stages-dir", str(tmp_path / f"s{i}")), empty=True) for i in range(2)]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = harness.spawn([*harness.tool("fleet-coordinator"), "serve", "--model", str(demo_hf), "--port", str(port),
                              "--no-announce", "--no-discover", "--draft", "none",
                              *(a for p in addresses for a in ("--peer", p)), "--build-cache-dir",
                              str(tmp_path / "builds")], tmp_path / "coordinator.log", stack)
        health = wait_until(lambda: _health(url), timeout=60, every=0.05, what="the preparing /health")
        assert health["fleet"]["state"] == "preparing" and not health["ready"], health
        refused = httpx.get(f"{url}/v1/models", timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
        assert refused.json()["error"]["code"] == "fleet_preparing"
        browser.get(url + "/")
        phases, panel = {health["fleet"]["progress"].split(" ")[0]}, []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if (h := _health(url)) and h.get("fleet", {}).get("state") == "preparing":
                phases.add(h["fleet"]["progress"].split(" ")[0])
            row = tuple(browser.execute_script(PANEL))
            if row[0] and (not panel or panel[-1] != row):
                panel.append(row)
            if row[0] == "serving" and row[3] not in ("", "…"):
                break
            time.sleep(0.1)
        assert proc.popen.poll() is None, proc.text()[-3000:]
    assert {"building", "shipping", "loading"} <= phases, phases  # collecting: over at once, the --peers being up
    shown = [p for p in panel if p[0] == "preparing"]
    assert shown and all(p[2] == "preparing" and p[1].startswith("Preparing the fleet") for p in shown), panel
    assert panel[-1][0] == "serving" and panel[-1][2] == "ready" and panel[-1][3] == "SmolLM2-135M-Instruct", panel


def _health(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
