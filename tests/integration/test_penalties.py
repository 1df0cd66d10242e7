"""Penalties and the model's sampling defaults through the API, on the real demo build (issue 20, item 7).

Greedy, the demo model loops on this prompt to the token cap ("A world where the sea is a place, a place
where the sea is a place, ..."); a frequency penalty of 0.3 (the chat clients' fallback for a model without
sampling defaults, served in /v1/models as ``fallback_sampling``) ends the poem. With a draft model on,
penalized greedy answers are the same tokens as without one (verification uses the penalized targets), and
greedy without penalties is unchanged."""

from __future__ import annotations

import json

import httpx
import pytest

from coordinator.engine.sampling import FALLBACK_SAMPLING
from tests.conftest import Fleet, start_coordinator, wait_ready

POEM = "Write a short poem about the sea."


# Greedy loops from about token 45 on (13 times "a place where the sea is a place" in 300 tokens, 7 in 200); the
# frequency penalty's poem ends after 160 tokens (measured): 200 shows both. Drafting compares the first
# ``DRAFTED_TOKENS`` (greedy, penalized or not: the first N tokens of a longer answer are the N-token answer).
MAX_TOKENS = 200
DRAFTED_TOKENS = 100


def ask(url: str, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": POEM}], "max_tokens": MAX_TOKENS, **kw}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def fleet(build_2, tmp_path_factory):
    """One f32 worker per stage of build_2 (peers, not announced) and a coordinator decoding plainly; the
    drafting coordinator and the model-defaults one of this module run over the same workers."""
    fleet = Fleet(build_2, tmp_path_factory.mktemp("plain"), peers=True)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def plain(fleet):
    return fleet.url


@pytest.fixture(scope="module")
def drafted(fleet):
    return fleet.add_coordinator("--draft", "self-int4", "--spec-k", "3", name="drafted")[1]


@pytest.fixture(scope="module")
def ask_plain(plain):
    """``ask(plain, **kw)``, each request made once per module: the plain coordinator's answers are greedy or
    seeded on f32 workers, so the drafting test compares with the answers the first test already had."""
    answers: dict[str, dict] = {}

    def get(**kw) -> dict:
        key = json.dumps(kw, sort_keys=True)
        if key not in answers:
            answers[key] = ask(plain, **kw)
        return answers[key]
    return get


def test_a_penalty_ends_the_greedy_loop(plain, ask_plain):
    looping = ask_plain(temperature=0)
    assert looping["choices"][0]["finish_reason"] == "length"
    assert looping["choices"][0]["message"]["content"].count("a place where the sea is a place") >= 3
    penalized = ask_plain(**FALLBACK_SAMPLING)
    assert penalized["choices"][0]["finish_reason"] == "stop"
    assert penalized["fleet"]["completion_token_ids"] != looping["fleet"]["completion_token_ids"]
    used = penalized["fleet"]["sampling"]
    assert used["frequency_penalty"] == FALLBACK_SAMPLING["frequency_penalty"] and used["temperature"] == 0
    assert used["from_model"] == []  # the demo's generation_config.json holds no sampling defaults
    card = httpx.get(f"{plain}/v1/models", timeout=10).json()["data"][0]
    assert card["fallback_sampling"] == FALLBACK_SAMPLING  # what fleet-chat and the chat page send


def test_drafting_with_penalties_gives_the_same_answer(ask_plain, drafted):
    # the first two plain answers are the first test's (200 tokens); the third is asked for 100 alone
    for kw in ({"temperature": 0}, {**FALLBACK_SAMPLING}, {"temperature": 0, "repetition_penalty": 1.3,
                                                       "presence_penalty": 0.2, "max_tokens": DRAFTED_TOKENS}):
        want = ask_plain(**kw)["fleet"]["completion_token_ids"][:DRAFTED_TOKENS]
        got = ask(drafted, **{**kw, "max_tokens": DRAFTED_TOKENS})
        assert got["fleet"]["completion_token_ids"] == want, kw
        assert got["fleet"]["drafted_tokens"] > 0
    sampled = ask(drafted, temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.5, max_tokens=60)
    assert sampled["choices"][0]["finish_reason"] in ("stop", "length") and sampled["choices"][0]["message"]["content"]
    assert sampled["fleet"]["drafted_tokens"] > 0


def test_model_defaults_apply_and_an_explicit_temperature_wins(build_2, fleet, ask_plain, tmp_path):
    """A copy of the build whose generation_config.json holds sampling defaults, served by its own
    coordinator over the same workers (they serve build_2, the same stages)."""
    copy = tmp_path / "build"
    copy.mkdir()
    for entry in build_2.iterdir():
        if entry.name != "generation_config.json":
            (copy / entry.name).symlink_to(entry)
    (copy / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.3, "top_p": 0.95,
                                                             "max_new_tokens": 12}))
    peers = [a for address in fleet.peers for a in ("--peer", address)]
    coordinator, url = start_coordinator(copy, tmp_path, "--no-discover", *peers)
    try:
        wait_ready(url)
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        assert card["fallback_sampling"] == {}, "a model with sampling defaults of its own gets no fallback"
        silent = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": POEM}]},
                            timeout=120).json()
        used = silent["fleet"]["sampling"]
        assert (used["temperature"], used["top_p"], used["max_tokens"]) == (1.3, 0.95, 12)
        assert set(used["from_model"]) == {"temperature", "top_p", "max_tokens"}
        assert silent["usage"]["completion_tokens"] <= 12
        greedy = ask(url, temperature=0, max_tokens=40)
        assert greedy["fleet"]["sampling"]["temperature"] == 0 and "temperature" not in greedy["fleet"]["sampling"]["from_model"]
        # the plain coordinator's greedy answer, cut to 40 tokens (f32 workers: a greedy answer's first tokens
        # do not depend on max_tokens)
        want = ask_plain(temperature=0)["fleet"]["completion_token_ids"][:40]
        assert greedy["fleet"]["completion_token_ids"] == want
    finally:
        coordinator.stop()
