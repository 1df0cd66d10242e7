"""The Ollama API (``/api/*``) through the real ``ollama`` Python client against the session's fleet: chat and
generate, streamed (Ollama's default) and not, ``options`` mapped onto fleet's sampling, the model listed,
shown and running, the version, errors raised as ``ollama.ResponseError`` with their status and naming the
field, ``format`` as JSON mode and as a schema (constrained decoding), logprobs; and, read off the wire with
httpx, what Open WebUI's Ollama connection relies on (``/api/version``, ``/api/tags``' ``name`` and
``model``, ``/api/ps``' ``expires_at``, NDJSON streaming of ``/api/chat``)."""

from __future__ import annotations

import json
import os
from datetime import datetime

import jsonschema
import ollama
import pytest

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 6}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def client(base_url) -> ollama.Client:
    key = os.environ.get("FLEET_API_KEY")
    return ollama.Client(host=base_url, headers={"Authorization": f"Bearer {key}"} if key else None, timeout=120)


@pytest.fixture(scope="module")
def name(model) -> str:
    """The model as Ollama names it (``/api/tags``): the fleet's id with the default tag."""
    return f"{model}:latest"


def assert_final(last, max_tokens: int) -> None:
    """``last`` is a finished answer's last object: done, a reason, counts and durations (ns) that add up."""
    assert last.done is True and last.done_reason in ("stop", "length"), last
    assert 1 <= last.eval_count <= max_tokens and last.prompt_eval_count > 0
    assert all(isinstance(last[d], int) and last[d] >= 0 for d in DURATIONS), last
    assert last.total_duration >= last.prompt_eval_duration + last.eval_duration > 0


def test_chat_whole_and_streamed_give_the_same_greedy_answer(client, name):
    whole = client.chat(model=name, messages=ASK, stream=False, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content and whole.model == name
    assert_final(whole, GREEDY["num_predict"])
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    assert all(p.done is False for p in parts[:-1]) and len(parts) >= 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count
    assert_final(parts[-1], GREEDY["num_predict"])


def test_generate_templated_and_raw(client, model):
    """``generate`` puts the prompt in a user turn through the chat template (after ``system``); ``raw``
    sends it as it is. The bare model id is a name too."""
    whole = client.generate(model=model, prompt="The capital of France is", system="Be brief.", options=GREEDY)
    streamed = list(client.generate(model=model, prompt="The capital of France is", system="Be brief.",
                                    options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == whole.response and whole.response
    assert_final(whole, GREEDY["num_predict"])
    assert_final(streamed[-1], GREEDY["num_predict"])
    raw = client.generate(model=model, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.response and raw.prompt_eval_count < whole.prompt_eval_count  # no template around it


def test_options_become_the_sampling_fields(client, name, http):
    """Each sampling option reaches the sampler (fleet's report of what it used), ``num_predict`` caps the
    answer (``done_reason`` length), ``seed`` makes a sampled answer reproducible and ``stop`` ends it."""
    options = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repeat_penalty": 1.1, "presence_penalty": 0.5,
               "frequency_penalty": 0.25, "seed": 7, "num_predict": 3, "num_ctx": 512, "num_thread": 2}
    body = {"model": name, "messages": ASK, "stream": False, "options": options, "keep_alive": "5m"}
    answer = http.post("/api/chat", json=body).json()
    assert answer["done_reason"] == "length" and answer["eval_count"] == 3
    used = answer["fleet"]["sampling"]
    assert {k: used[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "max_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "max_tokens": 3}
    again = http.post("/api/chat", json=body).json()
    assert again["fleet"]["completion_token_ids"] == answer["fleet"]["completion_token_ids"]
    free = client.chat(model=name, messages=ASK, stream=False, options=GREEDY).message.content
    stop = free.strip().split()[-1]  # a word the greedy answer reaches
    cut = client.chat(model=name, messages=ASK, stream=False, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.message.content
    assert free.startswith(cut.message.content)


def test_list_show_ps_and_version(client, name, model, http):
    (listed,) = client.list().models
    assert listed.model == name and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "openvino" and listed.details.family
    shown = client.show(name)
    assert shown.capabilities == ["completion", "tools"] and shown.details.family == listed.details.family
    assert any(k.endswith(".context_length") and v > 0 for k, v in shown.modelinfo.items()), shown.modelinfo
    assert client.show(model).modelinfo == shown.modelinfo
    (running,) = client.ps().models
    assert running.model == name and running.context_length > 0
    assert isinstance(http.get("/api/version").json()["version"], str)


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"model": "llama3.2", "messages": ASK}, 404, "llama3.2"),
    ({"messages": ASK, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ({"messages": ASK, "options": {"num_gpu_layers": 2}}, 400, "options.num_gpu_layers"),
    ({"messages": ASK, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"messages": ASK, "options": {"num_ctx": 10**6}}, 400, "options.num_ctx"),
    ({"messages": [{"role": "user", "content": "What is this?", "images": ["aGk="]}]}, 400, "messages[0].images"),
    ({"messages": ASK, "think": True}, 400, "think"),
    ({"messages": ASK, "format": "yaml"}, 400, "format"),
    ({"messages": ASK, "format": {"$ref": "#/nowhere"}}, 400, "format"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role"),
])
def test_errors_come_in_ollamas_shape_naming_the_field(http, name, body, status, named):
    response = http.post("/api/chat", json={"model": name, "stream": False, **body})
    assert response.status_code == status and set(response.json()) == {"error"}, response.text
    assert named in response.json()["error"]


def test_the_client_raises_response_errors_with_the_status(client, name):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nope:7b", messages=ASK)
    assert missing.value.status_code == 404 and "nope:7b" in missing.value.error
    with pytest.raises(ollama.ResponseError) as refused:  # streamed: raised when the stream is read
        list(client.generate(model=name, prompt="Hi", suffix="return x", stream=True))
    assert refused.value.status_code == 400 and "suffix" in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.embed(model=name, input="Hi")
    assert unknown.value.status_code == 404 and "/api/embed" in unknown.value.error


def test_format_json_and_a_schema(client, name):
    """``format`` "json" (any object) and a JSON schema are decoded under their grammar: the answer parses,
    and validates under the schema."""
    person = client.chat(model=name, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                         format=PERSON, options={"temperature": 0, "num_predict": 40}, stream=False)
    assert person.done_reason == "stop", person  # the grammar ends the answer when the object is complete
    jsonschema.validate(json.loads(person.message.content), PERSON)
    parts = list(client.generate(model=name, prompt="Give me a JSON object with a greeting.", format="json",
                                 options={"temperature": 0, "num_predict": 24}, stream=True))
    text = "".join(p.response for p in parts)
    if parts[-1].done_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by num_predict: still the start of one object
        assert text.startswith("{")


def test_logprobs(client, name):
    answer = client.chat(model=name, messages=ASK, options=GREEDY, logprobs=True, top_logprobs=2, stream=False)
    assert len(answer.logprobs) == answer.eval_count
    assert "".join(lp.token for lp in answer.logprobs) == answer.message.content
    for lp in answer.logprobs:  # greedy: each token is its position's best candidate
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token and lp.logprob <= 0


def test_tools_and_results_are_rendered(client, name):
    """A conversation with tools, an earlier call and its result (matched by ``tool_name``) gets an answer."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": {"type": "object", "required": ["city"], "properties": {
                                                    "city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}]
    one = {"temperature": 0, "num_predict": 1}  # the prompt is what this checks (its prefill is most of the time)
    answer = client.chat(model=name, messages=messages, tools=[weather], options=one, stream=False)
    assert_final(answer, 1)
    plain = client.chat(model=name, messages=messages[:1], options=one, stream=False)
    assert answer.prompt_eval_count > plain.prompt_eval_count + 20  # the tools, the call and its result


def test_open_webui_connection(http, name):
    """What Open WebUI's Ollama connection reads: ``/api/version``, ``/api/tags`` (``model`` and ``name``),
    ``/api/ps``' ``expires_at`` (``datetime.fromisoformat``) and ``/api/chat`` streamed as NDJSON."""
    assert http.get("/api/version").status_code == 200
    (listed,) = http.get("/api/tags").json()["models"]
    assert listed["model"] == listed["name"] == name
    (running,) = http.get("/api/ps").json()["models"]
    assert running["name"] == name and datetime.fromisoformat(running["expires_at"]).year > 2100
    body = {"model": name, "messages": ASK, "stream": True, "options": GREEDY}
    with http.stream("POST", "/api/chat", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert all(line["model"] == name and line["message"]["role"] == "assistant" for line in lines)
    assert lines[-1]["eval_count"] == GREEDY["num_predict"] or lines[-1]["done_reason"] == "stop"
