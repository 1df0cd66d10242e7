"""fleet-chat's sampling: the user's flags, else what the coordinator serves as its model's
``fallback_sampling`` in /v1/models (its sampling fields with finite numbers only), else nothing."""

from __future__ import annotations

import json

import httpx

from coordinator.chat.client import parse_args, sampling_fields, served_model
from coordinator.engine.sampling import FALLBACK_SAMPLING


def models_client(card: dict) -> httpx.Client:
    """A client whose coordinator answers /v1/models with one model ``card``."""
    def answer(request: httpx.Request) -> httpx.Response:
        # json.dumps writes inf as Infinity, which Python's JSON reader (httpx's) takes back
        return httpx.Response(200, content=json.dumps({"object": "list", "data": [card]}),
                              headers={"content-type": "application/json"})

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_the_coordinators_fallback_applies_only_without_flags():
    assert sampling_fields(parse_args([]), FALLBACK_SAMPLING) == FALLBACK_SAMPLING
    assert sampling_fields(parse_args([]), {}) == {}, "a coordinator serving no fallback: no penalty"
    assert sampling_fields(parse_args(["--temperature", "0.7"]), FALLBACK_SAMPLING) == {"temperature": 0.7}
    assert sampling_fields(parse_args(["--repetition-penalty", "1.2", "--max-tokens", "9", "--seed", "3"]),
                           FALLBACK_SAMPLING) == {"repetition_penalty": 1.2, "max_tokens": 9, "seed": 3}
    assert sampling_fields(parse_args(["--max-tokens", "9"]), FALLBACK_SAMPLING) == {**FALLBACK_SAMPLING, "max_tokens": 9}


def test_the_fallback_is_read_from_the_model_card():
    with models_client({"id": "m", "fallback_sampling": FALLBACK_SAMPLING}) as client:
        assert served_model(client, "http://c") == ("m", FALLBACK_SAMPLING)
    with models_client({"id": "m", "generation_defaults": {}}) as client:  # an older coordinator
        assert served_model(client, "http://c") == ("m", {})
    odd = {"temperature": 0, "stream": False, "messages": [], "frequency_penalty": "high", "top_p": 0.5,
           "max_tokens": 5, "top_k": float("inf"), "presence_penalty": True}
    with models_client({"id": "m", "fallback_sampling": odd}) as client:
        assert served_model(client, "http://c") == ("m", {"temperature": 0, "top_p": 0.5})
