"""The Ollama API's pure parts (coordinator/api/ollama_schema, ollama_api): ``options`` mapped onto the sampling
fields or refused by name, model names with Ollama's tag, ``format`` as a constraint, a conversation's
calls and results matched by ``tool_name``, and the answer's tool calls spelled as Ollama does (arguments
as an object), whole and streamed. Through a real fleet and the real ``ollama`` client:
tests/compat/test_ollama.py."""

from __future__ import annotations

import json

import pytest

from coordinator.api.access import ApiKeys
from coordinator.errors import InvalidRequest, ModelNotFound
from coordinator.api.ollama_api import ChatSpelling
from coordinator.api.ollama_errors import ollama_error
from coordinator.api.ollama_schema import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    chat_messages,
    check_model_name,
    format_constraint,
    sampling_request,
)
from coordinator.api.tool_chat import ToolAnswer
from coordinator.api.tools import AUTO, DEFAULT, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_options_map_onto_the_sampling_fields():
    body = OllamaChatRequest(model="m", options={"temperature": 0.2, "top_p": 0.5, "top_k": 7, "seed": -1,
                                                 "num_predict": 9, "stop": ["\n"], "repeat_penalty": 1.2,
                                                 "presence_penalty": 0.1, "frequency_penalty": 0.3, "num_ctx": 64,
                                                 "num_thread": 4, "mirostat": 0, "min_p": 0.0, "repeat_last_n": -1,
                                                 "typical_p": None},
                             logprobs=True, top_logprobs=3, format="json")
    sampling = sampling_request(body, max_context=128)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens, sampling.stop) == \
        (0.2, 0.5, 7, 9, ["\n"])
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.2, 0.1, 0.3)
    assert sampling.seed is None and sampling.logprob_count() == 3  # Ollama's -1: a random seed
    assert sampling.output_constraint().field == "format"
    until_full = sampling_request(OllamaGenerateRequest(model="m", options={"num_predict": -1}), max_context=128)
    assert until_full.max_tokens == 128 and sampling_request(OllamaGenerateRequest(), 128).max_tokens is None


@pytest.mark.parametrize("options, named", [
    ({"mirostat": 1}, "options.mirostat"), ({"tfs_z": 0.5}, "options.tfs_z"), ({"min_p": 0.05}, "options.min_p"),
    ({"typical_p": 0.7}, "options.typical_p"), ({"vocab_only": True}, "options.vocab_only"),
    ({"made_up": 1}, "options.made_up"), ({"num_ctx": 4096}, "options.num_ctx"), ({"num_ctx": "big"}, "options.num_ctx"),
    ({"num_predict": 0}, "options.num_predict"), ({"temperature": 5}, "options.temperature"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 64}, "options.repeat_last_n"), ({"top_p": "x"}, "options.top_p"),
])
def test_options_fleet_cannot_honour_are_refused_by_name(options, named):
    with pytest.raises(InvalidRequest) as caught:
        sampling_request(OllamaChatRequest(model="m", options=options), max_context=2048)
    assert caught.value.param == named


@pytest.mark.parametrize("body, named", [
    (OllamaGenerateRequest(prompt="a", suffix="b"), "suffix"), (OllamaGenerateRequest(prompt="a", images=["x"]), "images"),
    (OllamaGenerateRequest(prompt="a", template="{{ .Prompt }}"), "template"),
    (OllamaGenerateRequest(prompt="a", context=[1, 2]), "context"),
    (OllamaGenerateRequest(prompt="a", raw=True, system="s"), "system"), (OllamaGenerateRequest(width=64), "width"),
    (OllamaChatRequest(think="high"), "think"), (OllamaChatRequest(top_logprobs=2), "top_logprobs"),
])
def test_fields_fleet_does_not_implement_are_refused_by_name(body, named):
    with pytest.raises(InvalidRequest) as caught:
        body.refuse_unsupported()
    assert caught.value.param == named
    OllamaChatRequest(think=False, keep_alive="10m").refuse_unsupported()  # accepted


def test_model_names_and_formats():
    check_model_name("smol", "smol")
    check_model_name("smol:latest", "smol")
    with pytest.raises(ModelNotFound):
        check_model_name("smol:7b", "smol")
    with pytest.raises(InvalidRequest):
        check_model_name("", "smol")
    assert format_constraint(None) is None and format_constraint("") is None
    assert json.loads(format_constraint("json").text) == {"type": "object"}
    assert json.loads(format_constraint({"type": "integer"}).text) == {"type": "integer"}
    with pytest.raises(InvalidRequest):
        format_constraint("xml")


def test_results_answer_the_calls_they_name():
    body = OllamaChatRequest(messages=[
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                             {"function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "now"},
        {"role": "tool", "content": "sunny"}])
    user, assistant, clock, weather = chat_messages(body.messages)
    first, second = assistant["tool_calls"]
    assert json.loads(first.arguments) == {"city": "Paris"} and first.id != second.id
    assert (clock["tool_call_id"], clock["name"]) == (second.id, "now")
    assert (weather["tool_call_id"], weather["name"]) == (first.id, "get_weather")
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(OllamaChatRequest(messages=[user, {"role": "assistant", "thinking": "hm"}]).messages)
    assert caught.value.param == "messages[1].thinking"


def test_calls_are_spelled_as_ollama_does():
    """Whole: content and ``tool_calls`` with the arguments as an object; streamed: each call once it is
    complete, the content before it as it comes."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    whole = ChatSpelling(ToolAnswer(DEFAULT, parse_tools([WEATHER]), AUTO, None)).whole(text)
    assert whole == {"message": {"role": "assistant", "content": "Sure.\n", "tool_calls": [call]}}
    streamed = ChatSpelling(ToolAnswer(DEFAULT, parse_tools([WEATHER]), AUTO, None))
    pieces = [streamed.piece(text[i:i + 4], i + 4 >= len(text)) for i in range(0, len(text), 4)]
    messages = [p["message"] for p in pieces if p]
    assert "".join(m["content"] for m in messages) == "Sure.\n"
    assert [c for m in messages for c in m.get("tool_calls", ())] == [call]
    assert ChatSpelling(None).whole(text) == {"message": {"role": "assistant", "content": text}}


def test_the_ollama_paths_need_the_api_key_and_say_so_in_ollamas_shape():
    keys = ApiKeys(None, ["secret"])
    assert all(keys.guarded(p) for p in ("/api/chat", "/api/tags", "/api/version", "/api"))
    refused = keys.refusal(None)
    assert refused.status == 401 and ollama_error(refused) == {"error": refused.message}
    assert keys.refusal("Bearer secret") is None
    named = ollama_error(InvalidRequest("must be positive", param="options.num_ctx"))
    assert named == {"error": "options.num_ctx: must be positive"}
