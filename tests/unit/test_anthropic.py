"""The Anthropic Messages API over a stand-in engine (``test_responder.StandInEngine``: every request answers
"Hello there", no workers): the message and its SSE events, errors in Anthropic's shape on its paths only,
the API key as ``x-api-key`` (through the real ``anthropic`` client too), the conversation a request
becomes, the content blocks of an answer with tool calls, and the stop sequence that ended an answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import anthropic
import httpx2
import pytest
from fastapi.testclient import TestClient

from coordinator.api.access import cache_scope
from coordinator.api.anthropic_api import ContentBlocks, stop_sequence
from coordinator.api.anthropic_schema import MessagesRequest
from coordinator.api.app import create_app
from coordinator.errors import Overloaded, stage_failed
from coordinator.engine.request import FinishReason, Request, RequestStatus, SamplingParams, TextDelta
from coordinator.api.tools import AUTO, DEFAULT, Tool, ToolCall, ToolChoice
from tests.unit.test_responder import LOCAL, StandInEngine, health

HI = {"model": "stand-in", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = (Tool("get_weather", "The weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}}),)
TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.fixture(scope="module")
def engine(demo_hf) -> StandInEngine:
    return StandInEngine(demo_hf)


@pytest.fixture(scope="module")
def client(engine) -> TestClient:
    return TestClient(create_app(engine, health), base_url=LOCAL)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of ``text``; the name is the data's type."""
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[7:], json.loads(data[6:])))
        assert out[-1][0] == out[-1][1]["type"]
    return out


def test_message_whole_and_streamed(client, engine):
    response = client.post("/v1/messages", json={**HI, "system": "Be brief.", "temperature": 0.5, "top_k": 3,
                                                 "metadata": {"user_id": "u1"}})
    whole = response.json()
    assert response.headers["request-id"] == whole["id"]  # the anthropic client's message._request_id
    request, param, kind = engine.requests[-1]
    assert (param, kind) == ("messages", "msg") and request.params.max_tokens == 8
    assert (request.params.temperature, request.params.top_k) == (0.5, 3)
    assert {k: whole[k] for k in ("type", "role", "model", "content", "stop_reason", "stop_sequence")} == {
        "type": "message", "role": "assistant", "model": "stand-in", "content": [{"type": "text", "text": "Hello there"}],
        "stop_reason": "end_turn", "stop_sequence": None}
    assert whole["usage"] == {"input_tokens": len(request.prompt_ids), "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0, "output_tokens": 3}
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in HI.items() if k != "max_tokens"}
                          | {"system": "Be brief."}).json()
    assert counted == {"input_tokens": len(request.prompt_ids)}

    events = sse_events(client.post("/v1/messages", json={**HI, "stream": True}).text)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                            "content_block_delta", "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for _, e in events[3:6]) == "Hello there"
    delta = events[7][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3 and delta["fleet"]["completion_token_ids"] == [100, 101, 102]


def test_errors_in_anthropic_shape_on_its_paths_only(client):
    def error(response, status: int, kind: str, *words: str) -> None:
        body = response.json()
        assert response.status_code == status and set(body) == {"type", "error"} and body["type"] == "error", body
        assert body["error"]["type"] == kind and all(w in body["error"]["message"] for w in words), body

    user = [{"role": "user", "content": "x"}]
    error(client.post("/v1/messages", json={**HI, "model": "claude-x"}), 404, "not_found_error", "claude-x")
    error(client.post("/v1/messages", json={"model": "stand-in", "messages": user}), 400, "invalid_request_error",
          "max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    error(client.post("/v1/messages", json={**HI, "messages": [{"role": "user", "content": [image]}]}), 400,
          "invalid_request_error", "messages.0.content", "image")
    for field, value, words in (("tools", [{"type": "web_search_20250305", "name": "web_search"}], ("server tool",)),
                                ("thinking", {"type": "enabled", "budget_tokens": 2048}, ("thinking",)),
                                ("mcp_servers", [{"type": "url", "url": "http://x", "name": "x"}], ("mcp_servers",)),
                                ("stop_sequences", [""], ("stop_sequences",)),
                                ("temperature", 1.5, ("temperature",)),
                                ("n", 2, ("n", "Extra inputs")),
                                ("tool_choice", {"type": "any"}, ("tool_choice", "no tools")),
                                ("messages", [*user, {"role": "assistant", "content": "y"}], ("messages", "prefill"))):
        error(client.post("/v1/messages", json={**HI, field: value}), 400, "invalid_request_error", *words)
    error(client.get("/v1/messages"), 405, "invalid_request_error")
    error(client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"}), 400,
          "invalid_request_error", "JSON")
    openai = client.post("/v1/chat/completions", json={"model": "claude-x", "messages": user}).json()
    assert openai["error"]["code"] == "model_not_found" and openai["error"]["param"] == "model"


def test_api_key_as_x_api_key(demo_hf):
    """``x-api-key`` (Anthropic's clients) is a key as ``Authorization: Bearer`` is, on every path, with the
    same cache scope (on the OpenAI endpoints too: a scope of "" would let every x-api-key user reuse the
    others' KV); a refusal on /v1/messages is Anthropic's ``authentication_error``, which the real
    client raises as ``AuthenticationError``."""
    engine = StandInEngine(demo_hf, api_keys="k1")
    app = create_app(engine, health)
    client = TestClient(app, base_url=LOCAL)
    refused = client.post("/v1/messages", json=HI, headers={"x-api-key": "k2"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/messages", json=HI).json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/chat/completions", json={"messages": HI["messages"]}).json()["error"]["code"] == \
        "invalid_api_key"
    for headers in ({"x-api-key": "k1"}, {"Authorization": "Bearer k1"}):
        assert client.post("/v1/messages", json=HI, headers=headers).status_code == 200
        assert engine.requests[-1][0].cache_scope == cache_scope("Bearer k1") == cache_scope(None, "k1") != ""
    assert client.post("/v1/chat/completions", json={"messages": HI["messages"]}, headers={"x-api-key": "k1"}) \
        .status_code == 200
    assert engine.requests[-1][0].cache_scope == cache_scope("Bearer k1")  # not "", shared by every x-api-key

    async def with_client(key: str) -> str:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=LOCAL)
        async with anthropic.AsyncAnthropic(api_key=key, base_url=LOCAL, http_client=http, max_retries=0) as real:
            message = await real.messages.create(model="stand-in", max_tokens=8, messages=HI["messages"])
            return message.content[0].text

    assert asyncio.run(with_client("k1")) == "Hello there"
    with pytest.raises(anthropic.AuthenticationError, match="invalid API key"):
        asyncio.run(with_client("wrong"))


def test_conversation_with_tool_use_and_results():
    body = MessagesRequest.model_validate({
        "model": "", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "user", "content": [{"type": "text", "text": "And quickly.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                         {"type": "text", "text": "Thanks."}]}],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}})
    assert body.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?\n\nAnd quickly."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [ToolCall("toolu_1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "Thanks."}]
    tools, choice, parallel = body.tool_request()
    assert [t.name for t in tools] == ["get_weather"] and choice == ToolChoice("function", "get_weather")
    assert parallel is False


def test_content_blocks_of_tool_calls():
    """The streamed events and the whole answer give the same blocks: text, then one tool_use per call;
    ``disable_parallel_tool_use`` keeps the first call; a forced answer has no text; a call cut short is text."""
    streamed = ContentBlocks(DEFAULT, WEATHER, AUTO, single=False)
    events = streamed.opening() + [e for i in range(0, len(TWO_CALLS), 7) for e in streamed.feed(TWO_CALLS[i:i + 7])]
    events += streamed.close()
    blocks: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"], **({"input": ""} if "input" in event["content_block"] else {})))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text"] += delta["text"]
            else:
                blocks[-1]["input"] += delta["partial_json"]
    assert [e["type"] for e in events].count("content_block_stop") == len(blocks) == 3
    whole = ContentBlocks(DEFAULT, WEATHER, AUTO, single=False).whole(TWO_CALLS)
    assert [b["type"] for b in whole] == ["text", "tool_use", "tool_use"] and whole[0]["text"] == "Let me look.\n"
    assert [b["input"] for b in whole[1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [json.loads(b["input"]) for b in blocks[1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(b["id"].startswith("toolu_") for b in whole[1:])
    single = ContentBlocks(DEFAULT, WEATHER, AUTO, single=True)
    assert [b["type"] for b in single.whole(TWO_CALLS)] == ["text", "tool_use"] and single.calls == 1
    forced = ContentBlocks(DEFAULT, WEATHER, ToolChoice("required"), single=False).whole(TWO_CALLS)
    assert [b["type"] for b in forced] == ["tool_use", "tool_use"]
    cut = ContentBlocks(DEFAULT, WEATHER, AUTO, single=False).whole('<tool_call>\n{"name": "get_weather", '
                                                                     '"arguments": {"city": "Pa')
    assert cut == [{"type": "text", "text": '{"name": "get_weather", "arguments": {"city": "Pa}'}]
    assert ContentBlocks(DEFAULT, WEATHER, AUTO, single=False).whole("") == [{"type": "text", "text": ""}]
    assert ContentBlocks(DEFAULT, (), AUTO, single=False).whole("Hi") == [{"type": "text", "text": "Hi"}]


def test_stop_sequence_that_ended_the_answer(engine):
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("The capital is Paris. It is")
    request = Request("msg-0", [1], SamplingParams(max_tokens=16, stop=("It", ". I", "xyz")))
    for token in ids:
        request.append(token)
    request.finish(FinishReason.STOP)
    assert stop_sequence(request, "The capital is Paris", tokenizer) == ". I"
    assert stop_sequence(request, "The capital is Paris. ", tokenizer) == "It"
    assert stop_sequence(request, "The capital is Paris. It is", tokenizer) is None  # the end of sequence
    request.finish_reason = FinishReason.LENGTH
    assert stop_sequence(request, "The capital is Paris", tokenizer) is None


class FailingEngine(StandInEngine):
    """A stand-in whose requests fail: ``before`` the first delta (the queue is full), or after one (a stage
    failed mid-stream)."""

    def __init__(self, model, before: bool) -> None:
        super().__init__(model)
        self.before = before

    async def generate(self, request: Request) -> AsyncIterator[TextDelta]:
        if self.before:
            raise Overloaded("3 requests are queued, the most this coordinator takes; retry shortly")
        request.status = RequestStatus.DECODE
        request.append(100)
        yield TextDelta("Hel")
        raise stage_failed(1, "127.0.0.1:9", "a pipeline step", detail="StatusCode.UNAVAILABLE")


def test_failures_before_and_during_a_stream(demo_hf):
    """A full queue is Anthropic's 529 ``overloaded_error`` (the client's ``OverloadedError``, which it
    retries); a stage failing mid-stream ends the stream with an ``error`` event after what was sent."""
    busy = TestClient(create_app(FailingEngine(demo_hf, before=True), health), base_url=LOCAL)
    for stream in (False, True):
        response = busy.post("/v1/messages", json={**HI, "stream": stream})
        assert response.status_code == 529 and response.json()["error"]["type"] == "overloaded_error"
    assert busy.post("/v1/chat/completions", json={"messages": HI["messages"]}).status_code == 429  # OpenAI's

    failing = TestClient(create_app(FailingEngine(demo_hf, before=False), health), base_url=LOCAL)
    events = sse_events(failing.post("/v1/messages", json={**HI, "stream": True}).text)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                            "error"]
    error = events[-1][1]["error"]
    assert error["type"] == "api_error" and "stage 1" in error["message"] and "UNAVAILABLE" in error["message"]
    assert "/v1/messages" in failing.get("/openapi.json").json()["paths"]


class FullContextEngine(StandInEngine):
    """A stand-in whose context leaves room for 2 tokens: ``request_for`` cuts ``max_tokens`` as the engine's does."""

    def request_for(self, ids: list[int], params: SamplingParams, param: str = "messages",
                    kind: str = "chatcmpl") -> Request:
        params.max_tokens = min(params.max_tokens, 2)
        return super().request_for(ids, params, param, kind)

    async def generate(self, request: Request) -> AsyncIterator[TextDelta]:
        request.status = RequestStatus.DECODE
        for token in range(100, 100 + request.params.max_tokens):
            request.append(token)
        request.finish(FinishReason.LENGTH)
        yield TextDelta("Hel", FinishReason.LENGTH)


def test_a_full_context_is_not_max_tokens(demo_hf):
    client = TestClient(create_app(FullContextEngine(demo_hf), health), base_url=LOCAL)
    assert client.post("/v1/messages", json=HI).json()["stop_reason"] == "model_context_window_exceeded"
    assert client.post("/v1/messages", json={**HI, "max_tokens": 2}).json()["stop_reason"] == "max_tokens"
    events = sse_events(client.post("/v1/messages", json={**HI, "stream": True}).text)
    assert events[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
