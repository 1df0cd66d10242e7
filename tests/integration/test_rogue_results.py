"""A last stage that returns spoiled results or huge errors (issue 45 #5), through a real 2-stage fleet whose
stage 1 is reached through ``rogue_stage`` (a real gRPC server in front of the real worker that spoils one
thing at a time): each is a clean JSON error naming stage 1, of bounded size.

Before: NaN log-probabilities were a plain-text 500 (and a literal ``NaN``, not JSON, in an SSE stream); int64
token ids a plain-text 500; an id past the vocabulary blamed stage 0 (which was fed it next); a worker's
100 KB error text reached the client whole."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from bench.harness import Proc
from tests.conftest import start_coordinator, start_worker, wait_ready
from tests.integration.fuzzing import CHAT

pytestmark = pytest.mark.integration

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 2}


@pytest.fixture(scope="module")
def fleet(build_2, tmp_path_factory):
    """Worker 0, worker 1 behind the rogue stage, a coordinator (no prefix cache: every request opens its
    sessions); yields (url, the rogue's mode file)."""
    d = tmp_path_factory.mktemp("rogue")
    mode = d / "mode"
    (w0, a0), (w1, a1) = start_worker(build_2, 0, d, "--no-announce"), start_worker(build_2, 1, d, "--no-announce")
    rogue = Proc([sys.executable, "-m", "tests.integration.rogue_stage", "--upstream", a1, "--mode-file", str(mode)],
                 d / "rogue.log")
    coordinator = None
    try:
        address = rogue.wait_for(r"serving on (\S+)", 60).group(1)
        coordinator, url = start_coordinator(build_2, d, "--no-discover", "--peer", a0, "--peer", address,
                                             "--no-prefix-cache")
        wait_ready(url)
        yield url, mode
    finally:
        for proc in (coordinator, rogue, w1, w0):
            if proc is not None:
                proc.stop()


def _strict(text: str) -> object:
    """``text`` as JSON, refusing NaN and Infinity (which Python's json takes, and JSON does not)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _error(url: str, stream: bool) -> str:
    """The error message the request gets: a JSON error body, or the error event of its SSE stream (every
    data line of which must be JSON)."""
    r = httpx.post(url + CHAT, json={**BODY, "stream": stream}, timeout=60)
    assert r.headers["content-type"].split(";")[0] in ("application/json", "text/event-stream"), (r.status_code, r.text)
    if r.status_code != 200:
        return _strict(r.text)["error"]["message"]
    events = [_strict(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert errors, r.text[-500:]
    return errors[0]


@pytest.mark.parametrize("mode", ["nan", "int64", "oob"])
def test_spoiled_candidates_are_a_json_error_naming_the_last_stage(fleet, mode):
    url, mode_file = fleet
    mode_file.write_text(mode)
    try:
        for stream in (False, True):
            message = _error(url, stream)
            print(f"{mode}, stream={stream}: {message[:160]}")
            assert message.startswith("stage 1 "), message
    finally:
        mode_file.write_text("")
    assert httpx.post(url + CHAT, json=BODY, timeout=60).status_code == 200  # the fleet serves on


def test_a_workers_huge_error_text_reaches_the_client_bounded(fleet):
    url, mode_file = fleet
    mode_file.write_text("bigerror")
    try:
        r = httpx.post(url + CHAT, json=BODY, timeout=60)
    finally:
        mode_file.write_text("")
    print(f"a 100 KB worker error: HTTP {r.status_code}, {len(r.content):,} bytes: {r.text[:200]}")
    assert r.status_code == 503 and _strict(r.text)["error"]["message"].startswith("stage 1 "), r.text[:500]
    assert len(r.content) < 10_000
