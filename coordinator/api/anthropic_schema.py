"""The Anthropic Messages API requests fleet takes (``POST /v1/messages`` and ``/v1/messages/count_tokens``,
https://docs.anthropic.com/en/api/messages), what each field becomes, and a 400 naming every field fleet
does not implement.

Taken: ``model``, ``messages`` (roles user, assistant and system; content a string or blocks of type
``text``, ``tool_use`` and ``tool_result``), ``system`` (a string or text blocks), ``max_tokens`` (required,
as Anthropic requires it), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``, ``tools``
(client tools: name, description, input_schema), ``tool_choice`` (auto, any, tool, none;
``disable_parallel_tool_use``) and ``output_config.format`` (a JSON schema, by constrained decoding).

Accepted, harmless no-ops: ``metadata`` (``user_id``), ``cache_control`` (fleet keeps every prompt's KV for
reuse by itself), an earlier text block's ``citations``, ``service_tier``, ``inference_geo``, ``speed``
"standard" and ``thinking`` of type "disabled". Refused by name: image, document and search-result blocks
(fleet's models read text), thinking blocks and ``thinking`` enabled, server tools and their blocks,
``container``, ``mcp_servers``, ``context_management``, ``diagnostics``, ``output_config.effort``, ``speed``
"fast", a last message of the assistant (a prefill), ``max_tokens`` 0, and any field Anthropic does not
define ("Extra inputs are not permitted", as Anthropic answers).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.constraint import Constraint
from ..errors import InvalidRequest
from .limits import count_messages
from .openai_schema import SamplingRequest
from .tools import AUTO, NONE, Tool, ToolCall, ToolChoice, check_choice, check_tools_size, check_unique, make_tool

MAX_STOP_SEQUENCES = 64  # fleet's bound (each is searched for after every token); Anthropic states none

TEXT_ONLY = "fleet's models read text only; send the text"
NO_THINKING = "fleet does not implement extended thinking"
NO_SERVER_TOOLS = "fleet runs no server tools; give client tools (name, description, input_schema) instead"
REFUSED_BLOCKS = {"image": TEXT_ONLY, "document": TEXT_ONLY, "search_result": TEXT_ONLY,
                  "container_upload": NO_SERVER_TOOLS, "thinking": NO_THINKING, "redacted_thinking": NO_THINKING}
MESSAGE_BLOCKS = ("text", "tool_use", "tool_result")


class Strict(BaseModel):
    """A part of an Anthropic request: fields Anthropic does not define are refused by name."""

    model_config = ConfigDict(extra="forbid")


def check_blocks(value: object, allowed: tuple[str, ...]) -> object:
    """Raise ``PydanticCustomError`` when the raw blocks ``value`` (a list of objects) hold one whose type is
    not in ``allowed``: one fleet does not implement, named with why (``REFUSED_BLOCKS``), or an unknown one."""
    if not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind in allowed:
            continue
        why = REFUSED_BLOCKS.get(kind) or (NO_SERVER_TOOLS if "tool" in kind else None)
        if why is None:
            raise PydanticCustomError("unknown_block", "block {i} has the unknown type {kind}",
                                      {"i": i, "kind": repr(kind)})
        raise PydanticCustomError("unsupported_block", "block {i}: {kind} blocks are not supported by fleet: {why}",
                                  {"i": i, "kind": kind, "why": why})
    return value


class TextBlock(Strict):
    """A text content block."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: fleet reuses every prompt's KV by itself
    citations: list[Any] | None = None  # accepted: an earlier answer's citations (templates show the text)


class ToolUseBlock(Strict):
    """An assistant's earlier tool call: ``id`` (``toolu_...``), the tool's ``name`` and its ``input`` object."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    """A user's result of the call ``tool_use_id``: text (a string or text blocks); ``is_error``: it failed."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        return check_blocks(value, ("text",))

    def text(self) -> str:
        """The result as one string (text blocks joined; an error's marked as one)."""
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(Strict):
    """One message: ``role`` and ``content`` (a string, or blocks: text, tool_use, tool_result)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: object) -> object:
        return check_blocks(value, MESSAGE_BLOCKS)

    @model_validator(mode="after")
    def _placed(self) -> InputMessage:
        """Tool calls are the assistant's, results the user's; text is valid Unicode (JSON may carry lone
        surrogates, which the tokenizer cannot take)."""
        blocks = [] if isinstance(self.content, str) else self.content
        if any(isinstance(b, ToolUseBlock) for b in blocks) and self.role != "assistant":
            raise ValueError("tool_use blocks are the assistant's")
        if any(isinstance(b, ToolResultBlock) for b in blocks) and self.role != "user":
            raise ValueError("tool_result blocks are the user's")
        text = self.text() + "".join(b.text() for b in blocks if isinstance(b, ToolResultBlock))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"content is not valid Unicode: a lone surrogate at character {exc.start}") from None
        return self

    def text(self) -> str:
        """The text blocks (or the string) as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


class ToolDefinition(Strict):
    """A client tool: ``name``, ``description`` and ``input_schema`` (the JSON schema of its input object)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # true: its calls follow input_schema under tool_choice auto too (by a grammar)


class ToolChoiceParam(Strict):
    """``tool_choice``: "auto" (the model decides), "any" (some tool), "tool" (the one ``name``d), "none"."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Strict):
    """``output_config.format``: the answer is JSON valid under ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """``output_config``: ``format`` is taken; ``effort`` is refused (no levels of effort here)."""

    format: OutputFormat | None = None
    effort: str | None = None


def _check_tools(value: object) -> object:
    """Server tools (a ``type`` other than "custom") are refused by name before their fields are checked."""
    if isinstance(value, list):
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise PydanticCustomError("server_tool", "tool {i} is the server tool {kind}: {why}",
                                          {"i": i, "kind": repr(kind), "why": NO_SERVER_TOOLS})
    return value


class MessagesPrompt(Strict):
    """What the prompt is made of (``/v1/messages/count_tokens`` takes this alone)."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: fleet reuses every prompt's KV by itself
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None
    container: Any = None
    _tool_request: tuple | None = PrivateAttr(None)

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """At most ``limits.MAX_MESSAGES`` messages and ``MAX_CONTENT_PARTS`` blocks, counted before any is
        validated."""
        try:
            count_messages(value)
        except ValueError as exc:
            raise PydanticCustomError("too_many", str(exc)) from None
        return value

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: object) -> object:
        return check_blocks(value, ("text",))

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, value: object) -> object:
        return _check_tools(value)

    def refuse_unsupported(self) -> None:
        """Raise ``InvalidRequest`` naming the first field set to something fleet does not implement."""
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            refuse("thinking", NO_THINKING + " (thinking must be disabled or left out)")
        for name in ("mcp_servers", "context_management", "container"):
            if getattr(self, name):
                refuse(name, "fleet does not implement it")
        if self.speed == "fast":
            refuse("speed", "fleet has one speed ('standard')")
        if self.output_config is not None and self.output_config.effort is not None:
            refuse("output_config", "fleet has no levels of effort (output_config.effort)")
        if self.messages[-1].role == "assistant":
            refuse("messages", "the last message is the assistant's: fleet does not continue a prefilled answer; "
                   "end with a user message", plain=True)
        tools, choice, _ = self.tool_request()
        if self.output_constraint() is not None and tools and choice.mode != "none":
            refuse("output_config", "a JSON output format with tools: the answer could be neither a call nor free "
                   "to call; send one of them (or tool_choice none)")

    def tool_request(self) -> tuple[tuple[Tool, ...], ToolChoice, bool | None]:
        """The tools offered, the ``tool_choice`` as ``tools.ToolChoice`` (any: "required", tool: "function")
        and whether several calls may come (False with ``disable_parallel_tool_use``; None: unsaid), parsed
        once (each tool's schema is compiled to be checked). Raises ``InvalidRequest`` naming ``tools`` or
        ``tool_choice``."""
        if self._tool_request is None:
            self._tool_request = self._parse_tools()
        return self._tool_request

    def _parse_tools(self) -> tuple[tuple[Tool, ...], ToolChoice, bool | None]:
        check_tools_size([t.input_schema for t in self.tools or ()])
        tools = check_unique([make_tool(t.name, t.description, t.input_schema, "tools", t.strict)
                              for t in self.tools or ()])
        tc = self.tool_choice
        if tc is None:
            return tools, (AUTO if tools else NONE), None
        if (tc.type == "tool") != (tc.name is not None):
            refuse("tool_choice", "a name goes with type 'tool' (and only with it)", plain=True)
        choice = {"auto": AUTO, "none": NONE, "any": ToolChoice("required")}.get(tc.type) \
            or ToolChoice("function", tc.name)
        parallel = None if tc.disable_parallel_tool_use is None else not tc.disable_parallel_tool_use
        return tools, check_choice(choice, tools, "tool_choice"), parallel

    def output_constraint(self) -> Constraint | None:
        """What ``output_config.format`` asks the answer to be: JSON valid under its schema; None without it."""
        fmt = self.output_config.format if self.output_config is not None else None
        return None if fmt is None else Constraint.json_schema(fmt.schema_, "output_config")

    def conversation(self) -> list[dict]:
        """The system prompt and the messages as ``tools.render_messages`` takes them: role, content (a
        string), an assistant's ``tool_calls`` (``ToolCall``s of its tool_use blocks) and one ``tool``
        message per tool_result (``tool_call_id``), before the user's text. Consecutive messages of one role
        are one turn (as Anthropic combines them)."""
        out: list[dict] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or ())
        if system:
            out.append({"role": "system", "content": system})
        for message in self.messages:
            blocks = [] if isinstance(message.content, str) else message.content
            for result in (b for b in blocks if isinstance(b, ToolResultBlock)):
                out.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": result.text()})
            calls = [ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                     for b in blocks if isinstance(b, ToolUseBlock)]
            text = message.text()
            if not text and not calls and blocks:
                continue  # tool results alone
            last = out[-1] if out else None
            if last is not None and last["role"] == message.role and not last.get("tool_calls"):
                last["content"] = "\n\n".join(t for t in (last["content"], text) if t)
                if calls:
                    last["tool_calls"] = calls
                continue
            out.append({"role": message.role, "content": text, **({"tool_calls": calls} if calls else {})})
        return out


class MessagesRequest(MessagesPrompt):
    """Anthropic's ``POST /v1/messages`` body, as fleet honours it (see the module docstring)."""

    max_tokens: int = Field(ge=1, description="required, as Anthropic requires it (0, a cache warm-up, is refused)")
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, unused (user_id)
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: fleet has one tier
    inference_geo: str | None = None  # accepted: fleet runs where it runs
    diagnostics: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Also ``diagnostics`` and bad ``stop_sequences`` (empty ones, or more than ``MAX_STOP_SEQUENCES``)."""
        super().refuse_unsupported()
        if self.diagnostics:
            refuse("diagnostics", "fleet does not report prompt-cache diagnostics")
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            refuse("stop_sequences", f"stop_sequences takes up to {MAX_STOP_SEQUENCES} non-empty strings", plain=True)

    def sampling_request(self) -> SamplingRequest:
        """The sampling fields as the OpenAI request's (``openai_schema.resolve_sampling`` takes them); the
        stop sequences are not among them (``stop_sequences`` has no OpenAI bound of 4): they are set after."""
        return SamplingRequest(model=self.model, max_tokens=self.max_tokens, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, stream=self.stream)


def refuse(field: str, why: str, plain: bool = False) -> None:
    """Raise ``InvalidRequest`` naming ``field``: "FIELD is not supported by fleet: WHY" (``plain``: WHY alone)."""
    raise InvalidRequest(why if plain else f"{field} is not supported by fleet: {why}", param=field)
