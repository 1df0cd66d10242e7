"""How a model family writes tool calls (``ToolFormat``), found in its chat template (``detect_format``),
and a conversation with tools rendered for that template (``render_messages``).

The formats (each family's model card and chat template; vLLM's and llama.cpp's parsers follow the same):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
  (Qwen2.5, Qwen3, Qwen3-MoE, Hermes, SmolLM3: templates that mention ``<tool_call>``);
- ``llama3``: the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3:
  templates with ``<|python_tag|>`` or the ``ipython`` role; ``<|python_tag|>`` itself is a special token,
  left out of the text);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (templates with ``[TOOL_CALLS]``;
  the token is special, so the text holds the JSON list); call ids are 9 letters and digits, as
  Mistral's templates require.

A template that knows none of them (SmolLM2, Gemma 3, Phi-3, Llama 2, Mistral v0.1) gets the default,
as llama.cpp's server does for generic templates (its minja polyfills): the tool definitions go into the
system prompt with an example call, assistant calls into the assistant's text, tool results into user
turns (``<tool_response>`` blocks, consecutive results in one turn so that templates requiring
alternating roles take them), and the model answers in the ``hermes`` syntax.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .spec import Tool, ToolCall, new_call_id

SYNTAXES = ("hermes", "llama3", "mistral")


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format: ``syntax`` (one of ``SYNTAXES``), whether its chat template renders
    tools, calls and results itself (``native``: it gets ``tools=`` and the messages as they are), and
    the id of the special token that opens the calls (Mistral's ``[TOOL_CALLS]``), if any."""

    syntax: str = "hermes"
    native: bool = False
    call_token: int | None = None

    def __post_init__(self) -> None:
        if self.syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {self.syntax!r} (one of {', '.join(SYNTAXES)})")

    @property
    def arguments_key(self) -> str:
        """The key of a call's arguments: "parameters" in Llama 3's JSON, "arguments" elsewhere."""
        return "parameters" if self.syntax == "llama3" else "arguments"

    def call_object(self, name: str, arguments: str) -> str:
        """One call as the JSON object the model writes: ``arguments`` is its JSON text."""
        return f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'

    def calls_text(self, calls: Sequence[ToolCall]) -> str:
        """``calls`` as the model writes them (the default rendering of an assistant's earlier calls)."""
        objects = [self.call_object(c.name, _json_text(c.arguments)) for c in calls]
        if self.syntax == "mistral":
            return "[TOOL_CALLS][" + ", ".join(objects) + "]"
        if self.syntax == "llama3":
            return "; ".join(objects)
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)

    def new_call_id(self) -> str:
        """A fresh call id in the form the family's template takes (Mistral: 9 letters and digits)."""
        if self.syntax == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return new_call_id()


DEFAULT = ToolFormat("hermes", native=False)


def detect_format(chat_template: str | None, architecture: str | None = None,
                  vocab: Mapping[str, int] | None = None) -> ToolFormat:
    """The tool-call format of a model whose chat template is ``chat_template`` (None: no template).

    The template decides (a family's fine-tunes share its architecture but not always its template:
    SmolLM2 is a ``llama``); ``architecture`` (the manifest's, e.g. "qwen3") only breaks a tie, a template
    that shows both Hermes tags and ``[TOOL_CALLS]``. ``vocab`` (token -> id) gives the id of Mistral's
    ``[TOOL_CALLS]`` for grammars; without it a constrained Mistral call is the JSON list alone."""
    text = chat_template or ""
    knows_tools = "tools" in text or "tool_calls" in text
    hermes, mistral = "<tool_call>" in text, "[TOOL_CALLS]" in text
    if mistral and (not hermes or (architecture or "").startswith("mistral")) and knows_tools:
        return ToolFormat("mistral", native=True, call_token=(vocab or {}).get("[TOOL_CALLS]"))
    if hermes and knows_tools:
        return ToolFormat("hermes", native=True)
    if ("<|python_tag|>" in text or "ipython" in text) and knows_tools:
        return ToolFormat("llama3", native=True)
    return DEFAULT


def _json_text(arguments: str) -> str:
    """``arguments`` as JSON text: itself when it parses, else as a JSON string."""
    try:
        json.loads(arguments)
    except ValueError:
        return json.dumps(arguments)
    return arguments


def tools_prompt(tools: Sequence[Tool], fmt: ToolFormat = DEFAULT) -> str:
    """The system prompt text that offers ``tools`` to a model whose template does not (llama.cpp's
    polyfill: the definitions as JSON, then an example of the call syntax)."""
    example = fmt.calls_text([ToolCall("", "tool_name", '{"arg1": "some_value"}')])
    return ("You can call any of the following tools to satisfy the user's requests: "
            + json.dumps([t.openai() for t in tools], indent=2, ensure_ascii=False)
            + "\n\nTo call tools, answer with the calls alone, in this syntax:\n\n" + example
            + "\n\nEach result comes back in a <tool_response></tool_response> block; then answer the user.")


def call_names(messages: Sequence[dict]) -> dict[str, str]:
    """Tool call id -> the tool's name, over the assistant messages' ``tool_calls`` (``ToolCall``s)."""
    return {c.id: c.name for m in messages for c in m.get("tool_calls") or ()}


def render_messages(messages: Sequence[dict], tools: Sequence[Tool], fmt: ToolFormat,
                    offer: bool = True) -> tuple[list[dict], dict]:
    """The messages and the extra variables to render a conversation with tools by the model's template.

    ``messages``: dicts with ``role`` ("system", "user", "assistant", "tool"), ``content`` (a string), and
    optionally ``tool_calls`` (``ToolCall``s of an assistant message), ``tool_call_id`` and ``name`` (of a
    tool message: the call it answers and the tool; the name is looked up by the id when absent).
    ``offer``: whether the tools are offered (False for ``tool_choice: none``: earlier calls and results
    are still rendered). A ``native`` format passes calls (arguments decoded to objects, as transformers
    gives them) and tool messages to the template, and ``tools=`` when offered; the default puts them in
    plain turns (module docstring). Returns (messages, variables for ``ChatTokenizer.render_chat``)."""
    names = call_names(messages)
    if fmt.native:
        out = [_native(m, names) for m in messages]
        return out, ({"tools": [t.openai() for t in tools]} if offer and tools else {})
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif role == "assistant" and m.get("tool_calls"):
            calls = fmt.calls_text(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": role, "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if offer and tools:
        prompt = tools_prompt(tools, fmt)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _native(message: dict, names: dict[str, str]) -> dict:
    """One message as templates that know tools take it (transformers' conventions)."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_value()}}
                             for c in message["tool_calls"]]
    if message["role"] == "tool":
        call_id = message.get("tool_call_id") or ""
        out["tool_call_id"] = call_id
        out["name"] = message.get("name") or names.get(call_id, "")
    return out


def extra_bytes(messages: Sequence[dict], tools: Sequence[Tool]) -> int:
    """UTF-8 bytes the tools and the calls add to a prompt beyond the messages' contents (size checks)."""
    calls = sum(len(c.name) + len(c.arguments.encode("utf-8")) + 32 for m in messages for c in m.get("tool_calls") or ())
    return calls + len(json.dumps([t.openai() for t in tools]).encode("utf-8")) + (512 if tools else 0)
