"""Least-loaded placement over replicas on a real fleet (stage 0 once, stage 1 twice): the load the
coordinator counts per worker (``/health`` ``load``, "this coordinator's requests now" in
``fleet-coordinator status``) is the requests running there now, so it returns to 0 once requests
end, batch groups or not, and concurrent requests spread over the replicas, even after one of them
restarted (its old pipelines, with their sessions, are gone; the other replica's must not keep
counting requests that ended long ago)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration


def loads(url: str) -> dict[str, int]:
    """{worker address: this coordinator's requests there now}, from /health."""
    return {w["address"]: w["load"] for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]}


def stream(url: str, started: threading.Event, release: threading.Event) -> None:
    """Stream a long greedy completion: set ``started`` at its first token, hang up once ``release`` is set."""
    body = {"messages": [{"role": "user", "content": "Count from one to one hundred."}], "temperature": 0,
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("choices", [{}])[0].get("delta", {}).get("content"):
                started.set()
            if release.is_set():
                break


def wait_for(predicate, what: str, timeout: float = 30.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


@pytest.fixture
def replicated(build_2, tmp_path):
    """Stage 0 once, stage 1 on two workers (the second on a fixed port, so it can restart in place), and a
    coordinator that knows them as peers; yields (url, stage-1 addresses, restart function)."""
    procs = {}
    procs["s0"], a0 = start_worker(build_2, 0, tmp_path, "--no-announce")
    procs["s1a"], a1 = start_worker(build_2, 1, tmp_path, "--no-announce", name="a")
    procs["s1b"], b1 = start_worker(build_2, 1, tmp_path, "--no-announce", name="b")
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", "--peer", a0, "--peer", a1,
                                         "--peer", b1, "--health-interval-s", "0.3")
    procs["coordinator"] = coordinator

    def restart_b() -> None:
        old = next(w["worker_id"] for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]
                   if w["address"] == b1)
        procs["s1b"].kill()
        procs["s1b"], _ = start_worker(build_2, 1, tmp_path, "--no-announce", port=int(b1.rsplit(":", 1)[1]),
                                       name="b2")
        wait_for(lambda: any(w["address"] == b1 and w["healthy"] and w.get("worker_id") not in (None, old)
                             for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]),
                 "the restarted replica to rejoin")

    try:
        wait_ready(url)
        yield url, (a1, b1), restart_b
    finally:
        for proc in procs.values():
            proc.stop()


def test_load_returns_to_zero_and_concurrent_requests_spread(replicated):
    url, stage1, restart_b = replicated
    for _ in range(6):  # one after another: each decodes in a batch group (the default)
        r = chat(url, "Name three colors.", max_tokens=12, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["fleet"]["batch_max"] >= 1  # it did join a group
    assert set(loads(url).values()) == {0}, loads(url)  # nothing runs: no requests counted anywhere

    restart_b()  # the case: the restarted replica must not take every new request
    started = [threading.Event(), threading.Event()]
    release = threading.Event()
    threads = [threading.Thread(target=stream, args=(url, s, release)) for s in started]
    try:
        for t in threads:
            t.start()
        for s in started:
            assert s.wait(60)
        now = loads(url)
        assert [now[a] for a in stage1] == [1, 1], now  # one request on each stage-1 replica
        assert sum(now.values()) == 4, now  # and both on the one stage-0 worker
    finally:
        release.set()
        for t in threads:
            t.join(60)
    wait_for(lambda: set(loads(url).values()) == {0}, "every load to return to 0", 10)
