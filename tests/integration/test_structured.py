"""Structured output through a real fleet (the 2-stage demo build, f32 workers): the twenty schemas of
tests/compat/schemas.py answered greedily by three coordinators over the same workers (plain decoding, the
self-int4 draft model with K = 3, prompt lookup with K = 3), every answer valid under its schema (the
``jsonschema`` library) and the drafting coordinators' token ids equal to plain decoding's: speculation
under a grammar is lossless. Each coordinator gets its 20 requests 8 at a time (batch groups; f32 greedy is batch-invariant)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.compat.schemas import SCHEMAS, chat_body
from tests.conftest import Fleet

pytestmark = pytest.mark.integration

CLIENTS = 8  # --max-batch


@pytest.fixture(scope="module")
def fleet(build_2, tmp_path_factory):
    fleet = Fleet(build_2, tmp_path_factory.mktemp("structured"), peers=True)
    # the two drafting coordinators start together (each loads its tokenizer, grammar engine and draft on its own)
    with ThreadPoolExecutor(2) as pool:
        started = {draft: pool.submit(fleet.add_coordinator, "--spec-k", "3", draft=draft, name=draft)
                   for draft in ("self-int4", "ngram")}
    urls = {"plain": fleet.url, **{draft: future.result()[1] for draft, future in started.items()}}
    yield urls
    fleet.stop()


def answers(url: str) -> list[dict]:
    """Each schema's chat completion from the coordinator at ``url`` (CLIENTS at a time)."""
    def one(case: tuple[str, str, dict]) -> dict:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(*case), timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, SCHEMAS))


def test_every_answer_validates_and_speculation_under_a_grammar_is_lossless(fleet):
    results = {name: answers(url) for name, url in fleet.items()}  # one coordinator at a time (60 at once on 2
    # loaded cores kept a Merge behind prefills past its deadline: a stage "stopped answering")
    plain = results["plain"]
    for (name, _, schema), body in zip(SCHEMAS, plain):
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", (name, choice)  # the JSON ended, not the token budget
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        grammar = body["fleet"]["grammar"]
        assert grammar["masks"] >= body["usage"]["completion_tokens"]
    for draft in ("self-int4", "ngram"):
        drafted = results[draft]
        for (name, _, _), want, got in zip(SCHEMAS, plain, drafted):
            assert got["fleet"]["completion_token_ids"] == want["fleet"]["completion_token_ids"], (draft, name)
        if draft == "self-int4":  # the draft model did draft (prompt lookup finds little to repeat in short JSON)
            assert sum(b["fleet"]["drafted_tokens"] for b in drafted) > 0
            assert sum(b["fleet"]["accepted_tokens"] for b in drafted) > 0


def test_candidates_and_logprobs_are_the_constrained_ones(fleet):
    """Every top_logprobs candidate is a token the grammar allows there: a JSON object's first token
    starts it with ``{``, and its logprobs form a distribution over the allowed tokens."""
    body = {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 0, "max_tokens": 8,
            "logprobs": True, "top_logprobs": 5, "response_format": {"type": "json_object"}}
    r = httpx.post(f"{fleet['plain']}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"].startswith("{")
    assert all(c["token"].lstrip().startswith("{") for c in first["top_logprobs"]), first["top_logprobs"]
    plain = httpx.post(f"{fleet['plain']}/v1/chat/completions", timeout=120,
                       json={k: v for k, v in body.items() if k != "response_format"}).json()
    # masking renormalizes: the chosen token's logprob under the grammar is at least its unconstrained one
    unconstrained = {c["token"]: c["logprob"] for c in plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    if first["token"] in unconstrained:
        assert first["logprob"] >= unconstrained[first["token"]] - 1e-4
