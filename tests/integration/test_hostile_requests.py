"""A hostile client's requests (issue 26 items 1-4; tests/integration/hostile.py holds the patterns) against a real
2-stage fleet: many messages, the heaviest legal chat, abandoned requests, a tiny temperature, retained sessions
the workers freed. Each must be refused or answered at once, the coordinator's health must keep answering within
100 ms, and afterwards a normal request runs at its usual speed with the memory back within 10% of its baseline.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from fleet_common.manifest import load_manifest
from tests.conftest import Proc, retained_sessions, start_coordinator, start_worker, wait_ready
from tests.integration.fuzzing import CHAT, rss_mib, valid_chat, worker_sessions
from tests.integration.hostile import (
    MAX_MESSAGES,
    abandoned_requests,
    heaviest_legal_chat,
    many_messages,
    post,
    prompt_limits,
    settles,
    tiny_temperature,
    while_health_polled,
)

pytestmark = pytest.mark.integration


# -- a hostile client (issue 26 #1-#4): hostile.py holds the patterns --------------------------------

OWNER_TIMEOUT_S = 3  # the hostile fleet's workers free a silent coordinator's sessions after this


@pytest.fixture(scope="module")
def hostile_fleet(build_2, tmp_path_factory):
    """Two workers (``--owner-timeout-s 3``) and a coordinator at the model's full context (8,192); yields
    (coordinator, url, worker addresses, the prompt limits it should apply: ``hostile.prompt_limits``)."""
    d = tmp_path_factory.mktemp("hostile")
    workers = [start_worker(build_2, i, d, "--no-announce", "--owner-timeout-s", str(OWNER_TIMEOUT_S))
               for i in (1, 0)][::-1]
    addresses = [a for _, a in workers]
    coordinator, url = start_coordinator(build_2, d, "--no-discover", *(x for a in addresses for x in ("--peer", a)))
    try:
        wait_ready(url)
        max_context = load_manifest(build_2).manifest.architecture.max_context
        yield coordinator, url, addresses, prompt_limits(build_2, max_context)
    finally:
        coordinator.stop()
        for proc, _ in workers:
            proc.stop()


def _normal(url: str) -> float:
    """Seconds of a normal request (8 greedy tokens), which must succeed."""
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60.0)) as client:
        valid_chat(client, max_tokens=8)
    return time.monotonic() - t0


def _recovered(coordinator: Proc, url: str, addresses: list[str], usual_s: float, baseline_mib: float,
               what: str) -> None:
    """After a hostile pattern: a normal request at its usual speed, RSS within 10% of the baseline, and
    the workers holding exactly what the prefix cache retains (no lease lapsed)."""
    took = _normal(url)
    assert took < 2 * usual_s + 0.5, f"after {what}: a normal request took {took:.2f} s, usually {usual_s:.2f} s"
    rss = rss_mib(coordinator)
    assert rss <= 1.1 * baseline_mib, f"after {what}: RSS {rss:.0f} MiB, baseline {baseline_mib:.0f} MiB"
    kept = retained_sessions(url)
    assert worker_sessions(*addresses) == [kept, kept], f"after {what}"
    print(f"after {what}: normal request {took:.2f} s (usually {usual_s:.2f}), RSS {rss:.0f} MiB "
          f"(baseline {baseline_mib:.0f})")


def test_many_messages_never_freeze_the_coordinator(hostile_fleet):
    """Issue 26 #1: a million one-letter messages (33 MB) froze the event loop for 45 s and grew the
    coordinator by 1.5 GB; 100k empty ones froze it for 2 s. Now: a 413 before the body is read, a 400 for
    more than 2,048 messages, the chat template's bytes per message counted in the size check, and the
    heaviest request the checks let through templated and tokenized off the event loop while /health
    answers within 100 ms. After each, the fleet answers as fast as before, at its baseline RSS."""
    coordinator, url, addresses, limits = hostile_fleet
    for _ in range(3):
        _normal(url)  # warm: kernels, the prefix cache's first entries
    usual_s = min(_normal(url) for _ in range(2))
    baseline = rss_mib(coordinator)
    patterns = {
        "1,000,000 messages": (many_messages(1_000_000), 413, "request_too_large"),
        "100,000 empty messages": (many_messages(100_000, ""), 413, "request_too_large"),
        "2,049 messages": (many_messages(MAX_MESSAGES + 1), 400, None),
        # content alone fits the byte limit, with the template's bytes per message it does not
        "2,048 messages over the limit with their overhead": (
            {"messages": [{"role": "user", "content": "b" * (limits["bytes"] // MAX_MESSAGES - 1)}] * MAX_MESSAGES},
            400, "context_length_exceeded"),
        "the heaviest legal request": (heaviest_legal_chat(limits["bytes"], limits["overhead"]), 400,
                                       "context_length_exceeded"),
    }
    for what, (body, status, code) in patterns.items():
        (response, took), health = while_health_polled(url, lambda b=body: post(url, b))
        error = response.json()["error"]
        print(f"{what}: HTTP {response.status_code} in {took:.2f} s, /health at most {max(health) * 1000:.0f} ms "
              f"over {len(health)} calls: {error['message'][:120]}")
        assert response.status_code == status and error["code"] == code, (what, response.status_code, error)
        assert "messages" in error["message"] or "body" in error["message"], error
        assert max(health) < 0.1, f"{what}: /health took {max(health) * 1000:.0f} ms"
        assert took < 5, f"{what}: answered after {took:.1f} s"
        _recovered(coordinator, url, addresses, usual_s, baseline, what)


def test_a_client_gone_ends_its_requests(hostile_fleet):
    """Issue 26 #3: non-streamed requests went on generating for their whole max_tokens after their client
    closed the connection (running: 3 for 30+ s, the workers' KV growing). Now they are cancelled and their
    KV freed within a few seconds of the disconnect."""
    coordinator, url, addresses, _ = hostile_fleet
    usual_s = _normal(url)
    baseline = rss_mib(coordinator)
    abandoned_requests(url, count=3, after_s=1.0)
    idle = settles(lambda: httpx.get(url + "/health", timeout=5).json()["running"] == 0, 10)
    assert idle is not None, httpx.get(url + "/health", timeout=5).json()
    kept = retained_sessions(url)
    freed = settles(lambda: worker_sessions(*addresses) == [kept, kept], 10)
    assert freed is not None, (worker_sessions(*addresses), kept)
    print(f"3 abandoned requests: nothing running {idle:.1f} s after the disconnect, KV freed {freed:.1f} s later")
    assert "cancelled" in coordinator.text()
    _recovered(coordinator, url, addresses, usual_s, baseline, "abandoned requests")


def test_a_tiny_temperature_is_greedy(hostile_fleet):
    """Issue 26 #4: temperature 1e-320 (> 0, so sampled) overflowed the softmax into NaN: a plain-text 500.
    Now it is answered, on both endpoints, streamed or not, with the greedy answer (its limit)."""
    _, url, _, _ = hostile_fleet
    for path in (CHAT, "/v1/completions"):
        greedy = tiny_temperature(url, path, stream=False)  # compared with temperature 0 below
        for stream in (False, True):
            r = tiny_temperature(url, path, stream)
            assert r.status_code == 200, (path, stream, r.status_code, r.text[:300])
            if stream:
                assert "data: [DONE]" in r.text and '"error"' not in r.text, r.text[-500:]
        body = {"max_tokens": 6, "temperature": 0}
        body.update({"messages": [{"role": "user", "content": "What is the capital of France?"}]} if path == CHAT
                    else {"prompt": "The capital of France is"})
        zero = httpx.post(url + path, json=body, timeout=60).json()
        assert greedy.json()["fleet"]["completion_token_ids"] == zero["fleet"]["completion_token_ids"], path


def test_retained_sessions_the_workers_freed_are_forgotten(build_2, hostile_fleet, tmp_path):
    """Issue 26 #2: a coordinator stopped (SIGSTOP) past the workers' --owner-timeout-s had its retained
    sessions freed by them, but kept listing them (/health: 20 cached, the workers 4) and tried to copy
    from them on every later request sharing their system prompt. Now a worker answering after such a gap
    gets every retained session through it checked: the freed ones are forgotten, the rest kept."""
    _, other, addresses, _ = hostile_fleet  # the workers hold the other coordinator's retained sessions too
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover",
                                         *(x for a in addresses for x in ("--peer", a)))
    system = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence, always."}
    try:
        wait_ready(url)
        for question in ("Name a color.", "Name a fruit.", "Name a city."):
            r = httpx.post(url + CHAT, json={"messages": [system, {"role": "user", "content": question}],
                                             "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        before = retained_sessions(url)
        assert before >= 3
        coordinator.popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(OWNER_TIMEOUT_S + 4)  # the workers sweep every owner timeout / 3
        finally:
            coordinator.popen.send_signal(signal.SIGCONT)
        held = worker_sessions(*addresses)
        agreed = settles(lambda: [retained_sessions(url) + retained_sessions(other)] * 2
                         == worker_sessions(*addresses), 10)
        print(f"retained {before} before SIGSTOP, workers held {held} after it; /health agreed after {agreed} s")
        assert agreed is not None, (retained_sessions(url), retained_sessions(other), worker_sessions(*addresses))
        checked = coordinator.wait_for(r"answered after \d+ s without a health check.*", 5).group(0)
        print(checked)
        r = httpx.post(url + CHAT, json={"messages": [system, {"role": "user", "content": "Name a tree."}],
                                         "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert "could not reuse" not in coordinator.text(), coordinator.text()[-3000:]
    finally:
        coordinator.stop()



# -- hostile schemas (issue 29's grammar-constrained decoding) ---------------------------------------

def _ref_chain(length: int) -> dict:
    """A JSON schema of ``length`` ``$ref``s each pointing to the next (64 KB for 2,500)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{length}": {"type": "string"}}}


def _schema_chat(schema: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
"""A schema whose object opens (``{"a":``, forced) and then allows nothing: it passes the first mask."""


def test_hostile_schemas_are_refused_and_hurt_no_one(hostile_fleet):
    """A chain of 5,000 $refs (llguidance compiles it by recursion: the coordinator died of SIGSEGV), the
    same as a tool's parameters and as Ollama's format, ``{"$ref": "#"}`` (it compiled, then its first mask
    broke in the step loop's scheduling: the loop died and every request after it hung), 3,000 optional
    properties (9 s of compile per 4,000; 10,000 took 128 s), 80 tools of 1,000 properties on the OpenAI and
    Anthropic APIs (each tool's schema compiled on the event loop to be checked: frozen for 18 s): each a 400
    naming its field, /health answering within 500 ms (10-200 ms: a 2 MB body is parsed on the loop). A
    schema that breaks after its forced ``{"a":`` failed every request of the step loop as a 503 ("send the
    request again"); now it alone fails, a 400, while a plain request decoding beside it gets all its tokens."""
    _, url, _, _ = hostile_fleet
    r = httpx.post(url + CHAT, json=_schema_chat({"type": "object"}), timeout=60)  # llguidance's tokenizer, built once
    assert r.status_code == 200, r.text
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    tool = {"type": "function", "function": {"name": "f", "parameters": _ref_chain(5000)}}
    patterns = {
        "a chain of 5,000 $refs": (CHAT, _schema_chat(_ref_chain(5000)), "response_format", "nests deeper"),
        "a tool's parameters of 5,000 $refs": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                      "tools": [tool], "tool_choice": "required"}, "tools", "nests deeper"),
        "Ollama's format of 5,000 $refs": ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                         "format": _ref_chain(5000), "stream": False}, "format", "nests deeper"),
        '{"$ref": "#"}': (CHAT, _schema_chat({"$ref": "#"}), "response_format", "allows no output"),
        "3,000 optional properties": (CHAT, _schema_chat({"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(3000)}}), "response_format", "more properties"),
        # each tool's schema is compiled to be checked on the event loop: these froze it for 18 s
        "80 tools of 1,000 properties (2 MB)": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
                f"p{j}": {"type": "string"} for j in range(1000)}}}} for i in range(80)]}, "tools", "more properties"),
        "Anthropic's 80 tools of 1,000 properties": ("/v1/messages", {
            "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [
                {"name": f"f{i}", "input_schema": {"type": "object", "properties": {
                    f"p{j}": {"type": "string"} for j in range(1000)}}} for i in range(80)]}, "tools", "more properties"),
    }
    for what, (path, body, field, words) in patterns.items():
        data = json.dumps(body).encode()  # encoded before /health is polled: json.dumps holds this process's GIL
        r, health = while_health_polled(url, lambda p=path, d=data: httpx.post(
            url + p, content=d, headers={"content-type": "application/json"}, timeout=30))
        message = r.json()["error"] if path.startswith("/api") else r.json()["error"]["message"]  # Ollama's shape
        print(f"{what}: HTTP {r.status_code}, /health at most {max(health) * 1000:.0f} ms: {message[:120]}")
        assert r.status_code == 400 and message.startswith(field) and words in message, (what, r.status_code, message)
        assert max(health) < 0.5, f"{what}: /health took {max(health) * 1000:.0f} ms"  # 2 MB parsed; 2 shared cores
    with httpx.Client(base_url=url, timeout=60) as client:
        plain = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40, "ignore_eos": True,
                 "temperature": 0, "stream": True}
        with client.stream("POST", CHAT, json=plain) as beside:
            lines = beside.iter_lines()
            rest = [next(lines)]  # decoding
            r = client.post(CHAT, json=_schema_chat(DEAD_END))
            rest += list(lines)
    assert r.status_code == 400 and "no continuation" in r.json()["error"]["message"], r.text
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length", chunks[-3:]
    assert httpx.post(url + CHAT, json=_schema_chat({"type": "object"}), timeout=60).status_code == 200
