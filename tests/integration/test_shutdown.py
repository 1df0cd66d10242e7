"""Stopping ``fleet-coordinator serve`` (Ctrl-C, SIGTERM): a clean shutdown with real processes.

The coordinator stops taking requests, ends the streams in flight within a bound with an SSE error
that says it is shutting down, closes the workers' sessions and exits 0 without a traceback. With
``--local-workers`` a terminal's Ctrl-C (SIGINT to the whole foreground process group) reaches only
the coordinator, which drains and then stops its workers; they never outlive it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import grpc
import httpx
import psutil
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import Fleet, start_coordinator, wait_ready

pytestmark = pytest.mark.integration

GRACE_S = 3.0  # the coordinator's default --shutdown-grace-s: streams in flight may finish within it
BOUND_S = GRACE_S + 8.0  # signal -> stream ended and process gone, with room for a loaded 2-core machine


class Stream(threading.Thread):
    """A streamed chat request that would run for minutes (large max_tokens, ignore_eos); collects its
    SSE events and when it ended."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.events, self.status, self.ended = url, [], None, None
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                "stream": True, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=300) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"content"' in line and '"content": ""' not in line:
                            self.started.set()
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events if e != "[DONE]" and "error" in json.loads(e)]


def _worker_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10).sessions


def _stream_in_flight(url: str) -> Stream:
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None and stream.status == 200, (stream.error, stream.events)
    time.sleep(0.5)  # well into decoding
    return stream


def _assert_shut_down_cleanly(proc, stream: Stream, signalled_at: float) -> None:  # noqa: ANN001 - conftest.Proc
    stream.join(BOUND_S + 5)
    assert not stream.is_alive(), "the stream must end within a bound of the signal"
    assert stream.error is None, stream.error
    assert stream.ended - signalled_at < BOUND_S, f"stream ended {stream.ended - signalled_at:.1f} s after the signal"
    errors = stream.errors()
    assert len(errors) == 1 and "shutting down" in errors[0]["message"], stream.events[-3:]
    assert errors[0]["code"] == "shutting_down"
    assert "no healthy worker" not in errors[0]["message"]
    assert stream.events[-1] == "[DONE]"
    rc = proc.popen.wait(timeout=max(1.0, signalled_at + BOUND_S - time.monotonic()))
    log = proc.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_sigint_when_idle_exits_0_quickly_without_a_traceback(build_2, tmp_path):
    fleet = Fleet(build_2, tmp_path, peers=True)
    try:
        proc = fleet.coordinator
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGINT)
        rc = proc.popen.wait(timeout=BOUND_S)
        assert time.monotonic() - t0 < 5.0, "an idle coordinator has nothing to drain"
        assert rc == 0, proc.text()[-3000:]
        assert "Traceback" not in proc.text(), proc.text()[-3000:]
    finally:
        fleet.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_ends_streams_in_flight_and_closes_sessions(build_2, tmp_path, sig):
    fleet = Fleet(build_2, tmp_path, peers=True)
    try:
        stream = _stream_in_flight(fleet.url)
        assert sum(_worker_sessions(a) for _, a in fleet.workers) > 0
        signalled_at = time.monotonic()
        fleet.coordinator.popen.send_signal(sig)
        time.sleep(0.5)
        # no new request is taken meanwhile (refused, or the listener is already closed)
        try:
            late = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=10,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        except httpx.TransportError:
            pass
        _assert_shut_down_cleanly(fleet.coordinator, stream, signalled_at)
        assert [_worker_sessions(a) for _, a in fleet.workers] == [0, 0], "the coordinator closed its sessions"
    finally:
        fleet.stop()


def _local_worker_pids(proc) -> list[int]:  # noqa: ANN001 - conftest.Proc
    return [int(p) for p in re.findall(r"local worker for stage \d+ started \(pid (\d+)", proc.text())]


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The ``pids`` still alive (zombies count as gone) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _local_fleet(build, tmp_path):  # noqa: ANN001, ANN202
    proc, url = start_coordinator(build, tmp_path, "--local-workers", "2", "--no-discover", "--worker-threads", "1",
                                  "--inference-precision", "f32")
    try:
        wait_ready(url, 120)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def test_ctrl_c_on_the_terminal_drains_then_stops_local_workers(build_2, tmp_path):
    proc, url = _local_fleet(build_2, tmp_path)
    try:
        pids = _local_worker_pids(proc)
        assert len(pids) == 2
        stream = _stream_in_flight(url)
        signalled_at = time.monotonic()
        os.killpg(proc.popen.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _assert_shut_down_cleanly(proc, stream, signalled_at)
        assert _gone(pids, 10) == [], "no local worker outlives the coordinator"
        assert "restarting in" not in proc.text(), "the workers are stopped, not restarted"
    finally:
        proc.stop()


def test_local_workers_die_with_a_killed_coordinator(build_2, tmp_path):
    proc, url = _local_fleet(build_2, tmp_path)
    try:
        pids = _local_worker_pids(proc)
        assert len(pids) == 2
        os.kill(proc.popen.pid, signal.SIGKILL)  # the coordinator alone: no chance to stop them
        proc.popen.wait(timeout=10)
        assert _gone(pids, 15) == [], "local workers must not outlive a killed coordinator"
    finally:
        proc.stop()
