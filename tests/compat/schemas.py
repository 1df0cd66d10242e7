"""Twenty JSON schemas of the kinds apps send for structured output (nested objects, enums, arrays, numbers
with bounds, required fields, unions), each with a prompt asking for it. Every answer fleet gives under one
must validate with the ``jsonschema`` library (tests/compat/test_structured_output.py and
tests/integration/test_structured.py). Strings and arrays are bounded so that even the demo's 135M model,
which rambles, finishes its JSON within the tests' token budgets."""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 16}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema with no other properties; every property required unless ``required`` says."""
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a person.", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("city", "Name a city and its country.", obj({"city": NAME, "country": NAME})),
    ("colour", "Pick a colour.", obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("boolean", "Is the sky blue?", obj({"answer": {"type": "boolean"}})),
    ("score", "Rate this movie from 1 to 5.", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("price", "Give a price in dollars.", obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}})),
    ("tags", "Give up to three tags for a blog post about cats.",
     obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}})),
    ("point", "Give a point on a plane.", obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                               "y": {"type": "integer", "minimum": -9, "maximum": 9}})),
    ("nested", "Describe a book and its author.",
     obj({"title": NAME, "author": obj({"name": NAME, "born": {"type": "integer", "minimum": 1000, "maximum": 2025}})})),
    ("optional", "Describe a pet; the nickname is optional.",
     obj({"species": {"enum": ["cat", "dog", "fish"]}, "nickname": NAME}, required=["species"])),
    ("list_of_objects", "List two fruits with their colours.",
     obj({"fruits": {"type": "array", "minItems": 2, "maxItems": 2,
                     "items": obj({"fruit": NAME, "colour": {"enum": ["red", "yellow", "green"]}})}})),
    ("const", "Say hello as JSON.", obj({"greeting": {"const": "hello"}, "to": NAME})),
    ("union", "Give an id, as a number or a short string.",
     obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, NAME]}})),
    ("nullable", "Give a middle name, or null if none.", obj({"middle_name": {"type": ["string", "null"], "maxLength": 12}})),
    ("enum_array", "Which days are weekend days?",
     obj({"days": {"type": "array", "items": {"enum": ["sat", "sun", "mon"]}, "minItems": 1, "maxItems": 3}})),
    ("pattern", "Give a date.", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("integer_array", "Give three small numbers.",
     obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "minItems": 3, "maxItems": 3}})),
    ("deep", "Describe a company's address.",
     obj({"company": obj({"name": NAME, "address": obj({"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})})),
    ("mixed", "Describe a product.", obj({"name": NAME, "in_stock": {"type": "boolean"},
                                          "rating": {"type": "number", "minimum": 0, "maximum": 5},
                                          "category": {"enum": ["toys", "food", "tools"]}})),
    ("ref", "Give a line from one point to another.",
     {"type": "object", "$defs": {"p": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
      "properties": {"start": {"$ref": "#/$defs/p"}, "end": {"$ref": "#/$defs/p"}}, "required": ["start", "end"],
      "additionalProperties": False}),
]

MAX_TOKENS = 96  # every schema above fits well within it (its longest answers take ~50 tokens)


def chat_body(name: str, prompt: str, schema: dict) -> dict:
    """A greedy chat completion body asking for ``schema`` (OpenAI's ``response_format: json_schema``)."""
    return {"messages": [{"role": "user", "content": f"{prompt} Answer in JSON."}], "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}
