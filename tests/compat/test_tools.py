"""Tool calling as agents use it, through the real openai client: a tool loop (a forced call, the tool's
result, the answer), streamed and not, the stream's ``tool_calls`` deltas joined by openai-python's own
stream helper, a named function, ``auto``, and the refusals. The demo's SmolLM2 template knows no tools,
so fleet offers them in the system prompt and reads Hermes ``<tool_call>`` blocks; with ``tool_choice:
required`` the call is decoded under its grammar, so even a 135M model makes a valid one."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.compat.conftest import assert_error

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": WEATHER_SCHEMA, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"enum": ["UTC", "CET", "PST"]}},
                                              "required": ["zone"], "additionalProperties": False},
                                          "strict": True}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
RESULT = '{"temperature": 21, "sky": "sunny"}'
CALL_TOKENS = 48  # a whole call in the demo's tokens: ~40 with a 20-character city
FORCED = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
          "temperature": 0, "max_tokens": CALL_TOKENS}


@pytest.fixture(scope="module")
def forced(client, model):
    """The forced call, not streamed (two tests compare with it)."""
    return client.chat.completions.create(model=model, **FORCED)


def answer_with_result(client, model, messages, call, **extra):
    """The loop's second turn: the call's result as a tool message, answered in prose (tool_choice none:
    the tools are not offered again, the earlier call and its result are rendered)."""
    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    return client.chat.completions.create(model=model, messages=follow, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=6, **extra)


def test_a_tool_loop_with_a_required_call(client, model, forced):
    """The call is valid under the schema and ends the answer (the grammar is complete after one call
    with parallel_tool_calls false); its result then gets an answer in prose."""
    (choice,) = forced.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.role == "assistant"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    assert forced.usage.completion_tokens < CALL_TOKENS
    second = answer_with_result(client, model, ASK, call.model_dump())
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason in ("stop", "length")


def test_the_streamed_loop_gives_the_same_call_in_tool_call_deltas(client, model, forced):
    """openai-python's stream helper joins the deltas (index, id, name, argument pieces) into the same
    call the whole answer has (temperature 0)."""
    whole = forced.choices[0].message.tool_calls[0]
    with client.chat.completions.stream(model=model, **FORCED) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)
    assert call.function.parsed_arguments == json.loads(whole.function.arguments)  # strict: parsed by the client
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert pieces and "".join(e.arguments_delta for e in pieces) == call.function.arguments
    chunks = [e.chunk for e in events if e.type == "chunk"]
    firsts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or () if tc.id]
    assert [(tc.index, tc.id, tc.type, tc.function.name) for tc in firsts] == [(0, call.id, "function", "get_weather")]
    streamed = list(answer_with_result(client, model, ASK, call.model_dump(exclude={"function": {"parsed_arguments"}}),
                                       stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_a_named_function_is_the_call(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, CLOCK], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=CALL_TOKENS)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])


@pytest.mark.parametrize("strict", [True, False])
def test_auto_answers_in_prose_or_calls_consistently(client, model, strict):
    """``auto`` lets the model answer in prose; with a ``strict`` tool it is decoded under a grammar (prose
    or calls valid under the schema), without one parsed afterwards. Either way content and calls agree
    with the finish reason."""
    tool = {**WEATHER, "function": {**WEATHER["function"], "strict": strict}}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[tool], temperature=0, max_tokens=16)
    (choice,) = r.choices
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        assert all(c.function.name == "get_weather" for c in choice.message.tool_calls)
        if strict and choice.finish_reason == "tool_calls":
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER_SCHEMA)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


REFUSED = [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "content": RESULT}]}, "messages.1"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p for _, p in REFUSED])
def test_bad_tool_fields_get_400_naming_the_field(http, client, model, extra, param):
    body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
    assert_error(http.post(CHAT, json=body), 400, param)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    assert caught.value.param == param
