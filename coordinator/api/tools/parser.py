"""The tool calls in a model's answer, parsed as the text streams (``ToolCallParser``) or as a whole
(``parse_tool_calls``), in the syntax of a ``ToolFormat``.

Fed the answer's text deltas, the parser gives back, per delta, the plain content that is certainly not
part of a call and the pieces of the calls (``CallDelta``: a call's index, its id and name once its name
is complete, then its arguments' JSON text as it comes), which is what OpenAI's streamed ``tool_calls``
deltas carry (openai-python joins the argument pieces of one index). Text that may still turn out to be a
call (a partial ``<tool_call>`` tag, the start of a JSON object) is held back until it is decided. A call
whose JSON does not have the shape ``{"name": ..., "arguments"/"parameters": ...}`` stays content. The
arguments are the text the model wrote, so that the pieces streamed add up to the whole answer's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .formats import ToolFormat
from .spec import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TOKEN = "[TOOL_CALLS]"
_WS = re.compile(r"\s*")
_HEADER_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class CallDelta:
    """A piece of the call at ``index`` (0, 1, ... in the answer): its first piece has ``id`` and ``name``
    (``arguments`` ""), later ones ``arguments`` text only (``id``/``name`` None)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        """The piece as an item of a streamed chunk's ``delta.tool_calls`` (OpenAI's shape)."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one fed delta decided: ``content`` (plain text) and ``calls`` (pieces, in order)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def header(text: str) -> tuple[str, int] | bool | None:
    """Whether ``text`` starts a call object ``{"name": "...", "arguments": `` (or ``"parameters"``):
    (the name, the index where the arguments' value starts) when it does, False when it cannot, None
    when it may (too short to tell)."""
    pos = 0

    def literal(lit: str) -> bool | None:
        nonlocal pos
        pos = _WS.match(text, pos).end()
        rest = text[pos:pos + len(lit)]
        if rest == lit:
            pos += len(lit)
            return True
        return None if lit.startswith(rest) else False

    for lit in ("{", '"name"', ":"):
        if (ok := literal(lit)) is not True:
            return ok
    pos = _WS.match(text, pos).end()
    if pos == len(text):
        return None
    if text[pos] != '"':
        return False
    try:
        name, end = json.decoder.scanstring(text, pos + 1)
    except ValueError:
        return None if "\n" not in text[pos:] else False  # an unterminated string, or a broken one
    pos = end
    if (ok := literal(",")) is not True:
        return ok
    pos = _WS.match(text, pos).end()
    outcomes = []
    for key in _HEADER_KEYS:
        saved = pos
        outcomes.append(literal(f'"{key}"'))
        if outcomes[-1] is True:
            break
        pos = saved
    if True not in outcomes:
        return None if None in outcomes else False
    if (ok := literal(":")) is not True:
        return ok
    pos = _WS.match(text, pos).end()
    return (name, pos) if pos < len(text) else None


class ValueEnd:
    """Finds where one JSON value ends, fed its text piece by piece (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.started, self.scalar = 0, False, False, False, False

    def feed(self, text: str) -> int | None:
        """How many characters of ``text`` belong to the value when it ends in ``text``, else None."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                self.scalar = ch not in '{["'
            if self.scalar:
                if ch in ",}]" or ch.isspace():
                    return i
                continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallParser:
    """Splits a streamed answer in ``fmt``'s syntax into content and tool calls (module docstring).

    ``names``: the tools offered (a call of another name stays content; None: any name); ``call_id``:
    makes each call's id. ``feed(text)`` per delta and ``finish()`` at the end return ``StreamDelta``s;
    ``calls`` holds the calls completed so far, ``content`` all the content given out."""

    def __init__(self, fmt: ToolFormat, names: Collection[str] | None = None,
                 call_id: Callable[[], str] | None = None) -> None:
        self.fmt, self.names = fmt, None if names is None else set(names)
        self._call_id = call_id or fmt.new_call_id
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buf = ""  # text received, not yet decided
        self._state = "text" if fmt.syntax == "hermes" else "start"
        self._call: dict | None = None  # the call being read: id, name, arguments so far, its ValueEnd
        self._between = False  # Hermes: right after a call's closing tag
        self._held = ""  # Llama 3/Mistral: the text skipped before the object being read (content if it is no call)
        self._out = StreamDelta()

    def feed(self, text: str) -> StreamDelta:
        """The content and call pieces ``text`` (the answer's next delta) decides."""
        self._buf += text
        while self._step():
            pass
        return self._flush()

    def finish(self) -> StreamDelta:
        """The rest at the end of the answer: held text as content, a call cut short (``max_tokens``)
        completed with the arguments it has."""
        if self._call is not None:
            self._complete()
            self._buf = ""
        elif self._state == "call":
            self._emit((OPEN if self.fmt.syntax == "hermes" else self._held) + self._buf)
        elif not (self._between and not self._buf.strip()):
            self._emit(self._buf)
        self._buf, self._state = "", "plain"
        return self._flush()

    def _flush(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _emit(self, text: str) -> None:
        if text:
            self._out.content += text
            self.content += text

    def _step(self) -> bool:
        """Decide what it can at the start of ``_buf``; True when it made progress."""
        if not self._buf:
            return False
        return {"text": self._in_text, "start": self._in_start, "call": self._in_call, "after": self._in_after,
                "plain": self._in_plain}[self._state]()

    def _in_plain(self) -> bool:
        self._emit(self._buf)
        self._buf = ""
        return False

    def _in_text(self) -> bool:
        """Hermes: content up to the next ``<tool_call>`` (whitespace between calls is no content)."""
        if self._between:
            if not self._buf.strip():
                return False
            self._buf, self._between = self._buf.lstrip(), False
        at = self._buf.find(OPEN)
        if at >= 0:
            self._emit(self._buf[:at])
            self._buf, self._state = self._buf[at + len(OPEN):], "call"
            return True
        keep = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                     if OPEN.startswith(self._buf[-k:])), 0)
        self._emit(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _in_start(self) -> bool:
        """Llama 3 and Mistral: calls only at the start of the answer (after ``[TOOL_CALLS]`` and ``[``)."""
        stripped = self._buf.lstrip()
        if self.fmt.syntax == "mistral":
            if MISTRAL_TOKEN.startswith(stripped):
                return False
            stripped = stripped.removeprefix(MISTRAL_TOKEN).lstrip()
            if not stripped:
                return False
            if stripped[0] != "[":
                self._state = "plain"
                return True
            stripped = stripped[1:].lstrip()
            if not stripped:
                return False
        if not stripped:
            return False
        if stripped[0] != "{":
            self._state = "plain"
            return True
        self._held, self._buf, self._state = self._buf[:len(self._buf) - len(stripped)], stripped, "call"
        return True

    def _in_call(self) -> bool:
        """Reading one call object: its header, then its arguments, then the rest of the object."""
        if self._call is None:
            found = header(self._buf)
            if found is None:
                return False
            if found is False or (self.names is not None and found[0] not in self.names):
                return self._not_a_call()
            name, at = found
            self._call = {"id": self._call_id(), "name": name, "arguments": "", "end": ValueEnd(), "done": False}
            self._out.calls.append(CallDelta(len(self.calls), self._call["id"], name, ""))
            self._buf = self._buf[at:]
        call = self._call
        if not call["done"]:
            end = call["end"].feed(self._buf)
            piece = self._buf if end is None else self._buf[:end]
            self._arguments(piece)
            self._buf = "" if end is None else self._buf[end:]
            if end is None:
                return False
            call["done"], call["end"] = True, ValueEnd()
            call["end"].feed("{")  # the rest of the call object, up to its closing brace
        end = call["end"].feed(self._buf)
        if end is None:
            self._buf = ""
            return False
        self._buf = self._buf[end:]
        self._complete()
        self._state = "after"
        return True

    def _arguments(self, piece: str) -> None:
        if not self._call["arguments"]:
            piece = piece.lstrip()
        if piece:
            self._call["arguments"] += piece
            self._out.calls.append(CallDelta(len(self.calls), arguments=piece))

    def _complete(self) -> None:
        call, self._call = self._call, None
        self.calls.append(ToolCall(call["id"], call["name"], call["arguments"].rstrip()))

    def _not_a_call(self) -> bool:
        """The object is no call: Hermes keeps its block as content; Llama 3 and Mistral answer in prose."""
        if self.fmt.syntax == "hermes":
            at = self._buf.find(CLOSE)
            if at < 0:
                return False
            self._emit(OPEN + self._buf[:at + len(CLOSE)])
            self._buf, self._state = self._buf[at + len(CLOSE):], "text"
            return True
        self._buf, self._state = self._held + self._buf, "plain"
        return True

    def _in_after(self) -> bool:
        """After a call: Hermes' closing tag; Llama 3's ``;`` and the next; Mistral's ``,`` or ``]``."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        syntax = self.fmt.syntax
        if syntax == "hermes":
            if len(stripped) < len(CLOSE) and CLOSE.startswith(stripped):
                return False
            self._buf, self._state = stripped.removeprefix(CLOSE), "text"
            self._between = True
            return True
        sep = {"llama3": ";", "mistral": ","}[syntax]
        if stripped[0] == sep or (syntax == "mistral" and stripped[0] == "]"):
            rest = stripped[1:].lstrip()
            if stripped[0] == "]":
                self._buf, self._state = rest, "plain"
                return True
            if not rest:
                return False
            if rest[0] == "{":
                self._held, self._buf, self._state = self._buf[:len(self._buf) - len(rest)], rest, "call"
                return True
        self._buf, self._state = stripped, "plain"
        return True


def parse_tool_calls(text: str, fmt: ToolFormat, names: Collection[str] | None = None,
                     call_id: Callable[[], str] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and tool calls (the same parse as a stream of it: ``ToolCallParser``)."""
    parser = ToolCallParser(fmt, names, call_id)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
