"""What a fleet looks like to its user: ``fleet-coordinator status`` and the demo's "fleet ready:" line
show a worker the coordinator refused (another build, say) as refused, with the reason, under its own
entry, never as a replica or stage of the pipeline."""

from __future__ import annotations

import importlib.util

from coordinator.cli import render_status
from tests.conftest import ROOT

REASON = ("refusing worker 10.0.0.9:7000 (stage 0, model 'other'): its manifest 0123456789ab differs from the "
          "coordinator's abcdefabcdef ('smol')")


def worker(address: str, stage: int | None, healthy: bool = True, refused: str | None = None, **info) -> dict:
    entry = {"address": address, "source": "mdns", "healthy": healthy, "refused": refused,
             "missed_health_checks": 0, "load": 0, "rtt_ms": 0.4, "seen_s_ago": 0.2, "stage": stage}
    if stage is not None:
        entry.update(worker_id=f"w-{address[-4:]}", layers=[15 * stage, 15 * stage + 15], device="CPU", sessions=0,
                     sequences=0, busy=0, kv_bytes=0, kv_reserved_bytes=0, kv_budget_bytes=1 << 30,
                     protocol_version=3, openvino_version="2025.1", manifest_sha256="abcdef", **info)
    return entry


def health(*workers: dict) -> dict:
    return {"ready": True, "model": "smol", "manifest_sha256": "abcdefabcdef00", "num_stages": 2,
            "protocol_version": 3, "missing_stages": [], "queued": 0, "running": 0, "workers": list(workers)}


FLEET = health(worker("127.0.0.1:5001", 0), worker("127.0.0.1:5002", 1),
               worker("10.0.0.9:7000", 0, healthy=False, refused=REASON), worker("10.0.0.8:7000", None, healthy=False))


def section(text: str, heading: str) -> list[str]:
    """The lines under the heading line that starts with ``heading``, up to the next heading."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return lines[start:end]


def test_status_shows_a_refused_worker_as_refused_under_its_own_entry():
    text = render_status("http://127.0.0.1:8000", FLEET)
    stage0, stage1 = section(text, "stage 0"), section(text, "stage 1")
    assert "1 of 1 replica healthy" in stage0[0], text  # the refused worker is no replica of stage 0
    assert not any("10.0.0.9" in line for line in stage0 + stage1), text
    assert not any("DOWN" in line for line in stage0 + stage1), text
    refused = section(text, "refused")
    assert [line for line in refused if "10.0.0.9:7000" in line and REASON in line], text
    waiting = section(text, "not answering yet")
    assert [line for line in waiting if "10.0.0.8:7000" in line], text


def test_status_still_shows_a_down_replica_under_its_stage():
    text = render_status("http://127.0.0.1:8000", health(worker("127.0.0.1:5001", 0), worker("127.0.0.1:5002", 1),
                                                         worker("127.0.0.1:5003", 1, healthy=False)))
    stage1 = section(text, "stage 1")
    assert "1 of 2 replicas healthy" in stage1[0], text
    assert [line for line in stage1 if "127.0.0.1:5003" in line and "DOWN" in line], text
    assert "refused" not in text


def demo():  # noqa: ANN201 - deploy/demo.py is a script, not a package
    spec = importlib.util.spec_from_file_location("fleet_demo", ROOT / "deploy" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_ready_line_lists_pipeline_stages_and_refused_workers_apart():
    text = demo().ready_text(FLEET["workers"])
    first, *rest = text.splitlines()
    assert first == "fleet ready: stage 0 @ 127.0.0.1:5001 -> stage 1 @ 127.0.0.1:5002", text
    assert rest == [f"refused: 10.0.0.9:7000: {REASON}", "not answering yet: 10.0.0.8:7000"], text


def test_a_preparing_fleet_says_so_with_its_progress():
    from coordinator.cli import render_status

    health = {"ready": False, "shutting_down": False, "model": "m.gguf", "num_stages": 0, "missing_stages": [],
              "queued": 0, "running": 0, "workers": [],
              "fleet": {"state": "preparing", "progress": "shipping stage 1 of 2 to 10.0.0.3:7070", "phase_s": 12.5,
                        "reason": "serve --model m.gguf", "layers": "0:15,15:30", "workers": [], "replans": 0,
                        "last_replan_s": None}}
    text = render_status("http://c:8000", health)
    assert "NOT READY, preparing;" in text and "missing stage" not in text
    assert ("planned fleet: preparing for 12.5 s, shipping stage 1 of 2 to 10.0.0.3:7070 (serve --model m.gguf); "
            "layers 0:15,15:30, 0 re-plan(s)") in text
