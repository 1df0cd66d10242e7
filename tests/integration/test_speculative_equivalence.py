"""Greedy with speculation equals greedy without it, token for token, in f32: every draft source
(prompt lookup, the self-int4 model, a separate early-exit model), K in {1, 2, 4, 8}, on 2- and
3-stage fleets of the demo model, with compaction of rejected slots switched on early.

The reference is transformers in f32 on the demo's HF folder (tests/integration/reference.py), not
the fleet's own plain decoding. Hidden slots are exact zeros after the softmax, but attention over a
longer, partly masked KV (and verify windows of several tokens) sums in another order (up to ~6e-5
from plain decoding, f32, measured), and torch sums in yet another (~1e-3): a divergence is accepted
only at a near-tie of the reference (``reference.NEAR_TIE``) at the first differing token, compared on
token ids, and near-ties are bounded per matrix; anything else fails.

Every cell starts its own coordinator against the same workers. By default each cell decodes one of
the 10 prompts (rotating, so each stage count sees all 10); ``FLEET_FULL_MATRIX=1`` runs all 10
prompts in every cell (10 x 128 tokens x 4 K x 3 sources x 2 stage counts).
"""

from __future__ import annotations

import functools
import os

import pytest

from coordinator.tokenizer import ChatTokenizer
from tests.conftest import DRAFTS, chat, start_coordinator, start_worker, wait_ready

from .reference import TransformersReference, near_ties

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France?",
    "Explain how a bicycle works in simple terms.",
    "Write a Python function that reverses a string.",
    "List five fruits and their colors.",
    "Tell me a short story about a robot who learns to paint.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Why is the sky blue? Explain step by step.",
    "Write a haiku about the sea.",
    "What are the three states of matter? Give an example of each.",
    "Summarize the rules of chess in a few sentences.",
]
FULL = os.environ.get("FLEET_FULL_MATRIX") == "1"
NEW_TOKENS = 128 if FULL else 48  # CI: 48 tokens per cell, enough for several compactions from 32 hidden slots
SOURCES = ("ngram", *DRAFTS)
KS = (1, 2, 4, 8)
MAX_NEAR_TIES = 3  # per matrix (12 cells): more would mean the fleet drifts, not rounding at ties


@pytest.fixture(scope="module")
def reference(build_1, demo_hf):
    tokenizer = ChatTokenizer(build_1)
    model = TransformersReference(demo_hf)
    cache: dict[str, tuple] = {}

    def greedy(prompt: str) -> tuple:
        """The reference's greedy tokens, their top-two gaps, and its teacher forcing on the prompt."""
        if prompt not in cache:
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
            forced = functools.partial(model.forced_with_margins, ids)
            cache[prompt] = (*model.greedy_with_margins(ids, NEW_TOKENS), forced)
        return cache[prompt]
    return greedy


@pytest.mark.parametrize("stages", [2, 3])
def test_speculation_equals_plain_greedy(stages, reference, request, tmp_path):
    build = request.getfixturevalue(f"build_{stages}")
    workers = [start_worker(build, shard, tmp_path) for shard in range(stages)]
    peers = [arg for _, address in workers for arg in ("--peer", address)]
    totals = {"drafted": 0, "accepted": 0, "compactions": 0, "near_ties": 0}
    try:
        cell = 0
        for source in SOURCES:
            for k in KS:
                log_dir = tmp_path / f"{source}-k{k}"
                log_dir.mkdir()
                coordinator, url = start_coordinator(
                    build, log_dir, *peers, "--no-discover", "--draft", source, "--spec-k", str(k),
                    "--inference-precision", "f32", "--compact-min-slots", "32")
                try:
                    wait_ready(url)
                    prompts = PROMPTS if FULL else [PROMPTS[cell % len(PROMPTS)]]
                    for prompt in prompts:
                        r = chat(url, prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
                        assert r.status_code == 200, r.text
                        body = r.json()
                        got = body["fleet"]["completion_token_ids"]
                        tokens, margins, forced = reference(prompt)
                        totals["near_ties"] += near_ties(got, tokens, margins,
                                                         f"{stages}-stage, draft {source}, K={k} on {prompt!r}", forced)
                        stats = body["fleet"]
                        assert stats["draft"] == source and stats["drafted_tokens"] > 0, stats
                        totals["drafted"] += stats["drafted_tokens"]
                        totals["accepted"] += stats["accepted_tokens"]
                        totals["compactions"] += stats["compactions"]
                finally:
                    coordinator.stop()
                cell += 1
    finally:
        for proc, _ in workers:
            proc.stop()
    # the matrix exercised acceptance, mask-based rejection and compaction, not just one of them
    assert 0 < totals["accepted"] < totals["drafted"], totals
    assert totals["compactions"] > 0, totals
    assert totals["near_ties"] <= MAX_NEAR_TIES, totals
    print(f"{stages}-stage: {totals}")


def test_concurrent_speculative_sessions_in_one_batch_group(reference, build_2, tmp_path):
    """Five greedy sessions with prompt-lookup drafts share one batch group (``--batch-groups 1``):
    their chunks differ in length every step (left padding), rejections and compactions happen per
    row, and each output still equals plain greedy decoding."""
    import concurrent.futures

    workers = [start_worker(build_2, shard, tmp_path) for shard in range(2)]
    peers = [arg for _, address in workers for arg in ("--peer", address)]
    coordinator, url = start_coordinator(build_2, tmp_path, *peers, "--no-discover", "--draft", "ngram",
                                         "--spec-k", "4", "--batch-groups", "1", "--inference-precision", "f32",
                                         "--compact-min-slots", "32")
    try:
        wait_ready(url)
        prompts = PROMPTS[:5]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: chat(url, p, max_tokens=NEW_TOKENS, ignore_eos=True), prompts))
        batched, ties = 0, 0
        for prompt, r in zip(prompts, replies):
            assert r.status_code == 200, r.text
            tokens, margins, forced = reference(prompt)
            ties += near_ties(r.json()["fleet"]["completion_token_ids"], tokens, margins,
                              f"batched ngram session on {prompt!r}", forced)
            stats = r.json()["fleet"]
            assert stats["drafted_tokens"] > stats["accepted_tokens"] > 0, stats
            batched = max(batched, stats["batch_max"])
        assert batched >= 3, "the sessions did not share steps"
        assert ties <= 1, ties
    finally:
        coordinator.stop()
        for proc, _ in workers:
            proc.stop()
