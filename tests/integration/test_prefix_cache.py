"""Prefix caching across requests (coordinator/engine/prefix_cache.py) on real fleets of the demo: multi-turn
chats prefill only what each turn adds, and every greedy answer still equals transformers' (f32, on the
same prompt ids; near-ties bounded as in test_equivalence), whether its KV came from a retained session,
a copy of one, or a fresh prefill."""

from __future__ import annotations

import concurrent.futures
import functools

import httpx
import pytest

from coordinator.engine.prefix_cache import common_prefix
from coordinator.tokenizer import ChatTokenizer
from tests.conftest import DRAFTS, Fleet

from .reference import TransformersReference, near_ties

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
KEY = {"Authorization": "Bearer alice"}  # /health and /metrics in full need a key where keys are set

QUESTIONS = ["What is the capital of France?", "Why is it famous?", "Name one museum there.",
             "Summarise our chat in one sentence."]


@pytest.fixture(scope="module")
def reference(demo_hf):
    return TransformersReference(demo_hf)


class Checker:
    """Sends chat turns and checks each greedy answer against transformers on the same prompt ids."""

    def __init__(self, url: str, build, reference: TransformersReference, key: str = "") -> None:  # noqa: ANN001
        from fleet_common.manifest import load_manifest

        self.url, self.reference, self.tokenizer = url, reference, ChatTokenizer(build)
        self.eos = set(load_manifest(build).manifest.eos_token_ids)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.near_ties = 0

    def ask(self, messages: list[dict], what: str) -> dict:
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=120, headers=self.headers,
                       json={"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        body = r.json()
        got = body["fleet"]["completion_token_ids"]
        prompt = self.tokenizer.encode_chat(messages)
        assert body["usage"]["prompt_tokens"] == len(prompt)
        tokens, margins = self.reference.greedy_with_margins(prompt, MAX_TOKENS)
        if body["choices"][0]["finish_reason"] == "stop":  # ended at end-of-sequence: the reference's next token
            assert tokens[len(got)] in self.eos or margins[len(got)] < 3e-3, what
            tokens, margins = tokens[:len(got)], margins[:len(got)]
        self.near_ties += near_ties(got, tokens, margins, what,
                                    functools.partial(self.reference.forced_with_margins, prompt))
        return {"text": body["choices"][0]["message"]["content"], "prompt": prompt, "ids": got,
                "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def converse(checker: Checker, questions: list[str], what: str) -> tuple[list[dict], list[dict]]:
    messages, turns = [], []
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        turn = checker.ask(messages, f"{what}, turn {i + 1}")
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn["text"]})
    return messages, turns


def reused(turn: dict, prompt: list[int]) -> set[int]:
    """What a prompt after ``turn`` may reuse of the session ``turn`` left: its prompt and answer, all of
    it or all but the newest token (decided and never fed, unless it was an accepted draft)."""
    fed = turn["prompt"] + turn["ids"]
    return {common_prefix(fed, prompt), common_prefix(fed[:-1], prompt)}


def test_chat_turns_edits_and_background_requests(build_2, reference, tmp_path):
    """One user's chat with the build's separate draft model: from turn 2 on, each turn reuses the KV of
    everything before it (the draft's too); a chat edited in the middle reuses exactly up to the edit; a
    client's background request over the whole chat (a title) does not take the chat's KV; a request under
    another API key reuses none of it."""
    fleet = Fleet(build_2, tmp_path, "--draft", DRAFTS[1], "--api-keys", "alice,bob", peers=True)
    try:
        checker = Checker(fleet.url, build_2, reference, "alice")
        messages, turns = converse(checker, QUESTIONS[:3], "chat")
        assert turns[0]["cached"] == 0
        for before, turn in zip(turns, turns[1:]):
            assert turn["cached"] in reused(before, turn["prompt"]), (turn["cached"], len(before["prompt"]))
            assert turn["cached"] >= len(before["prompt"])  # at least the whole previous prompt

        # the first question edited: reuse stops at the edit (a copy; the chat keeps its session)
        edited = [{"role": "user", "content": "What is the capital of Spain?"}, *messages[1:]]
        turn = checker.ask(edited, "edited chat")
        assert turn["cached"] in reused(turns[-1], turn["prompt"])
        assert 16 <= turn["cached"] < len(turns[0]["prompt"]) < len(turn["prompt"]) - 40

        # a title request over the whole chat, then the chat's next turn: still all of the chat cached
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        title = checker.ask([{"role": "user", "content": f"Write a short title for this chat:\n{transcript}"}], "title")
        messages.append({"role": "user", "content": QUESTIONS[3]})
        last = checker.ask(messages, "chat, turn 4")
        assert last["cached"] in reused(turns[-1], last["prompt"]) and last["cached"] >= len(turns[-1]["prompt"])

        # the same chat under another key: prefilled in full (nor its system prompt reused)
        assert Checker(fleet.url, build_2, reference, "bob").ask(messages, "another key's chat")["cached"] == 0

        health = httpx.get(f"{fleet.url}/health", headers=KEY).json()
        assert health["prefix_cache"]["sessions"] >= 2, health["prefix_cache"]
        metrics = httpx.get(f"{fleet.url}/metrics", headers=KEY).text
        cached = sum(t["cached"] for t in [*turns, turn, title, last])
        assert f"fleet_prompt_cached_tokens_total {float(cached)}" in metrics
    finally:
        fleet.stop()
    assert checker.near_ties <= 1


def test_four_users_beyond_the_kv_budget(build_2, reference, tmp_path):
    """Four users chat in turns at once on workers whose KV budget holds fewer sessions than they keep:
    retained sessions are evicted to admit requests, none fails, and every answer equals transformers'."""
    fleet = Fleet(build_2, tmp_path, "--max-queued-requests", "16", peers=True,
                  worker_args=("--kv-budget-mb", "12"))  # ~430 slots at stage 0: two or three sessions
    try:
        checker = Checker(fleet.url, build_2, reference)
        topics = ["the sea", "mountains", "bread", "trains"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            chats = list(pool.map(lambda t: converse(checker, [f"Tell me about {t}.", "Tell me more.",
                                                             "And one more thing?"], t)[1], topics))
        health = httpx.get(f"{fleet.url}/health").json()
        assert health["prefix_cache"]["evictions"] > 0, health["prefix_cache"]
        assert any(turn["cached"] > 0 for turns in chats for turn in turns[1:])  # reuse still happened
        for worker in health["workers"]:
            assert worker["kv_reserved_bytes"] <= worker["kv_budget_bytes"]
    finally:
        fleet.stop()
    assert checker.near_ties <= 2
