"""Admission control on a real 2-stage fleet: a session opens only where every stage's KV budget
holds it at its max context; otherwise the request waits in a bounded queue or gets HTTP 429 with a
clear message, never an error from deep inside. Once at the shipped defaults too (f16 KV cache: half the
bytes per slot; ``--draft auto``: each session also reserves ``--spec-slack`` slots for rejected drafts)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration

PROMPT = "Write a haiku about the sea."
TOKENS = 40
# f32 KV of stage 0 (19 of 30 layers) is 29,184 bytes per slot, so 5 MiB hold 179 slots (stage 1, 11
# layers: 310): a request here takes ~35 prompt + 40 completion slots, so two sessions fit and a third
# does not
BUDGET_MB = 5


@pytest.fixture(scope="module")
def workers(build_2, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("admission")
    procs = [start_worker(build_2, shard, log_dir, "--kv-budget-mb", str(BUDGET_MB), "--no-announce")
             for shard in range(2)]
    yield build_2, log_dir, [address for _, address in procs]
    for proc, _ in procs:
        proc.stop()


def coordinator(workers, name: str, *args: str):
    build, log_dir, addresses = workers
    (log_dir / name).mkdir()
    peers = [a for address in addresses for a in ("--peer", address)]
    proc, url = start_coordinator(build, log_dir / name, *peers, "--no-discover", *args)
    wait_ready(url)
    return proc, url


def concurrently(url: str, n: int) -> list:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: chat(url, PROMPT, max_tokens=TOKENS, ignore_eos=True), range(n)))


def test_budget_is_reported_and_third_session_waits_for_room(workers):
    for address in workers[2]:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)
        assert info.kv_budget_bytes == BUDGET_MB << 20 and info.kv_reserved_bytes == 0
    proc, url = coordinator(workers, "queue", "--queue-timeout-s", "60")
    try:
        t0 = time.monotonic()
        replies = concurrently(url, 3)
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        # the third is woken when the first two free their KV (their batch groups close), not left to
        # retry only when its 60 s in the queue run out
        assert elapsed < 40, f"the waiting request was not woken when KV was freed ({elapsed:.0f} s)"
        texts = {r.json()["choices"][0]["message"]["content"] for r in replies}
        assert len(texts) == 1  # the one that waited answers like the others
    finally:
        proc.stop()


def test_no_room_in_time_is_429_with_the_reason(workers):
    proc, url = coordinator(workers, "timeout", "--queue-timeout-s", "0.5")
    try:
        replies = concurrently(url, 3)
        codes = sorted(r.status_code for r in replies)
        assert codes == [200, 200, 429], [r.text for r in replies]
        error = next(r for r in replies if r.status_code == 429).json()["error"]
        assert error["code"] == "overloaded" and "KV budget full" in error["message"], error
    finally:
        proc.stop()


def test_full_queue_is_429(workers):
    proc, url = coordinator(workers, "queue-full", "--max-concurrent-requests", "1", "--max-queued-requests", "0")
    try:
        replies = concurrently(url, 2)
        assert sorted(r.status_code for r in replies) == [200, 429], [r.text for r in replies]
        error = next(r for r in replies if r.status_code == 429).json()["error"]
        assert "1 requests are running and 0 are queued" in error["message"], error
    finally:
        proc.stop()


def test_a_request_that_can_never_fit_is_refused_at_once(workers):
    proc, url = coordinator(workers, "too-large")
    try:
        t0 = time.monotonic()
        reply = chat(url, PROMPT, max_tokens=400)  # ~435 slots: more than a whole 5 MiB budget
        assert reply.status_code == 400, reply.text
        assert time.monotonic() - t0 < 10  # refused, not queued until --queue-timeout-s (60 s)
        error = reply.json()["error"]
        assert error["param"] == "max_tokens" and "whole budget" in error["message"], error
        assert chat(url, PROMPT, max_tokens=TOKENS, ignore_eos=True).status_code == 200  # nothing leaked
    finally:
        proc.stop()


# At the defaults stage 0's KV is f16: 19 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes = 14,592 bytes per slot,
# so 20 MiB hold 1,437 slots; a request with the draft reserves ~35 prompt + 40 completion + 512 slack slots
# (587): two sessions fit and a third does not (at f32's 29,184 bytes per slot only one would).
DEFAULTS_BUDGET_MB = 20


@pytest.fixture(scope="module")
def defaults_workers(build_2, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("admission-defaults")
    procs = [start_worker(build_2, shard, log_dir, "--kv-budget-mb", str(DEFAULTS_BUDGET_MB), "--no-announce",
                          defaults=True) for shard in range(2)]
    yield build_2, log_dir, [address for _, address in procs]
    for proc, _ in procs:
        proc.stop()


def test_at_the_defaults_the_budget_counts_f16_kv_and_the_draft_slack(defaults_workers):
    build, log_dir, addresses = defaults_workers
    (log_dir / "defaults").mkdir()
    peers = [a for address in addresses for a in ("--peer", address)]
    proc, url = start_coordinator(build, log_dir / "defaults", *peers, "--no-discover", "--queue-timeout-s", "0.5",
                                  defaults=True)
    try:
        wait_ready(url)
        replies = concurrently(url, 3)
        assert sorted(r.status_code for r in replies) == [200, 200, 429], [r.text for r in replies]
        error = next(r for r in replies if r.status_code == 429).json()["error"]
        assert error["code"] == "overloaded" and "KV budget full" in error["message"], error
        assert all(r.json()["fleet"]["draft"] == "self-int4" for r in replies if r.status_code == 200)
        reply = chat(url, PROMPT, max_tokens=1000)  # ~1,547 slots with the slack: more than the whole budget
        assert reply.status_code == 400 and "whole budget" in reply.json()["error"]["message"], reply.text
        assert chat(url, PROMPT, max_tokens=TOKENS, ignore_eos=True).status_code == 200  # nothing leaked
    finally:
        proc.stop()
