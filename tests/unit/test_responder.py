"""The coordinator's HTTP API over a stand-in engine (the engine's public surface only, no workers): the one
responder answers chat and legacy completions alike, whole and streamed, each in its own spelling; the
model card serves the chat clients' fallback sampling; a request's cache scope is its key's digest."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from coordinator.api.access import cache_scope
from coordinator.api.app import create_app
from coordinator.engine.grammar_check import GrammarChecker
from coordinator.engine.request import FinishReason, Request, RequestStatus, SamplingParams, TextDelta
from coordinator.engine.sampling import FALLBACK_SAMPLING
from coordinator.settings import CoordinatorSettings
from coordinator.tokenizer import ChatTokenizer

PIECES = ("Hel", "lo", " there")
LOCAL = "http://127.0.0.1"  # the Host check lets IP literals pass


class StandInEngine:
    """What ``api`` and ``completions`` use of an ``Engine``; every request answers ``PIECES``."""

    model_name = "stand-in"
    draft_source = "none"
    max_context = 256

    def __init__(self, model: Path, generation_defaults: dict | None = None, **settings) -> None:
        self.settings = CoordinatorSettings(model=model, **settings)
        self.tokenizer = ChatTokenizer(model)
        vocab_size = self.tokenizer.tokenizer.get_vocab_size()
        self.manifest = SimpleNamespace(architecture=SimpleNamespace(vocab_size=vocab_size, model_type="llama"),
                                        sparse_ffn=None)
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.generation_defaults = generation_defaults or {}
        self.requests: list[tuple[Request, str, str]] = []
        # the real checker (a process started at a request's first tools; it ends with this test process)
        self.grammar_check = GrammarChecker(self.tokenizer.tokenizer.to_str, vocab_size, {2},
                                            self.settings.grammar_check_s, self.settings.grammar_check_mb)

    def request_for(self, ids: list[int], params: SamplingParams, param: str = "messages",
                    kind: str = "chatcmpl") -> Request:
        request = Request(f"{kind}-0", ids, params)
        self.requests.append((request, param, kind))
        return request

    async def generate(self, request: Request) -> AsyncIterator[TextDelta]:
        request.status = RequestStatus.DECODE
        for i, text in enumerate(PIECES):
            request.append(100 + i)
            if i == len(PIECES) - 1:
                request.finish(FinishReason.STOP)
                yield TextDelta(text, FinishReason.STOP)
            else:
                yield TextDelta(text)


def health() -> dict:
    return {"ready": True, "model": "stand-in"}


@pytest.fixture(scope="module")
def engine(demo_hf) -> StandInEngine:
    return StandInEngine(demo_hf)


@pytest.fixture(scope="module")
def client(engine) -> TestClient:
    return TestClient(create_app(engine, health), base_url=LOCAL)


def events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_and_completion_whole(client, engine):
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    request, param, kind = engine.requests[-1]
    assert (param, kind) == ("messages", "chatcmpl") and request.params.max_tokens == 512
    assert chat["object"] == "chat.completion" and chat["model"] == "stand-in"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert chat["usage"]["completion_tokens"] == 3 and chat["fleet"]["completion_token_ids"] == [100, 101, 102]

    legacy = client.post("/v1/completions", json={"prompt": "Once upon a time"}).json()
    request, param, kind = engine.requests[-1]
    assert (param, kind) == ("prompt", "cmpl") and request.params.max_tokens == 16  # OpenAI's legacy default
    assert legacy["object"] == "text_completion"
    assert legacy["choices"] == [{"index": 0, "text": "Hello there", "logprobs": None, "finish_reason": "stop"}]
    assert legacy["usage"] == {**chat["usage"], "prompt_tokens": len(request.prompt_ids),
                               "total_tokens": len(request.prompt_ids) + 3}

    ids = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}).json()
    assert engine.requests[-1][0].prompt_ids == [1, 2, 3] and ids["choices"][0]["text"] == "Hello there"
    bad = client.post("/v1/completions", json={"prompt": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_chat_stream_with_usage(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(client.post("/v1/chat/completions", json=body))
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    choices = [c["choices"] for c in chunks]
    assert choices[0] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]
    assert [c[0]["delta"].get("content") for c in choices[1:4]] == list(PIECES)
    assert choices[4] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert choices[5] == [] and chunks[5]["usage"]["completion_tokens"] == 3 and "fleet" in chunks[5]
    assert all(c["usage"] is None for c in chunks[:5])


def test_completion_stream_without_usage(client):
    chunks = events(client.post("/v1/completions", json={"prompt": "Once", "stream": True}))
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == [*PIECES, ""]  # no opening chunk, then the finish
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]


def test_model_card_serves_the_fallback_sampling(client, demo_hf):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == "stand-in" and card["fallback_sampling"] == FALLBACK_SAMPLING
    assert client.get("/v1/models/stand-in").json() == card
    assert client.get("/v1/models/other").status_code == 404
    own = TestClient(create_app(StandInEngine(demo_hf, {"temperature": 0.6}), health), base_url=LOCAL)
    (card,) = own.get("/v1/models").json()["data"]
    assert card["fallback_sampling"] == {} and card["generation_defaults"] == {"temperature": 0.6}


def test_cache_scope_is_the_keys_digest(demo_hf):
    engine = StandInEngine(demo_hf, api_keys="k1,k2")
    client = TestClient(create_app(engine, health), base_url=LOCAL)
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 401
    for key in ("k1", "k2"):
        r = client.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and engine.requests[-1][0].cache_scope == cache_scope(f"Bearer {key}")
    assert engine.requests[-1][0].cache_scope != engine.requests[-2][0].cache_scope != ""


def test_prompt_byte_limit_names_the_field(client, engine):
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 100_000}]})
    legacy = client.post("/v1/completions", json={"prompt": "a" * 100_000})
    for response, param in ((chat, "messages"), (legacy, "prompt")):
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert error["param"] == param and "bytes long" in error["message"]
