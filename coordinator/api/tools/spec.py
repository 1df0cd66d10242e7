"""What a request says about tools: the tools it offers (``Tool``), how the model may use them
(``ToolChoice``) and the calls an answer makes (``ToolCall``), parsed from OpenAI's shapes
(https://platform.openai.com/docs/api-reference/chat/create: ``tools``, ``tool_choice``) with a 400 naming
the field on bad input. The Anthropic and Ollama APIs build the same objects with ``make_tool`` and
``ToolChoice``."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...engine.constraint import MAX_SCHEMA_PROPERTIES, Constraint, check_schema_size
from ...errors import InvalidRequest

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A function name as OpenAI allows it: letters, digits, underscores and dashes, at most 64."""

MAX_TOOLS = 128  # OpenAI's limit of tools per request


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``name`` (``NAME_PATTERN``), ``description`` ("" if none),
    ``parameters``, the JSON schema its arguments (a JSON object) must match, and ``strict`` (OpenAI's
    ``function.strict``: the arguments must follow the schema even when the model may answer in prose,
    so ``tool_choice: auto`` is decoded under a grammar too)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}}, hash=False)
    strict: bool = False

    def openai(self) -> dict:
        """The tool in OpenAI's shape, as chat templates take it (transformers' ``tools=``)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call an answer makes: ``id`` (``call_...``, unique in the answer), the tool's ``name`` and its
    ``arguments`` as a JSON string (what the model wrote; valid under the tool's schema when the call was
    constrained, possibly not otherwise, as OpenAI warns)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """The call in OpenAI's shape (a message's ``tool_calls`` item)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def arguments_value(self) -> Any:
        """The arguments decoded from JSON (the Anthropic and Ollama APIs send them as an object); the
        string itself when it is not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


def new_call_id() -> str:
    """A fresh tool call id, ``call_`` and 24 hex digits (OpenAI's prefix)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolChoice:
    """How the model may use the tools: ``mode`` "auto" (it decides), "none" (no call), "required" (at
    least one call), or "function" (a call of the tool ``name``)."""

    mode: str = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "none", "required", "function"):
            raise ValueError(f"unknown tool choice mode {self.mode!r}")
        if (self.mode == "function") != (self.name is not None):
            raise ValueError("a tool choice names a function exactly when its mode is 'function'")

    @property
    def forced(self) -> bool:
        """Whether the answer must be tool calls (``required`` or a named function): then it is constrained."""
        return self.mode in ("required", "function")


AUTO = ToolChoice("auto")
NONE = ToolChoice("none")


def make_tool(name: Any, description: Any, parameters: Any, field_name: str = "tools", strict: Any = None) -> Tool:
    """A ``Tool`` from its parts, checked: ``name`` a string matching ``NAME_PATTERN``, ``description``
    a string or None, ``parameters`` None (no arguments) or a JSON schema object whose ``type``, if given,
    is "object" (arguments are a JSON object), ``strict`` a boolean or None. Raises ``InvalidRequest``
    naming ``field_name``."""
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{field_name}: strict must be true or false, not {strict!r}", param=field_name)
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequest(f"{field_name}: a function name must be 1 to 64 letters, digits, underscores or "
                             f"dashes, not {name!r}", param=field_name)
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{field_name}: the description of {name!r} must be a string", param=field_name)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{field_name}: the parameters of {name!r} must be a JSON schema (an object), not "
                             f"{type(parameters).__name__}", param=field_name)
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise InvalidRequest(f"{field_name}: the parameters of {name!r} must be a JSON schema of type 'object' "
                             f"(arguments are a JSON object), not {kind!r}", param=field_name)
    check_schema_size(parameters, field_name, f"{field_name}: the parameters of {name!r}")
    return Tool(name, description or "", parameters, bool(strict))


def tool_schemas(tools: Sequence[Tool], field_name: str = "tools") -> list[Constraint]:
    """The parameters of ``tools`` as constraints naming ``field_name``, for ``GrammarChecker.check``: a
    tool's schema must compile (an unknown type, a bad ``$ref``, a malformed keyword: a 400) although an
    answer free to call is not decoded under it. Checked there, in a process of its own: compiling a
    schema can take exponential time and memory (coordinator/engine/grammar_check.py)."""
    return [Constraint.json_schema(t.parameters, field_name, f"the parameters schema of {t.name!r}") for t in tools]


def check_tools_size(schemas: Sequence[Any], field_name: str = "tools") -> None:
    """Raise ``InvalidRequest`` naming ``field_name`` when the parameters of a request's tools, taken
    together, are more than one schema may be (``constraint.check_schema_size``: properties in all). Run
    before each tool's schema is measured (``make_tool``): 80 tools of 1,000 properties each (a 2 MB body)
    compiled one by one on the event loop froze it for 18 s."""
    if len(schemas) > MAX_TOOLS:
        raise InvalidRequest(f"{field_name}: {len(schemas)} tools, more than {MAX_TOOLS}", param=field_name)
    budget = MAX_SCHEMA_PROPERTIES
    for schema in schemas:
        if isinstance(schema, dict):
            budget -= check_schema_size(schema, field_name, f"{field_name}: the tools' parameters", budget)


def check_unique(tools: Sequence[Tool], field_name: str = "tools") -> tuple[Tool, ...]:
    """``tools`` as a tuple; raises ``InvalidRequest`` naming ``field_name`` for two tools of one name or
    more than ``MAX_TOOLS``."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{field_name}: {len(tools)} tools, more than {MAX_TOOLS}", param=field_name)
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise InvalidRequest(f"{field_name}: two tools are named {tool.name!r}; names must be unique",
                                 param=field_name)
        seen.add(tool.name)
    return tuple(tools)


def parse_tools(value: Any, field_name: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's ``tools`` (``[{"type": "function", "function": {name, description, parameters, strict}}]``;
    None or [] for none) as ``Tool``s. Raises ``InvalidRequest`` naming ``field_name`` for a type other
    than "function" (``custom`` tools are not implemented), a bad name or schema, or duplicate names."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(f"{field_name} must be a list of tools", param=field_name)
    check_tools_size([item.get("function", {}).get("parameters") if isinstance(item, dict)
                      and isinstance(item.get("function"), dict) else None for item in value], field_name)
    tools = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"{field_name}[{i}] must be an object", param=field_name)
        if item.get("type") != "function":
            raise InvalidRequest(f"{field_name}[{i}]: tool type {item.get('type')!r} is not supported by fleet: "
                                 f"only 'function' tools", param=field_name)
        function = item.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{field_name}[{i}].function must be an object with a name", param=field_name)
        tools.append(make_tool(function.get("name"), function.get("description"), function.get("parameters"),
                               field_name, function.get("strict")))
    return check_unique(tools, field_name)


def parse_tool_choice(value: Any, tools: Sequence[Tool], field_name: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice`` ("none", "auto", "required", ``{"type": "function", "function": {"name"}}``;
    None: "auto" with tools, "none" without) as a ``ToolChoice``. Raises ``InvalidRequest`` naming
    ``field_name`` for another value, "required" or a function without ``tools``, or a function not in them."""
    if value is None:
        return AUTO if tools else NONE
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidRequest(f"{field_name} must be 'none', 'auto', 'required' or a function, not {value!r}",
                                 param=field_name)
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(f"{field_name}: a function choice is {{'type': 'function', 'function': "
                                 f"{{'name': ...}}}}", param=field_name)
        choice = ToolChoice("function", name)
    else:
        kind = value.get("type") if isinstance(value, dict) else type(value).__name__
        raise InvalidRequest(f"{field_name} of type {kind!r} is not supported by fleet: give 'none', 'auto', "
                             f"'required' or {{'type': 'function', ...}}", param=field_name)
    return check_choice(choice, tools, field_name)


def check_choice(choice: ToolChoice, tools: Sequence[Tool], field_name: str = "tool_choice") -> ToolChoice:
    """``choice``, when ``tools`` allow it; raises ``InvalidRequest`` naming ``field_name`` when it asks
    for a call (``forced``) without tools, or names a function not among them."""
    if choice.forced and not tools:
        raise InvalidRequest(f"{field_name} asks for a tool call, but the request has no tools", param=field_name)
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        names = ", ".join(repr(t.name) for t in tools)
        raise InvalidRequest(f"{field_name} names the function {choice.name!r}, which is not among the tools "
                             f"({names})", param=field_name)
    return choice
