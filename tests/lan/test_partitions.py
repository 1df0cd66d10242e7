"""Partitions and restarts across real interfaces (issue 18): a cable pulled mid-stream (the stream fails
over to a replica on another PC, token for token at f32, or ends with a clear error in time; the cable
back in, the worker rejoins by itself), and the coordinator killed and restarted while workers run.

One LAN for the module: PC a0 serves stage 0 of the 2-stage build, a1 and b1 stage 1; coordinators run
in ``coord`` and find the workers by zeroconf (real mDNS over the bridge)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import LanCoordinator, start_workers, stop_all

pytestmark = pytest.mark.lan

PROMPT = "Write a long story about a dragon who learns to bake bread."
TOKENS = 40
RESTARTS = 10
# the stream's longest stall when a link goes down: the health checks that notice it (interval 1 s x 3
# missed) or the step deadline (5 s), the replica's re-prefill, doubled for a loaded 2-core machine
STALL_BOUND_S = 2 * (5 + 3) + 4
OWNER_TIMEOUT_S = 5  # the workers free a coordinator's sessions this long after its last health check


@pytest.fixture(scope="module")
def site(lan, build_2, tmp_path_factory):  # noqa: ANN001, ANN201
    log_dir = tmp_path_factory.mktemp("lan-partitions")
    for pc in ("coord", "a0", "a1", "b1"):
        lan.add_pc(pc)
    lease = ("--owner-timeout-s", str(OWNER_TIMEOUT_S))
    workers = start_workers(lan, build_2, log_dir, {"a0": (0, 0, *lease), "a1": (1, 0, *lease), "b1": (1, 0, *lease)})
    yield lan, workers, log_dir
    stop_all(workers.values())


# Asked by a process of its own in PC "coord"'s namespace, not on a thread that entered it: gRPC connects on threads
# of its own, which another thread's setns does not move (a rehearsal's Info from such a thread once connected from
# the host's namespace: "Network is unreachable").
_INFO = ("import sys, grpc; from fleet_common import fleet_pb2 as pb, fleet_pb2_grpc as g; "
         "print(g.StageStub(grpc.insecure_channel(sys.argv[1])).Info(pb.InfoRequest(), timeout=10).sessions)")


def _open_sessions(lan, address: str) -> int:  # noqa: ANN001
    """The number of sessions the worker at ``address`` holds, asked from PC "coord"."""
    out = subprocess.run(lan.pcs["coord"].cmd(sys.executable, "-c", _INFO, address), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


def _stream(url: str, out: dict, progress: threading.Event, after: int) -> None:
    """Stream one greedy completion of ``PROMPT``; ``progress`` is set after ``after`` content chunks.
    ``out``: status, error (an error event), fleet (stats with the token ids), times (chunk arrivals)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out["times"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    break
                out["fleet"] = event.get("fleet") or out.get("fleet")
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    out["times"].append(time.monotonic())
                    if len(out["times"]) == after:
                        progress.set()
    except httpx.HTTPError as exc:  # the coordinator killed under the stream
        out["broken"] = repr(exc)
    finally:
        out["ended"] = time.monotonic()
        progress.set()


def _start_stream(lan, coord: LanCoordinator, after: int = 8):  # noqa: ANN001, ANN202
    out, progress = {}, threading.Event()
    future = lan.executor(coord.pc).submit(_stream, coord.url, out, progress, after)
    assert progress.wait(120), "the stream made no progress"
    return out, future


def _sessions(lan, workers) -> dict[str, int]:  # noqa: ANN001
    return {pc: _open_sessions(lan, w.address) for pc, w in workers.items()}


@pytest.fixture(scope="module")
def restarted(site, build_2) -> dict:  # noqa: ANN001
    """Ten coordinators in a row killed (SIGKILL: no goodbye; every other one mid-stream), then one more
    that must serve; the workers' sessions and memory before (after a warm-up coordinator that stopped
    cleanly) and after, and the HTTP status each coordinator's request got."""
    lan, workers, log_dir = site
    warm = LanCoordinator(lan, "coord", build_2, log_dir, name="coordinator-warm")
    try:
        warm.wait_ready(workers=3)
        for prompt in (PROMPT, "Say hi.", "Say yes.", "Say no."):  # until both stage-1 replicas served one
            assert warm.chat(prompt, max_tokens=8).status_code == 200
            time.sleep(1.2)  # a health check brings each worker's session count (placement's tie-break)
            if all(w["sessions"] for w in warm.health()["workers"]):
                break
        else:
            raise AssertionError(f"a worker was never used: {warm.health()['workers']}")
    finally:
        warm.stop()
    result = {"sessions_before": _sessions(lan, workers), "rss_before": {pc: w.rss for pc, w in workers.items()},
              "served": [], "killed_streams": []}
    for i in range(RESTARTS):
        coord = LanCoordinator(lan, "coord", build_2, log_dir, name=f"coordinator-killed{i}")
        try:
            coord.wait_ready(workers=3)
            if i % 2:
                out, future = _start_stream(lan, coord, after=2)
            else:
                result["served"].append(coord.chat(PROMPT, max_tokens=4).status_code)
        finally:
            coord.proc.kill(signal.SIGKILL)
        if i % 2:
            future.result(timeout=30)
            result["killed_streams"].append(out)
    after = LanCoordinator(lan, "coord", build_2, log_dir, name="coordinator-after")
    try:
        after.wait_ready(workers=3)
        result["served"].append(after.chat(PROMPT, max_tokens=4).status_code)
    finally:
        after.stop()
    result["sessions_after"] = _sessions(lan, workers)
    result["rss_after"] = {pc: w.rss for pc, w in workers.items()}
    print(f"LAN restarts: sessions before {result['sessions_before']}, after {result['sessions_after']}; RSS MiB "
          f"before { {pc: v >> 20 for pc, v in result['rss_before'].items()} }, after "
          f"{ {pc: v >> 20 for pc, v in result['rss_after'].items()} }")
    return result


def test_coordinator_killed_and_restarted_ten_times_the_next_one_serves(restarted):
    assert restarted["served"] == [200] * (RESTARTS // 2 + 1), restarted["served"]
    for out in restarted["killed_streams"]:  # the client sees its stream break, not a hang
        assert "broken" in out or "error" in out, out
    for pc, before in restarted["rss_before"].items():
        assert abs(restarted["rss_after"][pc] - before) <= 0.05 * before, (pc, restarted["rss_after"][pc], before)


def test_coordinator_killed_ten_times_leaves_no_sessions_on_the_workers(site, restarted):
    """A killed coordinator never closes its sessions; the workers free them once it has not
    health-checked them for --owner-timeout-s (its owner lease; OWNER_TIMEOUT_S here)."""
    lan, workers, _ = site
    deadline = time.monotonic() + OWNER_TIMEOUT_S + 10
    sessions = restarted["sessions_after"]
    while sessions != restarted["sessions_before"] and time.monotonic() < deadline:
        time.sleep(0.5)
        sessions = _sessions(lan, workers)
    assert sessions == restarted["sessions_before"], (restarted["sessions_after"], sessions)


@pytest.fixture(scope="module")
def coordinator(site, build_2):  # noqa: ANN001, ANN201
    lan, workers, log_dir = site
    coord = LanCoordinator(lan, "coord", build_2, log_dir, name="coordinator")
    try:
        coord.wait_ready(workers=3)
        yield coord
    finally:
        coord.stop()


def _healthy(coord: LanCoordinator, address: str) -> bool:
    return any(w["address"] == address and w["healthy"] for w in coord.health()["workers"])


def _wait_rejoined(coord: LanCoordinator, address: str, timeout: float = 30.0) -> float:
    start = time.monotonic()
    while not _healthy(coord, address):
        assert time.monotonic() - start < timeout, f"{address} did not rejoin in {timeout} s:\n" \
                                                   f"{coord.proc.text()[-2000:]}"
        time.sleep(0.2)
    return time.monotonic() - start


def test_cable_pulled_mid_stream_fails_over_to_a_replica_and_the_pc_rejoins(site, coordinator):
    lan, workers, _ = site
    expected = coordinator.chat(PROMPT, max_tokens=TOKENS, ignore_eos=True)
    assert expected.status_code == 200, expected.text
    expected_ids = expected.json()["fleet"]["completion_token_ids"]
    out, future = _start_stream(lan, coordinator)
    serving = [pc for pc in ("a1", "b1") if any(w["address"] == workers[pc].address and w["load"]
                                                 for w in coordinator.health()["workers"])]
    assert len(serving) == 1, coordinator.health()["workers"]
    pulled = serving[0]
    lan.link(pulled, up=False)
    down = time.monotonic()
    try:
        future.result(timeout=120)
        assert out.get("status") == 200 and "error" not in out and "broken" not in out, out
        assert out["fleet"]["completion_token_ids"] == expected_ids  # f32: token for token the no-failure run
        stall = max(b - a for a, b in zip(out["times"], out["times"][1:]))
        assert stall < STALL_BOUND_S, f"stream stalled {stall:.1f} s"
        assert "failing over" in coordinator.proc.text()
        time.sleep(max(0.0, down + 5 - time.monotonic()))  # dropped by now (3 missed checks at 1 s)
    finally:
        lan.link(pulled, up=True)
    took = _wait_rejoined(coordinator, workers[pulled].address)
    assert took < 15, took
    r = coordinator.chat(PROMPT, max_tokens=4)
    assert r.status_code == 200, r.text


def test_cable_pulled_without_a_replica_ends_the_stream_with_a_clear_error_in_time(site, coordinator):
    lan, workers, _ = site
    out, future = _start_stream(lan, coordinator, after=4)
    lan.link("a0", up=False)
    down = time.monotonic()
    try:
        future.result(timeout=120)
        assert out["ended"] - down < STALL_BOUND_S, f"the stream ended {out['ended'] - down:.1f} s after the cable"
        assert "error" in out, out
        assert "stage 0" in out["error"]["message"], out["error"]
        r = coordinator.chat(PROMPT, max_tokens=4)  # while it is out: refused at once, saying what is missing
        assert r.status_code == 503 and "stage 0" in r.text, (r.status_code, r.text)
    finally:
        lan.link("a0", up=True)
    _wait_rejoined(coordinator, workers["a0"].address)
    r = coordinator.chat(PROMPT, max_tokens=4)
    assert r.status_code == 200, r.text
