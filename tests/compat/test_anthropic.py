"""The Anthropic Messages API through the real ``anthropic`` client (the client appends /v1/messages to the
fleet's URL): a message with a system prompt, its stream (``messages.stream`` and the raw events),
``stop_sequences`` and ``max_tokens`` as stop reasons, errors as the client's typed exceptions, and a tool
loop (a forced call, streamed too, then the tool's result answered). The client (2.10) no longer has
sampling arguments: ``temperature`` goes in ``extra_body``, as any field the client does not know.
Authentication (``x-api-key``, ``AuthenticationError``) is tested in-process: tests/unit/test_anthropic.py."""

from __future__ import annotations

import os

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER_SCHEMA}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CALL_TOKENS = 48  # a whole call in the demo's tokens: ~40 with a 20-character city


@pytest.fixture(scope="module")
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=os.environ.get("FLEET_API_KEY", "unused"), max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def answer(claude, model) -> anthropic.types.Message:
    """A greedy answer with a system prompt, not streamed (the stream and the stop sequence compare with it)."""
    return claude.messages.create(model=model, max_tokens=24, system="Answer briefly.", messages=ASK, **GREEDY)


def test_message_with_a_system_prompt(claude, model, answer):
    assert answer.type == "message" and answer.role == "assistant" and answer.model == model
    assert answer.id and [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.stop_sequence is None
    usage = answer.usage
    assert 0 < usage.output_tokens <= 24
    counted = claude.messages.count_tokens(model=model, system="Answer briefly.", messages=ASK).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == counted  # the prompt, prefilled or reused
    assert claude.messages.count_tokens(model=model, messages=ASK).input_tokens != counted  # the system prompt counts


def test_stream_helper_and_raw_events(claude, model, answer):
    """``messages.stream`` joins the text deltas into the same greedy answer; the raw events come in
    Anthropic's order, a stop at ``max_tokens`` in the ``message_delta``."""
    with claude.messages.stream(model=model, max_tokens=24, system="Answer briefly.", messages=ASK, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == answer.content[0].text
    assert final.stop_reason == answer.stop_reason and final.usage.output_tokens == answer.usage.output_tokens

    events = list(claude.messages.create(model=model, max_tokens=3, messages=ASK, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"], kinds
    assert set(kinds[2:-3]) == {"content_block_delta"}, kinds  # the client drops the ping
    assert events[0].message.content == [] and events[0].message.usage.input_tokens > 0
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events[2:-3])
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 3


def test_stop_sequence_and_max_tokens(claude, model, answer):
    text = answer.content[0].text
    word = text.split()[1]  # the answer stops before its second word
    stopped = claude.messages.create(model=model, max_tokens=24, system="Answer briefly.", messages=ASK,
                                     stop_sequences=["no such words", word], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]
    short = claude.messages.create(model=model, max_tokens=2, messages=ASK, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2 and short.stop_sequence is None


def test_errors_are_the_clients_typed_exceptions(claude, model):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported") as refused:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model=model, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="Extra inputs are not permitted"):
        claude.messages.create(model=model, max_tokens=4, messages=ASK, extra_body={"frequency_penalty": 1})
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error" and model in str(missing.value)


def test_a_tool_loop_with_a_forced_call(claude, model):
    """``tool_choice`` any with one call allowed: a tool_use block valid under the schema (constrained
    decoding) and stop_reason tool_use; the same call streamed as ``input_json_delta`` pieces (greedy); its
    tool_result then gets an answer in text."""
    forced = {"model": model, "max_tokens": CALL_TOKENS, "tools": [WEATHER], "messages": WEATHER_ASK, **GREEDY}
    call = claude.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **forced)
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"], call
    (use,) = call.content
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    with claude.messages.stream(tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}, **forced) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", use.input)]

    follow = [*WEATHER_ASK, {"role": "assistant", "content": call.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": '{"temperature": 21, "sky": "sunny"}'}]}]
    reply = claude.messages.create(model=model, max_tokens=6, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=follow, **GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
