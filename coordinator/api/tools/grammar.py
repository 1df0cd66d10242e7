"""The grammar a forced tool call is decoded under (``tool_constraint``): ``tool_choice`` "required" or a
named function, in the family's syntax, with each call's arguments valid under its tool's schema.

It is a Lark grammar in llguidance's dialect (https://github.com/guidance-ai/llguidance, its Lark syntax guide):
string literals for the fixed text of a call, ``<[id]>`` for a special token (Mistral's ``[TOOL_CALLS]``)
and ``%json {schema}`` for the arguments. The JSON is written with ``", "`` and ``": "`` between items
and no other whitespace (how json.dumps, and so the chat templates' ``tojson``, write earlier calls), so
that a small model cannot spend its tokens on blank space. The text the grammar allows is exactly what
``ToolCallParser`` reads as calls."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...engine.constraint import Constraint
from .formats import ToolFormat
from .spec import Tool, ToolChoice

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes, which llguidance's Lark takes)."""
    return json.dumps(text)


def call_rules(tools: Sequence[Tool], fmt: ToolFormat) -> list[str]:
    """The Lark rules ``call`` (one call of any of ``tools``) and, per tool i, ``call_i`` and ``args_i``."""
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = f'{{"name": {json.dumps(tool.name)}, "{fmt.arguments_key}": '
        schema = {**tool.parameters, "x-guidance": JSON_STYLE}
        rules.append(f"call_{i}: {_literal(head)} args_{i} {_literal('}')}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return rules


# prose that holds no call: Hermes' has no <tool_call> tag; Llama 3's and Mistral's does not open with
# the object or the list a call starts with
PROSE = {"hermes": r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/", "llama3": r"/\s*|\s*[^\s{](.|\n)*/",
         "mistral": r"/\s*|\s*[^\s\[](.|\n)*/"}


def calls_rule(fmt: ToolFormat, many: bool) -> str:
    """The Lark rule ``calls``: one call (``many``: one or more) in ``fmt``'s syntax."""
    match fmt.syntax:
        case "hermes":
            block = f"{_literal('<tool_call>' + chr(10))} call {_literal(chr(10) + '</tool_call>')}"
            return f"calls: {block}" + (f" ({_literal(chr(10))} {block})*" if many else "")
        case "llama3":  # Llama 3.1's template takes one call per turn
            return "calls: call"
        case "mistral":
            opener = f"<[{fmt.call_token}]> " if fmt.call_token is not None else ""
            return f"calls: {opener}{_literal('[')} call" + (f" ({_literal(', ')} call)*" if many else "") \
                + f" {_literal(']')}"
    raise ValueError(f"no grammar for the tool-call syntax {fmt.syntax!r}")


def tool_grammar(tools: Sequence[Tool], fmt: ToolFormat, many: bool, prose: bool = False) -> str:
    """The Lark grammar of an answer that is one call (``many``: one or more) of ``tools`` in ``fmt``;
    ``prose``: or else text with no call (Hermes: text, then optionally the calls)."""
    rules = [calls_rule(fmt, many), *call_rules(tools, fmt)]
    if not prose:
        start = "start: calls"
    elif fmt.syntax == "hermes":  # text up to a <tool_call> tag (lazily: the tag ends it), then the calls
        start = f"start: PROSE | text calls\ntext[suffix={_literal('<tool_call>')}]: /(.|\\n)*/"
        rules[0] = rules[0].replace(f"calls: {_literal('<tool_call>' + chr(10))}", f"calls: {_literal(chr(10))}", 1)
    else:
        start = "start: PROSE | calls"
    return "\n".join([start, *rules, f"PROSE: {PROSE[fmt.syntax]}"]) + "\n"


def tool_constraint(tools: Sequence[Tool], choice: ToolChoice, parallel_tool_calls: bool | None,
                    fmt: ToolFormat, field_name: str = "tool_choice") -> Constraint | None:
    """What the answer must match under ``choice``: for "required", one call of any of ``tools`` (one or
    more only when ``parallel_tool_calls`` is True, asked for: a forced answer cannot end before its calls
    do, and a small model repeats its call until ``max_tokens``); for a named function, one call of it;
    for "auto" with a ``strict`` tool, prose or such calls (several unless ``parallel_tool_calls`` is
    False); otherwise (``auto``, ``none``) None: free text, parsed afterwards. Errors name ``field_name``
    (``Constraint.field``)."""
    if choice.mode == "none" or not tools or (choice.mode == "auto" and not any(t.strict for t in tools)):
        return None
    if choice.mode == "function":
        tools, many = [t for t in tools if t.name == choice.name], False
    elif choice.mode == "required":
        many = parallel_tool_calls is True
    else:
        many = parallel_tool_calls is not False
    return Constraint("lark", tool_grammar(tools, fmt, many, prose=choice.mode == "auto"), field_name)
