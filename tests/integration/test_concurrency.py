"""Many users at once on a real 2-stage fleet: 8 concurrent greedy streams each equal their solo
output token for token (f32); cancelling one mid-stream frees its KV on every stage at once (seen
through the workers' Info RPC) and does not disturb the others. At the shipped defaults (bf16, default
threads, ``--draft auto``) the 8 streams answer in batch groups while speculating and agree with their solo
runs up to a near-tie (docs/precision.md: token identity needs f32)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import Fleet, agree_until_near_tie, chat, greedy_with_gaps, retained_sessions

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France?",
    "Explain how a bicycle works in simple terms.",
    "Write a Python function that reverses a string.",
    "List five fruits and their colors.",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What are the three states of matter?",
]
NEW_TOKENS = 64  # long enough that all 8 are still decoding when the ninth hangs up (after 3 chunks); 128 took
# twice the time (8 solo runs one after the other, then the 9 streams) comparing the same batch rows longer


def stream(url: str, prompt: str, out: dict, key, stop_after: int | None = None, started: threading.Event | None = None):
    """Stream one greedy completion into ``out[key]``; with ``stop_after``, hang up after that many chunks."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": NEW_TOKENS,
            "ignore_eos": True, "stream": True}
    text, chunks = [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                text.append(delta)
                chunks += 1
                if started is not None and chunks == 1:
                    started.set()
                if stop_after is not None and chunks >= stop_after:
                    break  # leaving the with-block closes the connection: the client went away
    out[key] = "".join(text)


def stage_info(fleet: Fleet) -> list[pb.InfoReply]:
    infos = []
    for _, address in fleet.workers:
        with grpc.insecure_channel(address) as channel:
            infos.append(pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10))
    return infos


@pytest.fixture(scope="module")
def fleet(build_2, tmp_path_factory):
    fleet = Fleet(build_2, tmp_path_factory.mktemp("concurrency"), peers=True)  # no mDNS: others' workers stay out
    yield fleet
    fleet.stop()


def test_concurrent_streams_equal_solo_and_cancel_frees_kv(fleet):
    solo = {p: chat(fleet.url, p, max_tokens=NEW_TOKENS, ignore_eos=True).json()["choices"][0]["message"]["content"]
            for p in PROMPTS}

    together: dict = {}
    started = threading.Event()
    threads = [threading.Thread(target=stream, args=(fleet.url, p, together, p)) for p in PROMPTS]
    # a ninth stream, on the first prompt, that hangs up after 3 chunks
    cancelled = threading.Thread(target=stream, args=(fleet.url, PROMPTS[0], together, "cancelled", 3, started))
    for t in [*threads, cancelled]:
        t.start()
    cancelled.join(120)
    assert started.is_set()
    # the hung-up session is closed on every stage while the 8 others are still open and decoding
    # (decode steps run in batch groups: one KV state with one row per session at each stage)
    # (and the prefix cache keeps the solo runs' sessions, which the streams copy their prompts from)
    deadline = time.monotonic() + 10
    while True:
        kept = retained_sessions(fleet.url)
        infos = stage_info(fleet)
        alive = all(t.is_alive() for t in threads)
        if all(i.sequences == len(PROMPTS) + kept for i in infos):
            break
        assert alive and time.monotonic() < deadline, [i.sequences for i in infos]
        time.sleep(0.05)
    assert alive, "a stream finished before the check; the check needs all 8 open"
    for t in threads:
        t.join(300)
    for p in PROMPTS:
        assert together[p] == solo[p], f"concurrent output diverged on {p!r}"
    assert solo[PROMPTS[0]].startswith(together["cancelled"])
    # every session closed but the retained ones, which reserve no more KV than they hold
    deadline = time.monotonic() + 10
    while True:
        kept, infos = retained_sessions(fleet.url), stage_info(fleet)
        if [i.sessions for i in infos] == [kept, kept]:
            break
        assert time.monotonic() < deadline, ([i.sessions for i in infos], kept)
        time.sleep(0.1)
    assert kept > 0 and all(i.sequences == kept and i.kv_reserved_bytes == i.kv_bytes > 0 for i in infos), infos


DEFAULTS_TOKENS = 24  # 40 once: the same 8 solo runs and 8 streams, compared 16 positions further


def test_concurrent_streams_at_the_defaults_agree_with_solo_until_a_near_tie(defaults_fleet):
    """The shipped defaults (behind 5 ms links, ``defaults_fleet``): the solo runs speculate (the build's
    first draft, adaptive K); the 8 streams batch (and draft where adaptive K's costs at that load say it
    pays: with 8 streams on 2 cores they may not), every one answers in full, each equals its solo run
    or leaves it only at a near-tie by taking the runner-up, and every session but the retained ones is
    closed afterwards."""
    url = defaults_fleet.url
    solo = {p: greedy_with_gaps(url, p, DEFAULTS_TOKENS) for p in PROMPTS}
    assert {s["fleet"]["draft"] for s in solo.values()} == {"self-int4"}, "--draft auto is the build's first draft"
    assert sum(s["fleet"]["accepted_tokens"] for s in solo.values()) > 0, [s["fleet"] for s in solo.values()]
    together: dict = {}

    def one(p: str) -> None:
        together[p] = greedy_with_gaps(url, p, DEFAULTS_TOKENS)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(together) == set(PROMPTS), "a stream did not answer"
    firsts = {p: agree_until_near_tie(together[p], solo[p], f"concurrent {p!r}") for p in PROMPTS}
    stats = [r["fleet"] for r in together.values()]
    assert max(s["batch_max"] for s in stats) >= 2, "the streams never shared a decode step"
    assert all(s["accepted_tokens"] <= s["drafted_tokens"] for s in stats), stats
    print(f"\ndefaults: {sum(f is not None for f in firsts.values())}/{len(PROMPTS)} streams left their solo run, "
          f"at tokens {sorted(f for f in firsts.values() if f is not None)}")
    deadline = time.monotonic() + 10
    while True:
        kept, infos = retained_sessions(url), stage_info(defaults_fleet)
        if [i.sessions for i in infos] == [kept, kept] and all(i.sequences == kept for i in infos):
            break
        assert time.monotonic() < deadline, ([i.sessions for i in infos], kept)
        time.sleep(0.1)
