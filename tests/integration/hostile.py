"""What a hostile or buggy client on the LAN sends (issue 26 #1-#4, issue 45 #1), and how a fleet is measured while it
does: shared by test_fuzz.py (one case per item) and test_soak.py (a hostile client among the others).
Everything goes to loopback only."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

CHAT = "/v1/chat/completions"
MAX_MESSAGES = 2048  # coordinator.api.limits.MAX_MESSAGES, restated: a test must not take the limit from the code it tests
OVERLOADED = (429, 503)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
HOSTILE_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "allOf": [
    {"pattern": f"[{LETTERS[i]}-z]"} for i in range(22)]}}, "required": ["s"]}
"""Issue 45 #1, 1 KB: a string that holds a letter of [a-z], one of [b-z], ... 22 patterns (llguidance: 16 s and
375 MB to compile on 2 cores, on the coordinator's event loop as a tool's parameters; 20 patterns of ``.*[a].*``,
... took 43 s and 2.3 GB)."""
HOSTILE_TOOL = {"type": "function", "function": {"name": "f", "parameters": HOSTILE_SCHEMA}}


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid``, MiB (``VmRSS``)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def prompt_limits(build: Path, max_context: int) -> dict:
    """The prompt size checks a coordinator of ``build`` at ``max_context`` tokens should apply, worked
    out here from the tokenizer (not taken from the coordinator under test): ``bytes``, the most a prompt
    may have (``max_context`` x the most bytes one token decodes to), and ``overhead``, the bytes the
    chat template adds per user message."""
    from coordinator.tokenizer import ChatTokenizer

    tok = ChatTokenizer(build)
    vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    per_token = max(len(tok.tokenizer.decode([i], skip_special_tokens=False).encode()) for i in range(vocab))
    empty = {"role": "user", "content": ""}
    one, two = (len(tok.render_chat([empty] * n, add_generation_prompt=False).encode()) for n in (1, 2))
    return {"bytes": max_context * per_token, "overhead": two - one}


def many_messages(count: int, content: str = "a") -> bytes:
    """Issue 26 #1: a chat body of ``count`` tiny messages (1,000,000 x "a" is 33 MB)."""
    one = json.dumps({"role": "user", "content": content})
    return ('{"max_tokens": 1, "messages": [' + ",".join([one] * count) + "]}").encode()


def heaviest_legal_chat(byte_limit: int, overhead: int) -> dict:
    """The heaviest chat the size checks let through: ``MAX_MESSAGES`` messages whose bytes, with the
    chat template's ``overhead`` per message, just fit ``byte_limit``, of "a " (one token per 2 bytes,
    the most tokenizer work per byte measured). Far over the context: refused once tokenized."""
    each = (byte_limit - overhead * MAX_MESSAGES) // MAX_MESSAGES
    return {"messages": [{"role": "user", "content": ("a " * each)[:each]}] * MAX_MESSAGES, "max_tokens": 1}


def post(url: str, body: bytes | dict, timeout: float = 60.0) -> tuple[httpx.Response, float]:
    """POST a chat body; the response and its seconds."""
    t0 = time.monotonic()
    if isinstance(body, dict):
        r = httpx.post(url + CHAT, json=body, timeout=timeout)
    else:
        r = httpx.post(url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return r, time.monotonic() - t0


def while_health_polled(url: str, action: Callable[[], object], interval_s: float = 0.02) -> tuple[object, list[float]]:
    """Run ``action()`` while another thread asks ``/health`` every ``interval_s``: (its result, each
    health answer's seconds). A health call that fails or is not 200 raises after the action."""
    latencies: list[float] = []
    errors: list[str] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    r = client.get(url + "/health")
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                latencies.append(time.monotonic() - t0)
                time.sleep(interval_s)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.1)  # a few answers before the action
    try:
        result = action()
    finally:
        time.sleep(0.1)
        done.set()
        poller.join(70)
    assert not errors, errors[:5]
    return result, latencies


def abandoned_requests(url: str, count: int = 3, after_s: float = 1.0, max_tokens: int = 3000) -> None:
    """Issue 26 #3: ``count`` raw non-streamed chat POSTs (``max_tokens``, ``ignore_eos``), each socket
    closed after ``after_s`` s, as a client that times out does (then it would retry)."""
    target = urlparse(url)
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: {target.hostname}:{target.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    sockets = []
    for _ in range(count):
        s = socket.create_connection((target.hostname, target.port), timeout=10)
        s.sendall(head + body)
        sockets.append(s)
    time.sleep(after_s)
    for s in sockets:
        s.close()


def settles(check: Callable[[], bool], timeout_s: float, step_s: float = 0.2) -> float | None:
    """Seconds until ``check()`` is true, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if check():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def tiny_temperature(url: str, path: str, stream: bool) -> httpx.Response:
    """Issue 26 #4: ``temperature: 1e-320`` (a subnormal float, > 0) on ``path`` (chat or completions)."""
    body = {"max_tokens": 6, "temperature": 1e-320, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "What is the capital of France?"}]} if "chat" in path
                else {"prompt": "The capital of France is"})
    return httpx.post(url + path, json=body, timeout=60)
