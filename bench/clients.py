"""The benches' HTTP clients: one streamed chat completion timed chunk by chunk (:func:`stream_chat`), and
users streaming at once with the CPU time each fleet process spent per token (:func:`run_users`)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = (
    "Explain how a rainbow forms, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a packing list for a weekend hiking trip in the mountains.",
    "Why do cats purr? Give three theories.",
    "Write a limerick about a programmer who loves coffee.",
    "How does a refrigerator keep food cold?",
)


@dataclass
class Stream:
    """One streamed completion as the client saw it: ``perf_counter`` times of the request (``start``),
    each content chunk (``times``) and the chunk carrying ``finish_reason`` (``finish``); the content
    ``pieces``; the ``usage`` and, from a fleet coordinator, the ``fleet`` statistics of the last chunks."""

    start: float
    times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish: float | None = None
    usage: dict = field(default_factory=dict)
    fleet: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The completion's text."""
        return "".join(self.pieces)

    @property
    def ttft_ms(self) -> float:
        """Request start to the first content chunk, ms."""
        return (self.times[0] - self.start) * 1000


def stream_chat(client: httpx.Client, url: str, messages: list[dict] | str, tokens: int, greedy: bool = True,
                extra: dict | None = None, timeout: float = 900) -> Stream:
    """POST a streamed chat completion of ``messages`` (a string: one user message), ``max_tokens`` =
    ``tokens``; ``greedy``: temperature 0 and ``ignore_eos`` (exactly ``tokens`` tokens); ``extra``: more
    body fields (a server's own, e.g. llama.cpp's ``cache_prompt``). Raises ``RuntimeError`` for an error
    status, an error event or a stream without content."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = {"messages": messages, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            **({"temperature": 0, "ignore_eos": True} if greedy else {}), **(extra or {})}
    out = Stream(time.perf_counter())
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            out.fleet = event.get("fleet") or out.fleet
            out.usage = event.get("usage") or out.usage
            choice = (event.get("choices") or [{}])[0]  # the usage chunk has no choices
            if content := choice.get("delta", {}).get("content"):
                out.times.append(time.perf_counter())
                out.pieces.append(content)
            if choice.get("finish_reason") is not None:
                out.finish = time.perf_counter()
    if not out.times:
        raise RuntimeError(f"{url}: the stream carried no content")
    return out


def user(client: httpx.Client, url: str, prompt: str, tokens: int, result: dict, extra: dict | None = None) -> None:
    """One greedy streamed completion of exactly ``tokens`` tokens (:func:`stream_chat`) into ``result``:
    token arrival ``times`` (perf_counter seconds), ``ttft_ms``, ``decode_tok_s`` ((tokens - 1) / first
    to last token), ``end`` (the last token's time), ``chunks``, the ``text``, the ``usage`` and, from
    fleet coordinators, ``fleet``. Raises ``RuntimeError`` for an error answer."""
    s = stream_chat(client, url, prompt, tokens, extra=extra)
    result.update(times=s.times, ttft_ms=s.ttft_ms, decode_tok_s=(tokens - 1) / max(s.times[-1] - s.times[0], 1e-9),
                  end=s.times[-1], chunks=len(s.times), text=s.text, usage=s.usage or None)
    if s.fleet:
        result["fleet"] = s.fleet


def concurrent_users(url: str, prompts: list[str], tokens: int, extra: dict | None = None) -> tuple[float, list[dict]]:
    """One :func:`user` per prompt, all streaming at once: (``perf_counter`` time they started, their
    results in prompt order). Raises ``RuntimeError`` if one got no answer."""
    results = [dict() for _ in prompts]
    with httpx.Client(limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=user, args=(client, url, p, tokens, r, extra))
                   for p, r in zip(prompts, results)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if missing := [i for i, r in enumerate(results) if "end" not in r]:
        raise RuntimeError(f"{url}: users {missing} got no answer (see the threads' tracebacks above)")
    return t0, results


def cpu_seconds(procs: dict) -> dict[str, float]:
    """CPU time (user + system, children excluded) of each named ``psutil.Process``, seconds."""
    return {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}


def peak_rss_mib(procs: dict) -> dict[str, float]:
    """Peak resident memory (Linux ``VmHWM``) of each named, still running ``psutil.Process``, MiB."""
    from bench.harness import proc_status

    return {name: proc_status(p.pid)["VmHWM"] / (1 << 20) for name, p in procs.items()}


def run_users(url: str, users: int, tokens: int, procs: dict | None = None, extra: dict | None = None) -> dict:
    """``users`` concurrent streams of ``tokens`` each (prompts :data:`PROMPTS` in turn; body fields ``extra``,
    see :func:`user`); with ``procs`` (name -> ``psutil.Process``), also their CPU ms per token, the client's
    (this process) among them. ``answers``: each user's text and usage, in user order."""
    import psutil

    procs = {**(procs or {}), "client": psutil.Process()}
    before = cpu_seconds(procs)
    t0, results = concurrent_users(url, [PROMPTS[i % len(PROMPTS)] for i in range(users)], tokens, extra)
    wall = max(r["end"] for r in results) - t0
    after = cpu_seconds(procs)
    cpu = {name: (after[name] - before[name]) * 1000 / (users * tokens) for name in procs}
    return {"users": users, "aggregate_tok_s": users * tokens / wall,
            "per_user_tok_s": statistics.median(r["decode_tok_s"] for r in results),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in results), "wall_s": wall,
            "cpu_ms_per_token": cpu, "cpu_bound_tok_s": (os.cpu_count() or 1) * 1000 / sum(cpu.values()),
            "answers": [{"text": r["text"], "usage": r.get("usage")} for r in results]}


def warm_up(url: str, extra: dict | None = None) -> None:
    """One short greedy stream (8 tokens): the first inferences of a fresh fleet are slow."""
    run_users(url, 1, 8, extra=extra)

