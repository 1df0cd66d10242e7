"""A bounded soak on real processes: 150 requests (``FLEET_SOAK_REQUESTS=500`` for the full soak) of
mixed lengths from 8 concurrent clients, some
cancelled mid-stream, one worker killed and restarted on the way. Every request is answered or cleanly
refused (an OpenAI error body with 429/503, or an SSE error event), and every stage's KV is freed."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from coordinator.local import free_port
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import start_coordinator, start_worker, wait_ready

# Opt-in for its time (about 3.5 minutes at 500 requests; the suite's budget is spent elsewhere). It
# found two batch-group bugs that left requests waiting forever after a worker died (a failed
# compaction before a step, 4bb8237; a member leaving before its step ran, b3371e7).
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif("FLEET_SOAK_REQUESTS" not in os.environ,
                                 reason="opt-in for time: FLEET_SOAK_REQUESTS=500 (about 3.5 minutes)")]

REQUESTS = int(os.environ.get("FLEET_SOAK_REQUESTS", "150"))  # the soak: FLEET_SOAK_REQUESTS=500 (~3 min)
CLIENTS = 8
RESTART_AT = REQUESTS * 2 // 5  # requests finished before stage 1 is killed and restarted
TOPICS = ("the sea", "a library", "bread", "winter", "a robot", "trains", "the moon", "gardens", "chess", "rain")


def one_request(url: str, rng: random.Random, on_hang=lambda: "") -> str:  # noqa: ANN001
    """One streamed request; returns its outcome: done, cancelled or refused-<status>. Anything else
    (a 500, a broken stream, a hang past the timeout) raises; a hang with ``on_hang()``'s report."""
    seen: list[str] = []  # what the client got before a hang: status, chunks
    try:
        return _one_request(url, rng, seen)
    except httpx.ReadTimeout:
        raise AssertionError(f"a request hung for 60 s after {seen}:\n{on_hang()}") from None


def _one_request(url: str, rng: random.Random, seen: list[str]) -> str:
    words = rng.randint(1, 40)
    prompt = f"Tell me about {rng.choice(TOPICS)}. " + " ".join(rng.choice(TOPICS) for _ in range(words))
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(1, 10), "stream": True,
            "temperature": rng.choice([0, 0.7])}
    cancel_after = rng.randint(1, 3) if rng.random() < 0.2 else None
    chunks = 0
    seen.append(f"sent at {time.strftime('%H:%M:%S')}")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        seen.append(f"HTTP {r.status_code} at {time.strftime('%H:%M:%S')}")
        if r.status_code != 200:
            error = json.loads(r.read())["error"]
            assert r.status_code in (429, 503) and error["message"] and error["type"], (r.status_code, error)
            return f"refused-{r.status_code}"
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "done"
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            seen.append(f"{event.get('id')} {str(event.get('choices'))[:60]} at {time.strftime('%H:%M:%S')}")
            if "error" in event:
                assert event["error"]["code"] in ("stage_failure", "pipeline_unavailable"), event
                return "refused-stream"
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


def kv_held(addresses: list[str]) -> list[tuple[int, int]]:
    out = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)
        out.append((info.sessions, info.kv_reserved_bytes))
    return out


def test_soak_with_cancellations_and_a_worker_restart(build_2, tmp_path):
    w0, a0 = start_worker(build_2, 0, tmp_path, "--no-announce")
    port1 = free_port()
    w1, a1 = start_worker(build_2, 1, tmp_path, "--no-announce", port=port1)
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", "--peer", a0, "--peer", a1)
    restarted = None
    try:
        wait_ready(url)
        def on_hang() -> str:  # what every task of the coordinator awaits now (SIGUSR1: fleet_common.cli)
            coordinator.popen.send_signal(signal.SIGUSR1)
            time.sleep(2)
            log = coordinator.text()
            return log[log.rfind("asyncio tasks:") - 80:][:20000] + f"\nKV held: {kv_held([a0, a1])}"

        rng = random.Random(1234)
        seeds = [rng.random() for _ in range(REQUESTS)]
        outcomes: Counter = Counter()
        t0 = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(one_request, url, random.Random(seed), on_hang) for seed in seeds]
            for i, future in enumerate(futures):
                outcomes[future.result(timeout=120)] += 1
                if i == RESTART_AT:
                    w1.kill()
                    restarted, _ = start_worker(build_2, 1, tmp_path, "--no-announce", port=port1, name="-restarted")
        elapsed = time.monotonic() - t0
        print(f"soak: {REQUESTS} requests in {elapsed:.0f} s: {dict(outcomes)}")
        assert sum(outcomes.values()) == REQUESTS
        # while stage 1 restarts (~5-10 s) requests are refused fast (503), so that share varies with load
        assert outcomes["done"] >= REQUESTS // 3, outcomes
        assert outcomes["cancelled"] > 0
        wait_ready(url, 30)  # the restarted worker is back in the fleet
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 16})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 15
        while (held := kv_held([a0, a1])) != [(0, 0), (0, 0)]:
            assert time.monotonic() < deadline, f"KV left on the stages (sessions, reserved bytes): {held}"
            time.sleep(0.2)
        text = coordinator.text()
        assert "Traceback" not in text and " ERROR " not in text, text[-5000:]  # e.g. a batch group's stall guard
    finally:
        coordinator.stop()
        for proc in (w0, w1, restarted):
            if proc is not None:
                proc.stop()
