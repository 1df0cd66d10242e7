"""Gemma 3's trimmed sliding-window KV (fleet_common/sliding_kv.py) through a real 2-stage fleet, the ways a chat
server meets it: concurrent requests merged into one batch group, the prefix cache's taken and copied
conversations. Every answer is transformers' greedy answer for that request's tokens, id for id.

test_gemma3's tiny random model (8-token window) with 1024 positions, f32 workers at the shipped trim (keep 39,
held_max 103), one batch group (``--batch-groups 1``: a request that comes while another decodes is merged into
its group), each worker behind a 3 ms link (so requests overlap by many steps on a loaded machine).

* Merged, then regenerated: a request decodes alone past its first trim, a second one is merged into its group
  (the group's local states start where the new row's do: 0), the first finishes and is retained; the same
  prompt again must not copy the retained prefix, whose local KV that row dropped before the merge (the group held
  zeros there: the copy was allowed, and the answer wrong from its first token). It is prefilled in full and
  answers as the first did.
* Multi-turn by token ids (``/v1/completions``): each next turn extends the retained conversation (taken: its
  trimmed session resumes), then prompts that share all but the last 20 and 60 tokens of it (copies of a prefix
  whose window the retained session still holds).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Fleet

from .test_architectures import SEED, VOCAB, hf_greedy, reference_model
from .test_gemma3 import make_gemma3

pytestmark = pytest.mark.integration

LONG = "Please write me a very long story about " + " ".join(f"item{i}" for i in range(12)) + " and more."
OTHER = "Another question about " + " ".join(f"thing{i}" for i in range(14)) + " please."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, demo_hf):  # noqa: ANN201 - (Fleet, transformers model, build folder)
    from compiler.build import build

    root = tmp_path_factory.mktemp("sliding-fleet")
    src = make_gemma3(root / "hf", demo_hf, max_position_embeddings=1024)["f32"]
    build(src, root / "build", shards=2)
    running = Fleet(root / "build", root, "--batch-groups", "1", peers=True, link_ms=3.0)
    try:
        yield running, reference_model(src), root / "build"
    finally:
        running.stop()


def stream_chat(url: str, content: str, max_tokens: int, at: int = 0, then=None) -> list[int]:  # noqa: ANN001
    """A greedy streamed chat completion's token ids; ``then()`` is called after its ``at``-th content delta."""
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    pieces, fleet = 0, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                fleet = event.get("fleet") or fleet
                pieces += sum(bool(c["delta"].get("content")) for c in event["choices"])
                if then is not None and pieces >= at:
                    then()
                    then = None
    if then is not None:
        then()
    return fleet["completion_token_ids"]


def complete(url: str, ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": ids, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_regenerated_after_a_merge_is_prefilled_and_equal(fleet):
    from coordinator.tokenizer import ChatTokenizer

    running, ref, build = fleet
    other: dict = {}
    joiner = threading.Thread(target=lambda: other.update(ids=stream_chat(running.url, OTHER, 100)))
    first = stream_chat(running.url, LONG, 90, at=60, then=joiner.start)  # 67 + 60 tokens: trimmed at 103
    joiner.join()
    r = httpx.post(f"{running.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": LONG}], "temperature": 0, "max_tokens": 90, "ignore_eos": True})
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the window is gone: not copied
    assert again["fleet"]["completion_token_ids"] == first
    tokenizer = ChatTokenizer(build)
    assert first == hf_greedy(ref, tokenizer.encode_chat([{"role": "user", "content": LONG}]), 90)
    assert other["ids"] == hf_greedy(ref, tokenizer.encode_chat([{"role": "user", "content": OTHER}]), 100)


def test_taken_and_copied_conversations(fleet):
    running, ref, _ = fleet
    rng = np.random.default_rng(SEED + 7)

    def more(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, VOCAB, n)]

    def turn(ids: list[int], max_tokens: int, cached: int) -> list[int]:
        body = complete(running.url, ids, max_tokens)
        got = body["fleet"]["completion_token_ids"]
        assert got == hf_greedy(ref, ids, max_tokens), (len(ids), cached)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        return got

    prompt = more(40)
    prompt += turn(prompt, 150, 0) + more(20)  # 210 tokens; the retained session holds 40 + 149 of them
    prompt += turn(prompt, 150, 189) + more(5)  # taken: its trimmed session resumes
    conversation = prompt + turn(prompt, 100, 359)
    for back in (20, 60):  # a prompt sharing all but the last ``back`` tokens: a copy of a held prefix
        turn(conversation[:-back] + more(10), 60, len(conversation) - back)
