"""What a user sees when something is down: one plain sentence (what, where, what to do), never raw
gRPC or socket internals; the details only behind ``fleet-chat --verbose`` (and in the API error's
``detail`` field and the coordinator's log)."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

from coordinator.fleet.local import free_port
from tests.conftest import BIN, ROOT, Fleet, chat

pytestmark = pytest.mark.integration

RAW = ("UNAVAILABLE", "ipv4:", "Errno", "failed to connect to all addresses", "batch group", "Traceback")


def _fleet_chat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "fleet-chat"), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _plain(text: str) -> None:
    for raw in RAW:
        assert raw not in text, f"{raw!r} in {text!r}"


def test_fleet_chat_to_a_url_where_nothing_listens():
    url = f"http://127.0.0.1:{free_port()}"
    run = _fleet_chat("--url", url, "-p", "hi")
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert url in lines[0] and "fleet-coordinator serve" in lines[0], lines[0]
    _plain(run.stderr + run.stdout)
    verbose = _fleet_chat("--url", url, "-p", "hi", "--verbose")
    assert verbose.returncode == run.returncode and "Connection refused" in verbose.stderr, verbose.stderr
    assert "Traceback" not in verbose.stderr


def _says_stage_1_and_what_to_do(error: dict) -> None:
    message = error["message"]
    _plain(message)
    assert "stage 1" in message and "fleet-worker --shard 1" in message, message


def _stream_error(url: str, **kw) -> dict:  # noqa: ANN003
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True, "temperature": 0,
            **kw}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.json()["error"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and "error" in (event := json.loads(line[6:])):
                return event["error"]
    raise AssertionError("the stream ended without an error")


def test_a_stage_killed_mid_conversation_is_named_with_what_to_do(build_2, tmp_path):
    fleet = Fleet(build_2, tmp_path, peers=True)
    try:
        assert chat(fleet.url, "What is the capital of France?", max_tokens=8).status_code == 200
        fleet.workers[1][0].kill()
        # at once (the coordinator has not noticed yet), streamed and not, then once health checks saw it
        errors = [_stream_error(fleet.url, max_tokens=64),
                  chat(fleet.url, "And of Spain?", max_tokens=8).json()["error"]]
        time.sleep(5)
        errors += [_stream_error(fleet.url, max_tokens=64),
                   chat(fleet.url, "And of Italy?", max_tokens=8).json()["error"]]
        for error in errors:
            _says_stage_1_and_what_to_do(error)
        run = _fleet_chat("--url", fleet.url, "-p", "And of Portugal?")
        assert run.returncode == 1
        assert "fleet-worker --shard 1" in run.stderr and "Traceback" not in run.stderr, run.stderr
        _plain(run.stderr)
    finally:
        fleet.stop()


def test_a_stage_killed_mid_answer_is_named_with_what_to_do(build_2, tmp_path):
    fleet = Fleet(build_2, tmp_path, peers=True)
    try:
        body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "stream": True,
                "temperature": 0, "max_tokens": 2000, "ignore_eos": True}
        with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            error, killed = None, False
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                elif not killed and event["choices"] and event["choices"][0]["delta"].get("content"):
                    fleet.workers[1][0].kill()
                    killed = True
        assert error is not None
        _says_stage_1_and_what_to_do(error)
        assert error.get("detail"), "the technical details go in a separate field"
        log = fleet.coordinator.text()
        assert "UNAVAILABLE" in log or "Connection refused" in log, "... and in the coordinator's log"
    finally:
        fleet.stop()
