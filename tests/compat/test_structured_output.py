"""Structured outputs as openai-python asks for them (``response_format`` json_schema / json_object, and its
``chat.completions.parse`` with a pydantic model): the twenty schemas of schemas.py streamed through the real
client, each answer joined from its deltas and validated with ``jsonschema``. (Not streamed, with and
without drafts, through a fleet of three coordinators: tests/integration/test_structured.py.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .schemas import SCHEMAS, chat_body


def test_twenty_schemas_streamed_through_openai_python_all_validate(client, model):
    def one(case: tuple[str, str, dict]) -> tuple[str, str | None]:
        stream = client.chat.completions.create(model=model, stream=True, **chat_body(*case))
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, SCHEMAS))
    for (name, _, schema), (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


class Pet(BaseModel):
    species: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


def test_openai_python_parse_gets_its_pydantic_model(client, model):
    """``client.chat.completions.parse(response_format=Pet)`` sends Pet's strict schema and parses the answer."""
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a pet."}], temperature=0, max_tokens=64,
        response_format=Pet)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and completion.choices[0].finish_reason == "stop"


def test_json_object_mode_answers_one_object(client, model):
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a JSON object with a greeting."}], temperature=0,
        max_tokens=48, response_format={"type": "json_object"})
    choice = answer.choices[0]
    if choice.finish_reason == "stop":  # an object the model closed within the budget parses
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still the start of one object
        assert choice.message.content.startswith("{")


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    assert caught.value.param == "response_format"


def test_vllm_and_llama_cpp_constrained_fields_are_honoured(http, model):
    """Clients written for vLLM (guided_choice, guided_json) or llama.cpp's server (json_schema) get what they
    ask for; a sampler fleet lacks (min_p) is a 400 naming it, never ignored."""
    base = {"model": model, "messages": [{"role": "user", "content": "Is water wet?"}], "temperature": 0,
            "max_tokens": 16}
    r = http.post("/v1/chat/completions", json={**base, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"wet": {"type": "boolean"}}, "required": ["wet"],
              "additionalProperties": False}
    r = http.post("/v1/chat/completions", json={**base, "json_schema": schema})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    r = http.post("/v1/chat/completions", json={**base, "min_p": 0.1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
