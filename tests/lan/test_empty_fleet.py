"""A fleet with nothing set up on the PCs (issue 30) across real interfaces: PCs in their own network namespaces
on one bridge, empty ``fleet-worker``s (no --shard/--model) found by zeroconf (real mDNS, no --peer), and a
coordinator on its own PC, the only one with the model (the demo's Q4_1 GGUF), that plans over them, builds,
ships each its stage and serves.

In order: the three-PC fleet answers as a static fleet of the same build does (f32, token ids); one worker
killed (SIGKILL), the fleet re-plans over the two left and answers the same; a fourth PC joins and the fleet
re-plans over it; then every process restarts and the workers serve from their stage caches: nothing is sent.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import pytest

from bench import harness
from fleet_common.manifest import MANIFEST_NAME, load_manifest
from tests.conftest import Fleet, chat
from worker.stage_cache import stage_files

from .conftest import LanCoordinator, LanWorker, stop_all

pytestmark = pytest.mark.lan

PROMPT = "Name three colours of the rainbow."
TOKENS = 16


def fleet_key(log_dir: Path) -> str:
    """The fleet's key file under ``log_dir`` (made once): an empty worker on 0.0.0.0 takes stages only from a
    coordinator holding it (issue 45), so every PC gets it, as the README says."""
    key = log_dir / "fleet.key"
    if not key.is_file():
        key.write_text(secrets.token_urlsafe(32))
    return str(key)


def empty_worker(lan, pc: str, log_dir: Path, run: int = 0) -> LanWorker:  # noqa: ANN001 - tests.lan.netns.Lan
    """An empty worker on PC ``pc`` with its stage and model caches under ``log_dir/<pc>`` (kept across runs)."""
    home = log_dir / pc
    return LanWorker(lan, pc, None, -1, log_dir, "--stages-dir", str(home / "stages"), "--cache-dir",
                     str(home / "ov"), "--secret", fleet_key(log_dir), log_name=f"worker-{pc}-empty-{run}.log")


def coordinator(lan, gguf: Path, log_dir: Path, run: int) -> LanCoordinator:  # noqa: ANN001
    """``serve --model GGUF`` on PC ``coord``, by mDNS, once three empty workers answer."""
    return LanCoordinator(lan, "coord", gguf, log_dir, "--expect-workers", "3", "--build-cache-dir",
                          str(log_dir / "builds"), "--workers-timeout-s", "120", "--secret", fleet_key(log_dir),
                          name=f"coordinator-{run}")


def answer_ids(coord: LanCoordinator) -> list[int]:
    r = coord.chat(PROMPT, max_tokens=TOKENS, ignore_eos=True)
    assert r.status_code == 200, r.text
    return r.json()["fleet"]["completion_token_ids"]


def wait_fleet(coord: LanCoordinator, replans: int, stages: int, timeout: float = 240.0) -> dict:
    """/health once the fleet serves again after ``replans`` re-plans with ``stages`` stages, every one served."""
    deadline, health = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        health = coord.health()
        fleet = health.get("fleet") or {}
        if health["ready"] and fleet.get("replans") == replans and health["num_stages"] == stages:
            return health
        time.sleep(0.5)
    raise TimeoutError(f"no re-plan {replans} to {stages} stages in {timeout} s: {health}\n{coord.proc.text()[-3000:]}")


@pytest.fixture(scope="module")
def office(lan, demo_hf, tmp_path_factory):  # noqa: ANN001, ANN201
    """The LAN (PCs coord, w0, w1, w2; w3 joins later), the demo GGUF and the log folder."""
    for pc in ("coord", "w0", "w1", "w2", "w3"):
        lan.add_pc(pc)
    return lan, harness.demo_gguf(demo_hf), tmp_path_factory.mktemp("lan-empty-fleet")


def test_empty_pcs_are_planned_shipped_replanned_and_restarted_from_their_caches(office, tmp_path):
    lan, gguf, log_dir = office
    workers = {pc: empty_worker(lan, pc, log_dir) for pc in ("w0", "w1", "w2")}
    coord = None
    try:
        for w in workers.values():
            w.ready()
        coord = coordinator(lan, gguf, log_dir, 0)
        health = coord.wait_ready(timeout=300, workers=3)
        log = coord.proc.text()
        assert health["num_stages"] == 3 and health["fleet"]["state"] == "serving", health
        assert all(w["source"] == "mdns" for w in health["workers"]), health["workers"]
        assert log.count(": sent ") == 3 and "0.0 MB already held" in log, log[-3000:]
        planned = answer_ids(coord)
        builds = [d for d in (log_dir / "builds" / "builds").iterdir() if (d / "manifest.json").is_file()]
        assert len(builds) == 1, builds
        (tmp_path / "static").mkdir()
        with Fleet(builds[0], tmp_path / "static", peers=True) as static:  # the same build, --shard workers
            r = chat(static.url, PROMPT, max_tokens=TOKENS, ignore_eos=True)
            assert r.status_code == 200, r.text
            assert r.json()["fleet"]["completion_token_ids"] == planned
        manifest = load_manifest(builds[0])
        for h in health["workers"]:  # each PC's stage cache holds its own stage's files only, complete
            pc = next(pc for pc in workers if h["address"].split(":")[0] == lan.pcs[pc].address)
            held = log_dir / pc / "stages" / manifest.sha256
            files = {str(f.relative_to(held)) for f in held.rglob("*") if f.is_file()} - {MANIFEST_NAME}
            assert files == set(stage_files(manifest.manifest, h["stage"])), (pc, h["stage"], files)

        # a PC leaves for good: the fleet re-plans over the two left
        victim = next(pc for pc, w in workers.items()
                      if any(h["stage"] == 1 and h["address"].split(":")[0] == lan.pcs[pc].address
                             for h in health["workers"]))
        workers.pop(victim).proc.kill()
        health = wait_fleet(coord, replans=1, stages=2)
        assert not any(a.startswith(lan.pcs[victim].address + ":") for a in health["fleet"]["workers"]), health
        assert answer_ids(coord) == planned

        # a fourth PC joins: three equal workers decode faster than two, so the fleet re-plans over it
        workers["w3"] = empty_worker(lan, "w3", log_dir)
        workers["w3"].ready()
        health = wait_fleet(coord, replans=2, stages=3)
        assert any(a.startswith(lan.pcs["w3"].address + ":") for a in health["fleet"]["workers"]), health
        assert re.search(r"worker\(s\) \S+ joined: decode [\d.]+ -> [\d.]+ ms per token", coord.proc.text())
        assert answer_ids(coord) == planned
        layers = health["fleet"]["layers"]

        # everything restarts: the workers hold their stages, the coordinator its build; nothing is sent
        coord.stop()
        stop_all(workers.values())
        workers = {pc: empty_worker(lan, pc, log_dir, run=1) for pc in workers}
        for w in workers.values():
            w.ready()
        coord = coordinator(lan, gguf, log_dir, 1)
        health = coord.wait_ready(timeout=180, workers=3)
        log = coord.proc.text()
        assert health["fleet"]["layers"] == layers and "built layers" not in log, log[-3000:]
        assert log.count(" sent 0.0 MB") == 3, log[-3000:]
        assert answer_ids(coord) == planned
    finally:
        if coord is not None:
            coord.stop()
        stop_all(workers.values())
