"""Chat completions with tools (OpenAI's function calling): the conversation rendered with its tools, calls
and results for the model's template, the forced call's grammar, and the answer spelled as OpenAI does:
``message.tool_calls`` and ``finish_reason: "tool_calls"``, or streamed ``delta.tool_calls`` pieces
(index, id, type, function name, then argument text) as openai-python joins them. The format is the
model family's (``coordinator.api.tools``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..engine.constraint import Constraint
from .tools import (
    CallDelta,
    StreamDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    detect_format,
    extra_bytes,
    render_messages,
    tool_constraint,
)

if TYPE_CHECKING:
    from ..engine.engine import Engine


@functools.lru_cache(maxsize=8)
def engine_tool_format(engine: Engine) -> ToolFormat:
    """The tool-call format of the model ``engine`` serves: from its chat template, its architecture and
    its vocabulary (the id of a special token that opens calls). Worked out once per engine: reading the
    vocabulary takes milliseconds (a 262,144-token one, ~0.1 s), on the event loop."""
    tokenizer = engine.tokenizer
    return detect_format(tokenizer.chat_template, engine.manifest.architecture.model_type,
                         tokenizer.tokenizer.get_vocab(with_added_tokens=True))


def uses_tools(messages: Sequence[dict], tools: Sequence[Tool]) -> bool:
    """Whether a chat needs the tool-aware path: tools offered, or earlier calls or results in ``messages``."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


class ToolAnswer:
    """One chat request's tools: its prompt messages, its constraint, and its answer's choice fields.

    ``fmt``: the model's format; ``tools`` and ``choice``: the request's (``tool_choice: none`` offers no
    tool and parses no call); ``parallel``: ``parallel_tool_calls``. A forced answer (``required``, a named
    function) is calls alone by its grammar: text left over is the start of a call cut off by
    ``max_tokens``, which is no content."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool], choice: ToolChoice, parallel: bool | None) -> None:
        self.fmt, self.tools, self.choice = fmt, tuple(tools), choice
        offered = bool(self.tools) and choice.mode != "none"
        self.parser = ToolCallParser(fmt, {t.name for t in self.tools}) if offered else None
        self.constraint: Constraint | None = tool_constraint(self.tools, choice, parallel, fmt) if offered else None

    def prompt(self, messages: Sequence[dict]) -> tuple[list[dict], dict, int]:
        """``messages`` (``tools.render_messages``' form) for the template: (messages, template variables,
        the bytes the tools and calls add beyond the contents, for the size checks)."""
        rendered, variables = render_messages(messages, self.tools, self.fmt, offer=self.parser is not None)
        return rendered, variables, extra_bytes(messages, self.tools if self.parser is not None else ())

    def whole(self, text: str) -> dict:
        """The choice's ``message`` for the whole answer ``text``: content (null when the answer is calls
        alone) and ``tool_calls``."""
        if self.parser is None:
            return {"message": {"role": "assistant", "content": text}}
        self.parser.feed(text)
        self.parser.finish()
        calls, content = self.parser.calls, "" if self.choice.forced else self.parser.content
        message = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return {"message": message}

    def piece(self, text: str, last: bool) -> dict | None:
        """The streamed choice's ``delta`` for the answer's next ``text`` (``last``: the answer ends with
        it); None when it decides nothing yet (a call's start held back)."""
        if self.parser is None:
            return {"delta": {"content": text}} if text else None
        decided = self.parser.feed(text)
        if last:
            rest = self.parser.finish()
            decided = StreamDelta(decided.content + rest.content, decided.calls + rest.calls)
        delta: dict = {}
        if decided.content and not self.choice.forced:
            delta["content"] = decided.content
        if decided.calls:
            delta["tool_calls"] = [c.openai() for c in merged(decided.calls)]
        return {"delta": delta} if delta else None

    def finish_reason(self, reason: str) -> str:
        """OpenAI's ``finish_reason``: "tool_calls" when the answer stopped after making calls, else ``reason``."""
        return "tool_calls" if reason == "stop" and self.parser is not None and self.parser.calls else reason


def merged(pieces: Sequence[CallDelta]) -> list[CallDelta]:
    """Consecutive pieces of one call joined (a call's start and its first arguments in one item)."""
    out: list[CallDelta] = []
    for piece in pieces:
        if out and out[-1].index == piece.index:
            last = out[-1]
            out[-1] = CallDelta(last.index, last.id, last.name, last.arguments + piece.arguments)
        else:
            out.append(piece)
    return out
