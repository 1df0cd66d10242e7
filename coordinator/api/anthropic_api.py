"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``;
https://docs.anthropic.com/en/api/messages and its streaming page), answered by the same generation path as
the OpenAI endpoints: ``openai_schema.resolve_sampling`` for the sampling fields, ``prompts.PromptPreparer``
for the prompt, ``completions.Generation`` for the deltas (prefill progress, a client gone), and
``coordinator.api.tools`` for tool calls in the model family's format.

The answer is a ``message``: ``content`` blocks (``text``, and ``tool_use`` with the call's ``input`` object
when tools are offered), ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with the matched
``stop_sequence``, ``tool_use``, ``model_context_window_exceeded`` when the context ran out first) and ``usage`` (``input_tokens`` not read from the prefix cache,
``cache_read_input_tokens`` read from it, ``output_tokens``), plus fleet's report (``fleet``, as the OpenAI
endpoints'). Streamed, it is Anthropic's SSE events: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta``; ``input_json_delta`` of a call's input) and ``content_block_stop``,
a ``ping``, then ``message_delta`` (stop reason, usage) and ``message_stop``; a failure mid-stream is an
``error`` event. Errors before that are in Anthropic's shape (``anthropic_errors``)."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from .access import request_scope
from .anthropic_errors import anthropic_error
from .anthropic_schema import MessagesPrompt, MessagesRequest
from .completions import Generation, check_model, fleet_stats
from ..errors import FleetError
from .openai_schema import resolve_sampling
from .prompts import PromptPreparer
from ..engine.request import FinishReason, Request
from .tool_chat import engine_tool_format
from .tools import (
    StreamDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    extra_bytes,
    render_messages,
    tool_constraint,
    tool_schemas,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..engine.engine import Engine

log = logging.getLogger(__name__)


def tool_use_id() -> str:
    """A fresh ``tool_use`` id in Anthropic's form: ``toolu_`` and 24 hex digits."""
    return "toolu_" + secrets.token_hex(12)


def sse(event: dict) -> str:
    """``event`` as one SSE event named by its ``type`` (Anthropic's clients skip events without a name)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ContentBlocks:
    """The answer's text turned into content blocks, as stream events (``feed``, ``close``), the same for a
    whole answer (``whole``).

    Without tools the answer is one text block, started at once (as Anthropic's streams do). With tools
    (``fmt``'s syntax, parsed by ``tools.ToolCallParser``) text goes into text blocks and each call into a
    ``tool_use`` block whose input streams as ``input_json_delta`` pieces; text that is blank before a call
    is left out, and so is all text of a forced answer (``any``, ``tool``: calls alone by its grammar, so
    its text is a call cut off by ``max_tokens``); ``single`` (``disable_parallel_tool_use``) keeps the
    first call only. An answer with no block at all gets an empty text block."""

    def __init__(self, fmt: ToolFormat, tools: tuple[Tool, ...], choice: ToolChoice, single: bool) -> None:
        offered = bool(tools) and choice.mode != "none"
        self.forced = choice.forced
        call_id = fmt.new_call_id if fmt.syntax == "mistral" else tool_use_id  # Mistral's templates want 9 chars
        self.parser = ToolCallParser(fmt, {t.name for t in tools}, call_id) if offered else None
        self.fmt, self.single = fmt, single
        self.index = -1  # the open block's, -1 before the first
        self.kind: str | None = None  # the open block's type, None when none is open
        self.blank = ""  # blank text held back while no text block is open
        self.calls = 0

    def opening(self) -> list[dict]:
        """The events before any text: a text block's start, without tools."""
        return self._start({"type": "text", "text": ""}) if self.parser is None else []

    def feed(self, text: str) -> list[dict]:
        """The events of the answer's next ``text``."""
        if self.parser is None:
            return [self._text(text)] if text else []
        return self._decided(self.parser.feed(text))

    def close(self) -> list[dict]:
        """The events at the answer's end: what the parser held, then the open block's stop."""
        events = [] if self.parser is None else self._decided(self.parser.finish())
        if self.index < 0:
            events += self._start({"type": "text", "text": ""})
            if self.blank:
                events.append(self._text(self.blank))
        if self.kind is not None:
            events.append({"type": "content_block_stop", "index": self.index})
            self.kind = None
        return events

    def _decided(self, decided: StreamDelta) -> list[dict]:
        events: list[dict] = []
        if decided.content and not self.forced:
            events += self._content(decided.content)
        for piece in decided.calls:
            if piece.index > 0 and self.single:
                continue
            if piece.id is not None:
                events += self._start({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
                self.calls += 1
                self.blank = ""
            if piece.arguments:
                events.append({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta", "partial_json": piece.arguments}})
        return events

    def _content(self, text: str) -> list[dict]:
        if self.kind == "text":
            return [self._text(text)]
        if not (self.blank + text).strip():
            self.blank += text
            return []
        text, self.blank = self.blank + text, ""
        return [*self._start({"type": "text", "text": ""}), self._text(text)]

    def _start(self, block: dict) -> list[dict]:
        events = [] if self.kind is None else [{"type": "content_block_stop", "index": self.index}]
        self.index += 1
        self.kind = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _text(self, text: str) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}

    def whole(self, text: str) -> list[dict]:
        """The content blocks of the whole answer ``text`` (the stream's events, joined). A call whose input
        is not a JSON object (cut short by ``max_tokens``, or malformed) is given as text: the call object as
        the model wrote it."""
        blocks: list[dict] = []
        for event in [*self.opening(), *self.feed(text), *self.close()]:
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"], **({"input": ""} if "input" in event["content_block"]
                                                               else {})))
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    blocks[-1]["text"] += delta["text"]
                else:
                    blocks[-1]["input"] += delta["partial_json"]
        return [self._call_block(b) if b["type"] == "tool_use" else b for b in blocks]

    def _call_block(self, block: dict) -> dict:
        """A whole ``tool_use`` block with its input text decoded (or the call's text when it is no object)."""
        try:
            value = json.loads(block["input"] or "{}")
        except ValueError:
            value = None
        if isinstance(value, dict):
            return {**block, "input": value}
        return {"type": "text", "text": self.fmt.call_object(block["name"], block["input"])}


def stop_sequence(request: Request, text: str, tokenizer: object) -> str | None:
    """The stop sequence that ended ``request`` (its answer ``text``, cut before it), or None (the end of
    sequence, a grammar's end, ``max_tokens``). The output ids hold the tokens that made the sequence, so
    their text goes on with it after ``text``; the shortest that does is the one found first."""
    stops = request.params.stop
    if request.finish_reason is not FinishReason.STOP or not stops:
        return None
    full = tokenizer.decode(list(request.output_ids))
    found = [s for s in stops if full.startswith(text) and full.startswith(s, len(text))]
    return min(found, key=len) if found else None


def message_usage(request: Request) -> dict:
    """Anthropic's ``usage``: ``input_tokens`` prefilled (not from the prefix cache), ``cache_read_input_tokens``
    reused from it (their sum is the prompt), ``cache_creation_input_tokens`` 0 (nothing is billed for keeping
    KV), ``output_tokens``."""
    cached = request.cached_tokens
    return {"input_tokens": len(request.prompt_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": len(request.output_ids)}


class MessagesResponder:
    """Answers ``/v1/messages`` (``messages``) and ``/v1/messages/count_tokens`` (``count_tokens``) from
    ``engine``, with the prompts prepared by ``prompts``."""

    def __init__(self, engine: Engine, prompts: PromptPreparer) -> None:
        self.engine, self.prompts = engine, prompts
        self.tool_format = engine_tool_format(engine)

    async def prompt_ids(self, body: MessagesPrompt) -> list[int]:
        """The prompt's token ids: the conversation through the chat template, with the tools, calls and
        results rendered for it when there are any (``tools.render_messages``). Raises ``InvalidRequest``
        naming the field for what fleet does not implement, and what ``PromptPreparer.chat`` raises."""
        check_model(body.model, self.engine)
        body.refuse_unsupported()
        tools, choice, _ = body.tool_request()
        await self.engine.grammar_check.check(tool_schemas(tools))
        messages = body.conversation()
        if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return await self.prompts.chat(messages)
        offer = bool(tools) and choice.mode != "none"
        rendered, variables = render_messages(messages, tools, self.tool_format, offer=offer)
        return await self.prompts.chat(rendered, variables, extra_bytes(messages, tools if offer else ()))

    async def count_tokens(self, body: MessagesPrompt) -> dict:
        """``{"input_tokens": N}``: the prompt's tokens, as ``messages`` would prefill them."""
        return {"input_tokens": len(await self.prompt_ids(body))}

    async def messages(self, body: MessagesRequest, http: HttpRequest) -> JSONResponse | StreamingResponse:
        """The answer to ``body``: a message, or (``stream``) its SSE events. Generation starts before the 200
        goes out, so errors of the queue, admission and the pipeline keep their status codes."""
        engine = self.engine
        ids = await self.prompt_ids(body)
        tools, choice, parallel = body.tool_request()
        params, sampling = resolve_sampling(body.sampling_request(), engine)
        constraint = body.output_constraint()  # refused with tools offered (refuse_unsupported)
        if tools and choice.mode != "none":  # a forced call, or a strict tool's: a grammar; else free text
            constraint = tool_constraint(tools, choice, parallel, self.tool_format)
        params = replace(params, stop=tuple(body.stop_sequences or ()), constraint=constraint)
        request = engine.request_for(ids, params, "messages", "msg")
        request.cache_scope = request_scope(http.headers)
        blocks = ContentBlocks(self.tool_format, tools, choice, single=parallel is False)
        gen = Generation(engine, request, http)
        await gen.start()
        head = {"id": request.request_id, "type": "message", "role": "assistant", "model": engine.model_name}
        headers = {"request-id": request.request_id}  # what the anthropic client gives as a message's _request_id
        if not body.stream:
            text = "".join(d.text for d in await gen.deltas())
            message = {**head, "content": blocks.whole(text), **self.stop(request, text, blocks, sampling),
                       "usage": message_usage(request), "fleet": fleet_stats(engine, request, sampling)}
            return JSONResponse(message, headers=headers)
        return StreamingResponse(self.events(gen, head, blocks, sampling), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})

    def stop(self, request: Request, text: str, blocks: ContentBlocks, sampling: dict) -> dict:
        """``stop_reason`` and ``stop_sequence`` of the finished ``request`` whose answer is ``text``;
        ``sampling``: ``resolve_sampling``'s report (the ``max_tokens`` asked, which ``Engine.request_for``
        cuts to what the context leaves)."""
        if request.finish_reason is FinishReason.LENGTH:
            cut = request.params.max_tokens < sampling["max_tokens"]
            return {"stop_reason": "model_context_window_exceeded" if cut else "max_tokens", "stop_sequence": None}
        if blocks.calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        matched = stop_sequence(request, text, self.engine.tokenizer)
        return {"stop_reason": "end_turn" if matched is None else "stop_sequence", "stop_sequence": matched}

    async def events(self, gen: Generation, head: dict, blocks: ContentBlocks, sampling: dict) -> AsyncIterator[str]:
        """The SSE events of the started ``gen`` (module docstring); SSE comments (prefill progress) pass as
        they are, which Anthropic's clients skip."""
        gen.unwatch()  # the StreamingResponse watches the connection itself
        request, text = gen.request, ""
        try:
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {**message_usage(request), "output_tokens": 0}}
            yield sse({"type": "message_start", "message": start})
            for event in blocks.opening():
                yield sse(event)
            yield sse({"type": "ping"})
            async for item in gen.events():
                if isinstance(item, str):
                    yield item
                    continue
                text += item.text
                for event in blocks.feed(item.text):
                    yield sse(event)
                if item.finish_reason is not None:
                    for event in blocks.close():
                        yield sse(event)
            yield sse({"type": "message_delta", "delta": self.stop(request, text, blocks, sampling),
                       "usage": message_usage(request), "fleet": fleet_stats(self.engine, request, sampling)})
            yield sse({"type": "message_stop"})
        except FleetError as exc:
            log.warning("%s: failed mid-stream: %s%s", request.request_id, exc.message,
                        f" ({exc.detail})" if exc.detail else "")
            yield sse(anthropic_error(exc))
        finally:
            await gen.aclose()


def add_anthropic_routes(app: FastAPI, responder: MessagesResponder) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, answered by ``responder``. Their errors,
    validation errors included, come in Anthropic's shape (``app.add_error_handlers`` asks
    ``anthropic_errors.anthropic_path``)."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, http: HttpRequest):
        return await responder.messages(body, http)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesPrompt) -> dict:
        return await responder.count_tokens(body)

