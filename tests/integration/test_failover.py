"""Replicas and failover on real processes: kill -9 (or SIGSTOP) the worker a stream is using and the
stream goes on on a replica (its KV rebuilt by prefilling the session's tokens again), token for token what it would
have been; sessions spread across replicas; the status command shows the fleet."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import BIN, agree_until_near_tie, start_coordinator, start_worker, stream_with_gaps, wait_ready

pytestmark = pytest.mark.integration

PROMPT = "Write a long story about a dragon who learns to bake bread."
TOKENS = 64  # the reference and each failed-over stream: 40 tokens on the replicas after the failure (100 once)
FAIL_AFTER = 24  # content chunks a stream has had when its worker is killed or hung (30 once)


def info(address: str) -> pb.InfoReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)


def stream_tokens(url: str, out: dict, progress: threading.Event, after: int, tokens: int = TOKENS) -> None:
    """Stream one greedy completion of ``tokens``; set ``progress`` once ``after`` content chunks arrived. ``out``
    gets the status, text, fleet stats and ``times``: each content chunk's arrival (``time.monotonic()``)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, chunks, out["times"] = [], 0, []
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                break
            if event.get("fleet"):
                out["fleet"] = event["fleet"]
            for choice in event.get("choices", []):
                if content := choice.get("delta", {}).get("content"):
                    text.append(content)
                    out["times"].append(time.monotonic())
                    out.setdefault("ttft", out["times"][0] - start)
                    chunks += 1
                    if chunks == after:
                        progress.set()
    out["text"] = "".join(text)
    progress.set()


REPLICAS = [(stage, replica) for stage in range(2) for replica in "ab"]


def end(proc) -> None:  # noqa: ANN001 - a conftest.Proc
    """Stop ``proc``, a stopped (SIGSTOP: hung) one included."""
    if proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGCONT)  # a hung (stopped) worker, so that it can stop
    proc.stop()


@pytest.fixture(scope="module")
def replicas(build_2, tmp_path_factory):
    """Two f32 workers per stage of build_2 (peers, not announced: other tests' workers stay out), shared by the
    module's tests on them, each with its own coordinator (``_replicated``): {(stage, replica): (proc, address)},
    where a worker a test killed or hung is replaced by a fresh one. They start together (each loads and
    compiles its stage on its own thread: about half the wait)."""
    log_dir = tmp_path_factory.mktemp("replicas")
    with ThreadPoolExecutor(len(REPLICAS)) as pool:
        started = [pool.submit(start_worker, build_2, stage, log_dir, "--no-announce", name=r) for stage, r in REPLICAS]
    workers = {key: future.result() for key, future in zip(REPLICAS, started)}
    yield workers, log_dir
    for proc, _ in workers.values():
        end(proc)


def whole_and_idle(build, workers: dict, log_dir) -> None:  # noqa: ANN001
    """Make ``workers`` what a fresh fleet's are: each one a test killed or hung (SIGSTOP) is ended and a fresh
    worker of its stage takes its place; then every worker must hold no sequence within 30 s (the last test's
    coordinator freed its sessions as it stopped)."""
    import psutil

    for (stage, replica), (proc, _) in list(workers.items()):
        if proc.popen.poll() is None and psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            continue
        end(proc)
        workers[stage, replica] = start_worker(build, stage, log_dir, "--no-announce",
                                               name=f"{replica}-after{proc.pid}")  # its log beside the ended one's
    deadline = time.monotonic() + 30
    while held := {a: n for _, a in workers.values() if (n := info(a).sequences)}:
        assert time.monotonic() < deadline, f"workers still hold sequences of the last test: {held}"
        time.sleep(0.2)


def _replicated(build, replicas, tmp_path, *coordinator_args: str):  # noqa: ANN001, ANN202 - a fixture's generator
    """The module's two workers per stage (``replicas``: alive and holding nothing, ``whole_and_idle``) and a
    coordinator of this test with ``coordinator_args``."""
    workers, log_dir = replicas
    whole_and_idle(build, workers, log_dir)
    peers = [a for _, address in workers.values() for a in ("--peer", address)]
    coordinator, url = start_coordinator(build, tmp_path, "--no-discover", *peers, *coordinator_args)
    try:
        wait_ready(url)
        yield workers, coordinator, url
    finally:
        coordinator.stop()


@pytest.fixture
def replicated(build_2, replicas, tmp_path):
    """``_replicated`` decoding plainly (``--draft none``)."""
    yield from _replicated(build_2, replicas, tmp_path)


def fail_busy_worker(workers: dict, stage: int, how: str, url: str | None = None) -> str:
    """kill -9 (``kill``) or SIGSTOP (``hang``) the stage's worker that runs a request now (by the coordinator
    at ``url``'s placement load: a worker also holds the prefix cache's retained sessions), or without
    ``url`` the one that holds a sequence; returns its address."""
    health = httpx.get(f"{url}/health", timeout=5).json() if url is not None else {"workers": []}
    load = {w["address"]: w["load"] for w in health["workers"]}
    for (s, _), (proc, address) in workers.items():
        busy = load.get(address, 0) > 0 if url is not None else info(address).sequences > 0
        if s == stage and proc.popen.poll() is None and busy:
            if how == "kill":
                proc.kill(signal.SIGKILL)
            else:
                os.killpg(proc.popen.pid, signal.SIGSTOP)
            return address
    raise AssertionError(f"no stage-{stage} worker {'runs a request' if url else 'holds a sequence'}")


def failover_logged(coordinator, stage: int, address: str) -> bool:  # noqa: ANN001 - a conftest.Proc
    """Whether the coordinator's log has a failover line for ``stage``'s worker at ``address``: engine._fail_over
    logs "<request id>: stage N (worker host:port) <what happened>; ...; failing over to <addresses>, ..."
    (errors.stage_lost / stage_failed), so the stage is matched in that line, not anywhere in the log (the join
    lines name every stage)."""
    line = rf"(?m)^.*: stage {stage} \(worker {re.escape(address)}\) [^\n]*; failing over to "
    return re.search(line, coordinator.text()) is not None


def detection_bound_s(reference: dict) -> float:
    """The longest a failover may stall a stream: the coordinator's settings (the fixture runs their defaults)
    bound noticing the loss: a killed worker at once, a hung one by ``missed_health_checks`` late health checks
    in a row (each a 1 s deadline, then ``health_interval_s``), its steps waiting past their deadline
    (``rpc_timeout_s`` + ``per_token_timeout_s`` per stage) for that verdict, whichever is longer; then the replicas prefill the prompt and the tokens so far again, about as long as the reference's
    first token. Doubled, plus 2 s, for a loaded 2-core machine."""
    from coordinator.settings import CoordinatorSettings

    s = {name: field.default for name, field in CoordinatorSettings.model_fields.items()}
    notice = max((1.0 + s["health_interval_s"]) * s["missed_health_checks"],
                 s["rpc_timeout_s"] + 2 * s["per_token_timeout_s"])
    return 2 * (notice + 2 * reference["ttft"]) + 2.0


def stall_after(times: list[float], since: float) -> float:
    """Seconds from ``since`` to the chunk that ends the longest gap between chunks from ``since`` on (the
    first chunk on the replicas; tokens already in flight at ``since`` may arrive before the gap)."""
    later = [since, *(t for t in times if t > since)]
    assert len(later) > 1, "no chunk after the failure"
    end = max(range(1, len(later)), key=lambda i: later[i] - later[i - 1])
    return later[end] - since


@pytest.fixture(scope="module")
def reference() -> dict:
    """The stream without a failure, made once (by the first test that needs it: same build and settings,
    so every fleet of this module answers it alike)."""
    return {}


@pytest.mark.parametrize("stage,how", [(1, "kill"), (0, "kill"), (1, "hang"), (0, "hang")])
def test_failed_worker_mid_stream_fails_over_to_replica(replicated, reference, stage, how):
    workers, coordinator, url = replicated
    if not reference:
        stream_tokens(url, reference, threading.Event(), after=0)
    assert reference["status"] == 200 and "error" not in reference and reference["fleet"]["failovers"] == 0

    out: dict = {}
    progress = threading.Event()
    thread = threading.Thread(target=stream_tokens, args=(url, out, progress, FAIL_AFTER))
    thread.start()
    assert progress.wait(60)
    failed_at = time.monotonic()
    failed = fail_busy_worker(workers, stage, how, url)
    thread.join(120)
    assert not thread.is_alive()
    assert "error" not in out, out.get("error")
    assert out["fleet"]["failovers"] == 1
    assert out["text"] == reference["text"], "the output after failover must equal the run without failure"
    stall, bound = stall_after(out["times"], failed_at), detection_bound_s(reference)
    assert stall < bound, f"the stream went on {stall:.1f} s after the failure (bound {bound:.1f} s)"
    assert failover_logged(coordinator, stage, failed), coordinator.text()[-2000:]
    # the dead worker is unhealthy, and the fleet keeps serving on the replicas
    health = httpx.get(f"{url}/health", timeout=5).json()
    assert health["ready"]
    assert [w for w in health["workers"] if w["address"] == failed][0]["healthy"] is False
    # every session's KV is freed on the live workers (the one that failed over included), but for the
    # finished requests' the prefix cache retains: each on every stage of a healthy pipeline
    deadline = time.monotonic() + 10
    while not kv_is_only_retained(url, workers, failed):
        assert time.monotonic() < deadline, "KV left behind on a live worker"
        time.sleep(0.2)


SPECULATING_PROMPTS = ("Write a long story about a dragon who learns to bake bread.",
                       "List the planets of the solar system with one fact about each.",
                       "Explain how a bicycle works, step by step.")
SPECULATING_TOKENS = 64


@pytest.fixture
def replicated_speculating(build_2, replicas, tmp_path):
    """``_replicated`` with prompt-lookup drafts (K=4) and one batch group per pipeline, so the sessions
    placement puts on one pipeline decode as rows of one group."""
    yield from _replicated(build_2, replicas, tmp_path, "--draft", "ngram", "--spec-k", "4", "--batch-groups", "1")


def three_streams(url: str, on_progress=None) -> list[dict]:  # noqa: ANN001
    """``SPECULATING_PROMPTS`` streamed at once (``stream_with_gaps``); ``on_progress()`` is called once, in
    this thread, when every stream has had 12 content chunks (mid-stream). Raises AssertionError on any
    stream's HTTP or SSE error."""
    started = [threading.Event() for _ in SPECULATING_PROMPTS]

    def one(i: int) -> dict:
        def chunk(n: int) -> None:
            if n == 12:
                started[i].set()
        try:
            return stream_with_gaps(url, SPECULATING_PROMPTS[i], SPECULATING_TOKENS, on_chunk=chunk)
        finally:
            started[i].set()

    with ThreadPoolExecutor(len(SPECULATING_PROMPTS)) as pool:
        futures = [pool.submit(one, i) for i in range(len(SPECULATING_PROMPTS))]
        if on_progress is not None:
            assert all(e.wait(60) for e in started), "the streams did not get going"
            on_progress()
        return [f.result(timeout=180) for f in futures]


def test_failover_of_a_speculating_batch_group(replicated_speculating):
    """Three greedy streams with prompt-lookup drafts; kill -9 the stage-1 worker that runs the most of them
    (two or more: rows of one batch group) mid-stream. Every stream ends without an error, token for token
    what it was without the failure (f32 workers), the ones that lost their worker within the detection
    bound; the others never failed over."""
    workers, coordinator, url = replicated_speculating
    solo = three_streams(url)
    for out in solo:
        assert out["fleet"]["failovers"] == 0 and out["fleet"]["drafted_tokens"] > 0, out["fleet"]
    killed: dict = {}

    def kill_busiest_stage_1() -> None:
        load = {w["address"]: w["load"] for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]}
        key = max((k for k in workers if k[0] == 1), key=lambda k: load.get(workers[k][1], 0))
        killed.update(address=workers[key][1], load=load.get(workers[key][1], 0), at=time.monotonic())
        workers[key][0].kill(signal.SIGKILL)

    outs = three_streams(url, kill_busiest_stage_1)
    assert killed["load"] >= 2, f"no stage-1 worker ran two streams: {killed}"
    failed_over = [out for out in outs if out["fleet"]["failovers"]]
    assert len(failed_over) >= 2 and all(o["fleet"]["failovers"] == 1 for o in failed_over), \
        [o["fleet"] for o in outs]
    assert max(o["fleet"]["batch_max"] for o in failed_over) >= 2, "the failed streams never shared a step"
    for prompt, out, before in zip(SPECULATING_PROMPTS, outs, solo):
        assert out["ids"] == before["ids"], f"{prompt!r}: the output after failover differs from the run without"
        assert out["fleet"]["drafted_tokens"] > out["fleet"]["accepted_tokens"] > 0, out["fleet"]
    bound = detection_bound_s({"ttft": max(o["ttft"] for o in solo)})
    stalls = [stall_after(out["times"], killed["at"]) for out in failed_over]
    assert max(stalls) < bound, f"the streams went on {max(stalls):.1f} s after the failure (bound {bound:.1f} s)"
    assert failover_logged(coordinator, 1, killed["address"]), coordinator.text()[-2000:]
    print(f"\nspeculating batch group failover: {len(failed_over)} streams, stalls "
          f"{', '.join(f'{t:.2f}' for t in stalls)} s (bound {bound:.1f} s)")
    deadline = time.monotonic() + 10
    while not kv_is_only_retained(url, workers, killed["address"]):
        assert time.monotonic() < deadline, "KV left behind on a live worker"
        time.sleep(0.2)


def kv_is_only_retained(url: str, workers: dict, failed: str) -> bool:
    """Whether the live workers of each stage hold exactly the coordinator's retained sessions."""
    retained = httpx.get(f"{url}/health", timeout=5).json()["prefix_cache"]["sessions"]
    held = [sum(info(a).sequences for (s, _), (p, a) in workers.items() if s == stage and p.popen.poll() is None
                and a != failed) for stage in range(2)]
    return held == [retained, retained]


def test_sessions_spread_across_replicas_and_status_shows_them(replicated):
    workers, _, url = replicated
    outs = [dict() for _ in range(4)]
    events = [threading.Event() for _ in range(4)]
    # 40 tokens each, still decoding at the check after 8 (the 100 of before only made them run longer)
    threads = [threading.Thread(target=stream_tokens, args=(url, outs[i], events[i], 8, 40)) for i in range(4)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60)
    busy = {(s, r) for (s, r), (_, a) in workers.items() if info(a).sequences}
    for t in threads:
        t.join(120)
    assert all(o.get("status") == 200 and "error" not in o for o in outs)
    assert busy == set(workers), f"4 concurrent sessions should use every replica, used {sorted(busy)}"
    status = subprocess.run([str(BIN / "fleet-coordinator"), "status", "--url", url], capture_output=True, text=True,
                            timeout=30)
    assert status.returncode == 0, status.stderr
    for _, address in workers.values():
        assert address in status.stdout
    assert "stage 0" in status.stdout and "stage 1" in status.stdout and "2 replicas" in status.stdout


@pytest.mark.parametrize("stage", [0, 1])
def test_a_retained_conversation_whose_worker_died_is_prefilled_again(replicated, stage):
    """Prefix caching meets failover: a worker holding a finished chat's retained KV dies; the chat's next
    request (sent at once, before a health check can notice) is prefilled afresh on the replicas and
    answers exactly as it did from the cache. (Stage 0's loss shows as a failed copy of the retained KV,
    the last stage's as a broken result stream: the retained session is passed over.)"""
    workers, coordinator, url = replicated
    messages = [{"role": "user", "content": "Name three colours."}]

    def ask() -> dict:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={"messages": messages, "temperature": 0, "max_tokens": 24})
        assert r.status_code == 200, r.text
        return r.json()

    messages.append({"role": "assistant", "content": ask()["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": "And three animals?"})
    cached = ask()
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    failed = fail_busy_worker(workers, stage, "kill")  # the only sequence left: the retained session's
    again = ask()
    assert again["choices"][0]["message"]["content"] == cached["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 10
    while not kv_is_only_retained(url, workers, failed):
        assert time.monotonic() < deadline, "KV left behind on a live worker"
        time.sleep(0.2)


@pytest.fixture
def replicated_defaults(build_2, tmp_path):
    """At the shipped defaults (bf16 where the CPU has it, default threads, ``--draft auto``): stage 0 once,
    stage 1 twice (peers, not announced), and a coordinator."""
    keys = [(0, "a"), (1, "a"), (1, "b")]
    with ThreadPoolExecutor(len(keys)) as pool:
        started = [pool.submit(start_worker, build_2, stage, tmp_path, "--no-announce", name=r, defaults=True)
                   for stage, r in keys]
    workers = {key: future.result() for key, future in zip(keys, started)}
    peers = [a for _, address in workers.values() for a in ("--peer", address)]
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", *peers, defaults=True)
    wait_ready(url)
    yield workers, coordinator, url
    coordinator.stop()
    for proc, _ in workers.values():
        proc.stop()


def test_failover_at_the_defaults_goes_on_without_error(replicated_defaults):
    """At the defaults the replica rebuilds the KV by prefill, which rounds differently from the decode steps
    that wrote it (bf16; docs/precision.md): the stream goes on without an error, in full, within the
    detection bound, equal to the run without a failure or leaving it only at a near-tie; KV is freed."""
    workers, coordinator, url = replicated_defaults
    reference = stream_with_gaps(url, PROMPT, TOKENS)
    assert reference["fleet"]["failovers"] == 0 and reference["fleet"]["drafted_tokens"] > 0, reference["fleet"]
    killed: dict = {}

    def kill_mid_stream(n: int) -> None:
        if n == FAIL_AFTER:
            killed["at"] = time.monotonic()
            killed["address"] = fail_busy_worker(workers, 1, "kill", url)

    out = stream_with_gaps(url, PROMPT, TOKENS, on_chunk=kill_mid_stream)
    assert out["fleet"]["failovers"] == 1, out["fleet"]
    first = agree_until_near_tie(out, reference, "after failover")
    print(f"\ndefaults failover: {'identical' if first is None else f'left the reference at token {first}'}")
    stall, bound = stall_after(out["times"], killed["at"]), detection_bound_s(reference)
    assert stall < bound, f"the stream went on {stall:.1f} s after the failure (bound {bound:.1f} s)"
    assert failover_logged(coordinator, 1, killed["address"]), coordinator.text()[-2000:]
    deadline = time.monotonic() + 10
    while not kv_is_only_retained(url, workers, killed["address"]):
        assert time.monotonic() < deadline, "KV left behind on a live worker"
        time.sleep(0.2)
