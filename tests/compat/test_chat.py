"""Chat completions as openai-python, LangChain and Open WebUI use them: /v1/models, the response and
SSE shapes, include_usage, max_completion_tokens, error bodies and status codes, prefill progress."""

from __future__ import annotations

import re
import uuid

import openai
import pytest

from tests.compat.conftest import EXTERNAL, assert_error, read_stream, replay

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_models_list_ids_and_object_fields(http, client, model):
    """Open WebUI lists and verifies models with GET /v1/models (``data[].id``); openai-python parses
    ``Model`` (id, object, created, owned_by) and retrieves one by id."""
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and body["data"], body
    for card in body["data"]:
        assert isinstance(card["id"], str) and card["id"]
        assert card["object"] == "model" and isinstance(card["created"], int) and isinstance(card["owned_by"], str)
    assert [m.id for m in client.models.list().data] == [c["id"] for c in body["data"]]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"no-such-model-{uuid.uuid4().hex[:6]}")


def test_chat_response_shape(client, model):
    r = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12)
    assert r.object == "chat.completion" and r.id and isinstance(r.created, int) and r.model == model
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_cached_tokens_on_a_repeated_prompt(client, model):
    """How users diagnose prefix caching: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's
    field, which llama.cpp and exo fill; vLLM's test_cache_accounting asks the same of a repeat)."""
    messages = [{"role": "user", "content": f"Tell me about owls, reader {uuid.uuid4().hex[:8]}."}]
    first, second = (client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
                     for _ in range(2))
    for r in (first, second):
        assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    if not EXTERNAL:  # fleet keeps the KV: all but the last prompt token (it is run for the first token's logits)
        assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_stream_wire_shape_and_include_usage(http, model):
    """The SSE rules (llama.cpp's and vLLM's server tests): text/event-stream; one id; the first chunk
    is the assistant role; the finish chunk has no content; with include_usage every chunk has
    ``usage: null`` but the last, which has ``choices: []`` and the usage; then ``data: [DONE]``;
    the streamed text equals the text not streamed (greedy)."""
    body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 12}
    s = read_stream(http, CHAT, {**body, "stream_options": {"include_usage": True}})
    assert s.content_type.startswith("text/event-stream"), s.content_type
    assert s.done and s.order[-1] == "done"
    assert len({c["id"] for c in s.chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in s.chunks)
    first, *middle, finish, last = s.chunks
    assert first["choices"][0]["delta"]["role"] == "assistant" and not first["choices"][0]["delta"].get("content")
    assert all("usage" in c and c["usage"] is None for c in s.chunks[:-1])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert not finish["choices"][0]["delta"].get("content")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in middle)
    full = http.post(CHAT, json=body).json()
    assert text == full["choices"][0]["message"]["content"]
    usage = last["usage"]
    # the counts agree; cached_tokens may not (the second request reuses the first one's KV)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage[k] for k in counts] == [full["usage"][k] for k in counts], (usage, full["usage"])
    assert "cached_tokens" in usage["prompt_tokens_details"] and "cached_tokens" in full["usage"]["prompt_tokens_details"]
    # without include_usage: no usage chunk, no usage field
    plain = read_stream(http, CHAT, body)
    assert plain.done and all(c["choices"] for c in plain.chunks) and all("usage" not in c or c["usage"] is None
                                                                           for c in plain.chunks)


def test_openai_client_stream_with_usage(client, model):
    """What Open WebUI (always) and LangChain (stream_usage) read: the last chunk's usage."""
    chunks = list(client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices)
    assert text and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_max_completion_tokens_is_honoured(client, model, field):
    """LangChain >= 0.3 sends max_completion_tokens instead of max_tokens (langchain #30113); a server
    ignoring it generated 40k tokens (ik_llama.cpp PR #2321)."""
    long = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    r = client.chat.completions.create(model=model, messages=long, temperature=0, **{field: 3})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", r
    chunks = list(client.chat.completions.create(model=model, messages=long, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, **{field: 3}))
    assert chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_fields_clients_send_are_accepted(http, model):
    """LangChain sends ``n: 1`` explicitly (langchain #28943); clients add vendor fields; user,
    metadata, store: false, response_format text and tool_choice none change nothing."""
    body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 4, "n": 1, "user": "u1",
            "metadata": {"k": "v"}, "store": False, "response_format": {"type": "text"}, "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": False}, "return_progress": True, "parallel_tool_calls": False}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    plain = http.post(CHAT, json={"model": model, "messages": HI, "temperature": 0, "max_tokens": 4})
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


REFUSED = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools"),  # only function tools
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 10_000}, "top_logprobs"),
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"temperature": 5}, "temperature"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p for _, p in REFUSED])
def test_unsupported_and_bad_fields_get_400_naming_the_field(http, client, model, extra, param):
    body = {"model": model, "messages": HI, "max_tokens": 4, **extra}
    error = assert_error(http.post(CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:  # openai-python maps the status and keeps the body
        client.chat.completions.create(**body)
    assert caught.value.param == param


def test_error_status_codes(http, model):
    assert_error(http.post(CHAT, json={"model": f"gpt-{uuid.uuid4().hex[:6]}", "messages": HI}), 404, "model")
    assert_error(http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post(CHAT, json={"model": model, "messages": [{"role": "user", "content": "hi " * 200_000}]}),
                 400, "messages")
    assert_error(http.get("/v1/no-such-endpoint"), 404)


def test_prefill_progress_comments(http, model):
    """A long streamed prompt reports prefill progress as SSE comments (``: prefill DONE/TOTAL``) once
    it has prefilled for 0.5 s, before its first token; openai-python skips them (replayed through
    the real client). The local fleet prefills in 16-token steps, so its ~850-token prompt takes long
    enough to report (checked by the time its first token took)."""
    words = " ".join(f"{uuid.uuid4().hex[:4]}" for _ in range(200))  # unique: no cached prefix
    messages = [{"role": "user", "content": f"Here are some codes: {words}. Which one comes first?"}]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 2,
            "stream_options": {"include_usage": True}}
    s = read_stream(http, CHAT, body)
    total = s.chunks[-1]["usage"]["prompt_tokens"]
    progress = [tuple(map(int, re.fullmatch(r": prefill (\d+)/(\d+)", c).groups())) for c in s.comments]
    assert all(t == total and 0 <= d <= t for d, t in progress), (progress, total)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    if progress:
        assert s.order.index("comment") > s.order.index("data")  # after the opening chunk: the 200 went out
    if s.first_content_s > 1.0:  # prefilled past the 0.5 s mark
        assert progress, f"no prefill progress in {s.first_content_s:.1f} s before the first token"
    if not EXTERNAL:
        print(f"prefill of {total} tokens: first token after {s.first_content_s:.2f} s, {len(progress)} comments")
    answer = list(replay(s.raw).chat.completions.create(stream=True, **body))
    assert answer[-1].usage.prompt_tokens == total
    assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices) == "".join(
        c["choices"][0]["delta"].get("content") or "" for c in s.chunks if c["choices"])
