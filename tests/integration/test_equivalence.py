"""Greedy output of 2- and 3-stage fleets (each stage its own process, found by zeroconf on loopback)
equals the single-device reference, transformers in f32 (tests/integration/reference.py), token for
token but at a near-tie of the reference (at most one per fleet), in f32 (docs/precision.md); and so do the
workers ``fleet-coordinator serve --local-workers 2 --inference-precision f32`` starts (OpenVINO's default
thread count, not the one thread of the other cells)."""

from __future__ import annotations

import functools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil

import pytest

from coordinator.tokenizer import ChatTokenizer
from tests.conftest import Fleet, chat, start_coordinator, wait_ready

from .reference import TransformersReference, near_ties

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France?",
    "Explain how a bicycle works in simple terms.",
    "Write a Python function that reverses a string.",
    "List five fruits and their colors.",
    "Tell me a short story about a robot who learns to paint.",
]
NEW_TOKENS = 64


class Pending(dict):
    """prompt -> the future of its reference; reading an item waits for it."""

    def __getitem__(self, prompt: str) -> tuple:
        return super().__getitem__(prompt).result()


@pytest.fixture(scope="module")
def reference(build_1, demo_hf):
    """Per prompt: the reference's greedy tokens, their top-two gaps, and its teacher forcing on the prompt.
    Computed in a background thread while the first fleet starts and answers (a session's step runs on one
    process at a time: a core is left; the reference decodes on one torch thread); reading a prompt's waits
    for it."""
    tokenizer = ChatTokenizer(build_1)
    pool = ThreadPoolExecutor(1)  # one task at a time, in order: the model first
    model = pool.submit(TransformersReference, demo_hf)

    def greedy(prompt: str) -> tuple:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        m = model.result()
        return (*m.greedy_with_margins(ids, NEW_TOKENS), functools.partial(m.forced_with_margins, ids))
    try:
        yield Pending({p: pool.submit(greedy, p) for p in PROMPTS})
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def workers(request, tmp_path_factory):
    """``get(stages)``: announced f32 workers, one per stage of ``build_<stages>`` (a ``Fleet`` without a
    coordinator), started on first use and shared by the cells of that stage count, each of which starts its
    own coordinator over them (found by zeroconf); another stage count's workers are stopped first, so that a
    coordinator hears one build's workers only."""
    started: dict[int, Fleet] = {}

    def get(stages: int) -> Fleet:
        if stages not in started:
            for fleet in started.values():
                fleet.stop()
            started.clear()
            build = request.getfixturevalue(f"build_{stages}")
            started[stages] = Fleet(build, tmp_path_factory.mktemp(f"workers{stages}"), coordinator=False)
        return started[stages]
    yield get
    for fleet in started.values():
        fleet.stop()


@pytest.mark.parametrize("stages,coord_args", [
    (2, ()),
    (3, ("--prefill-chunk", "16")),
    (3, ("--draft", "ngram")),  # adaptive K (fixed K per draft source: test_speculative_equivalence.py)
], ids=["2-stage", "3-stage-chunked", "3-stage-ngram-adaptive"])
def test_fleet_equals_single_device(stages, coord_args, reference, workers, request):
    coordinator, url = workers(stages).add_coordinator(*coord_args, name=request.node.callspec.id)
    ties, drafts = 0, Counter()
    try:
        assert "(mdns)" in coordinator.text(), "workers must be found by zeroconf"
        for prompt in PROMPTS:
            r = chat(url, prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == NEW_TOKENS
            tokens, margins, forced = reference[prompt]
            got = body["fleet"]["completion_token_ids"]
            ties += near_ties(got, tokens, margins, f"{stages}-stage on {prompt!r}", forced)
            drafts.update({k: body["fleet"].get(k, 0) for k in ("drafted_tokens", "accepted_tokens", "verify_ms")})
        assert ties <= 1, f"{ties} near-ties over {len(PROMPTS)} answers"
        if "--draft" in coord_args:  # over every answer: adaptive K drafts less on a loaded machine (its costs)
            assert drafts["drafted_tokens"] > drafts["accepted_tokens"] > 0, drafts  # some accepted, some rejected
            assert drafts["verify_ms"] > 0, drafts
    finally:
        coordinator.stop()


def test_local_workers_at_f32_equal_single_device(build_2, reference, tmp_path):
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", "--local-workers", "2",
                                         "--inference-precision", "f32")
    ties = 0
    try:
        wait_ready(url)
        for prompt in PROMPTS[:2]:
            r = chat(url, prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert r.status_code == 200, r.text
            tokens, margins, forced = reference[prompt]
            ties += near_ties(r.json()["fleet"]["completion_token_ids"], tokens, margins,
                              f"--local-workers 2 on {prompt!r}", forced)
        assert ties <= 1, f"{ties} near-ties over 2 answers"
        workers = [" ".join(c.cmdline()) for c in psutil.Process(coordinator.popen.pid).children(recursive=True)]
        assert sum("--inference-precision f32" in w and "--threads 0" in w for w in workers) == 2, workers
    finally:
        coordinator.stop()
