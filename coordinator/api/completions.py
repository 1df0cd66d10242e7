"""The one responder of chat and legacy completions (``Responder``): a request's deltas with prefill
progress (``Generation``), the response as a whole or as an SSE stream, usage and the ``fleet`` report. The
two endpoints differ only in how they spell a choice (a ``Dialect``: ``CHAT``'s ``message``/``delta``,
``COMPLETION``'s ``text``) and in their prompt: messages through the chat template, or a raw prompt (a
string or token ids) as it is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from .access import request_scope
from ..errors import ClientGone, FleetError, ModelNotFound
from ..engine.logprobs import TokenBytes, TokenLogprob, chat_logprobs, completion_logprobs
from .openai_schema import ChatCompletionRequest, CompletionRequest, SamplingRequest, resolve_sampling
from .prompts import PromptPreparer
from ..engine.request import Request, RequestStatus, TextDelta
from .tool_chat import ToolAnswer, engine_tool_format, uses_tools
from .tools import tool_schemas

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5  # a streamed request admitted this long without a token starts its response
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens of a legacy completion (vLLM's too)


class Generation:
    """One request's deltas for an HTTP response: ``start``, then ``events`` (streamed) or ``deltas``.

    A streamed request's response starts (HTTP 200) with its first delta, or once it is admitted (KV
    open on every stage) and has prefilled for ``PROGRESS_INTERVAL_S`` without one: then, until the
    first delta, an SSE comment ``: prefill DONE/TOTAL`` (prompt tokens on the stages, in
    ``prefill_chunk`` steps) goes out at once and every ``PROGRESS_INTERVAL_S``, which clients skip (openai-python
    ignores lines starting with ``:``) and which keeps proxies from timing a long prefill out. A request waiting
    while a planned fleet re-plans (status REPLAN_WAIT) starts its response too and gets ``: re-planning ...``
    comments with the re-plan's progress (coordinator/fleet/replan.py ``Replanner.line``).
    Errors before the response starts (the queue, admission, no pipeline) keep their status code;
    later ones go out in the stream as an error event.

    With ``http`` (the request's connection), a client that disconnects before its response starts, or
    before a response not streamed is complete, ends the request (``ClientGone``) and frees its KV: a
    client that times out and retries must not leave its answers generating (issue 26 #3). Once a
    stream starts, Starlette's own watch of the connection does that (``unwatch``)."""

    def __init__(self, engine: Engine, request: Request, http: HttpRequest | None = None) -> None:
        self.request = request
        # a planned fleet's re-planner (its progress while the request waits on it); None in the static mode
        self._replan = getattr(engine, "replan", None)
        self._deltas = engine.generate(request)
        self._pull: asyncio.Future | None = None
        self._gone = asyncio.ensure_future(_disconnected(http)) if http is not None else None

    async def start(self) -> None:
        """Wait for the first delta or for a long prefill under way; raises what the engine raised, or
        ``ClientGone`` when the client disconnected meanwhile."""
        self._pull = asyncio.ensure_future(anext(self._deltas))
        try:
            while not self._pull.done():
                await asyncio.wait({self._pull, *self._watch()}, timeout=PROGRESS_INTERVAL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                self._raise_if_gone()
                if self.request.status is not RequestStatus.WAITING:
                    break
            if self._pull.done():
                self._pull.result()
        except BaseException:
            await self.aclose()
            raise

    def _watch(self) -> set[asyncio.Future]:
        return {self._gone} if self._gone is not None else set()

    def _raise_if_gone(self) -> None:
        if self._gone is not None and self._gone.done():
            raise ClientGone(f"{self.request.request_id}: the client disconnected before its answer was complete")

    def unwatch(self) -> None:
        """Stop watching the connection (a stream's response watches it from now on)."""
        if self._gone is not None:
            self._gone.cancel()

    async def events(self) -> AsyncIterator[TextDelta | str]:
        """The deltas up to the finishing one, after ``start``. Before the first, SSE progress comments at
        once and every ``PROGRESS_INTERVAL_S``; after it, while a delta is ``PROGRESS_INTERVAL_S`` late
        because the request waits on a re-plan (a stage lost mid-answer: ``Engine._fail_over``) or replays
        its tokens on the new pipeline, the same comments keep the stream alive."""
        first = True
        while True:
            pull = self._pull if self._pull is not None else asyncio.ensure_future(anext(self._deltas))
            self._pull = pull
            if first and not pull.done() and (comment := self._progress(first)):
                yield comment
            while not pull.done():
                await asyncio.wait({pull}, timeout=PROGRESS_INTERVAL_S)
                if not pull.done() and (comment := self._progress(first)):
                    yield comment
            self._pull, first = None, False
            delta = pull.result()
            yield delta
            if delta.finish_reason is not None:
                return

    def _progress(self, first: bool) -> str | None:
        """The SSE comment for a request still waiting on its next delta: prefill progress (before the
        first delta; after it, a failover's replay of prompt and answer), or the re-plan's
        (``Replanner.line``); None while it decodes (a slow step needs no comment)."""
        if self.request.status is RequestStatus.PREFILL:
            if not first:
                return f": replaying {self.request.prefilled} tokens on a new pipeline\n\n"
            return f": prefill {self.request.prefilled}/{len(self.request.prompt_ids)}\n\n"
        if self.request.status is RequestStatus.REPLAN_WAIT and self._replan:
            return f": re-planning {self._replan.line()}\n\n"
        return None

    async def deltas(self) -> list[TextDelta]:
        """Every delta (a request not streamed), after ``start``. Raises ``ClientGone`` (the request is
        then cancelled and its KV freed) when the client disconnects first."""
        collect = asyncio.ensure_future(self._collect())
        try:
            await asyncio.wait({collect, *self._watch()}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
                self._raise_if_gone()
            return collect.result()
        finally:
            self.unwatch()
            await self.aclose()

    async def _collect(self) -> list[TextDelta]:
        return [d async for d in self.events() if not isinstance(d, str)]

    async def aclose(self) -> None:
        """Stop generating (when not finished: the request is cancelled and its KV freed)."""
        if self._pull is not None and not self._pull.done():
            self._pull.cancel()
            with contextlib.suppress(BaseException):
                await self._pull
        self._pull = None
        self.unwatch()
        await self._deltas.aclose()


async def _disconnected(http: HttpRequest) -> None:
    """Return once the client of ``http`` (whose body was read) disconnects: the ASGI server's next
    message after the body is ``http.disconnect``."""
    try:
        while (await http.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a connection that cannot be read is as good as gone
        log.debug("reading %s's connection failed", http.url.path, exc_info=True)


def usage(request: Request) -> dict:
    """The response's ``usage``: prompt, completion and total tokens, and the prompt tokens cached."""
    n_in, n_out = len(request.prompt_ids), len(request.output_ids)
    # cached_tokens: prompt tokens whose KV a retained session gave (prefix cache), not prefilled
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}


def fleet_stats(engine: Engine, request: Request, sampling: dict) -> dict:
    """The response's ``fleet`` field: timings, speculation, the sampling used and the output ids."""
    return {"ttft_ms": request.ttft_ms, "decode_tokens_per_s": request.decode_tokens_per_s,
            "draft": engine.draft_source, **request.speculation_stats(), "cached_tokens": request.cached_tokens,
            "sampling": {**sampling, "max_tokens": request.params.max_tokens},
            **({} if request.grammar is None else  # grammar-constrained: the masks' cost on the critical path
               {"grammar": {"masks": request.grammar.masks_computed, "mask_ms": round(request.grammar.mask_ms, 3)}}),
            # the exact ids behind the text (tests compare them with a reference model's)
            "completion_token_ids": list(request.output_ids)}


def check_model(name: str, engine: Engine) -> None:
    """Raise ``ModelNotFound`` when a request names a model (``name``; "" names none) this fleet does not serve."""
    if name and name != engine.model_name:
        raise ModelNotFound(f"model {name!r} not served here; this fleet serves {engine.model_name!r}", param="model")


def sse_response(gen: Generation, head: dict, choice: Callable[[TextDelta], dict | None],
                 finish: Callable[[TextDelta], dict], tail: Callable[[], dict] | None,
                 opening: dict | None = None) -> StreamingResponse:
    """The SSE stream of a started ``gen``: one chunk ``{**head, choices: [choice(delta)]}`` per delta
    (skipped when ``choice`` gives None), then ``finish(last delta)``'s chunk, then (``tail``, for
    ``stream_options.include_usage``) a chunk with no choices and ``tail()``'s fields, then
    ``data: [DONE]``. Every chunk before that carries ``usage: null`` when ``tail`` is given (OpenAI's
    rule). A failure mid-stream is sent as an ``{"error": ...}`` event (openai-python raises it)."""
    extra = {"usage": None} if tail is not None else {}
    gen.unwatch()  # the StreamingResponse watches the connection itself

    def data(choices: list[dict]) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            if opening is not None:
                yield data([opening])
            async for item in gen.events():
                if isinstance(item, str):
                    yield item
                    continue
                if (c := choice(item)) is not None:
                    yield data([c])
                if item.finish_reason is not None:
                    yield data([finish(item)])
            if tail is not None:
                yield "data: " + json.dumps({**head, "choices": [], **tail()}) + "\n\n"
        except FleetError as exc:
            log.warning("%s: failed mid-stream: %s%s", gen.request.request_id, exc.message,
                        f" ({exc.detail})" if exc.detail else "")
            yield "data: " + json.dumps(exc.body()) + "\n\n"
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@dataclass(frozen=True)
class Dialect:
    """How one endpoint spells its responses; everything else about them is the same (``Responder``)."""

    kind: str  # the request id's prefix
    param: str  # the request field holding the prompt (a prompt too long names it)
    chunk_object: str  # ``object`` of each streamed chunk
    whole_object: str  # ``object`` of a response not streamed
    logprobs: Callable[[list[TokenLogprob], TokenBytes, int], dict]  # a choice's ``logprobs`` of its tokens
    whole: Callable[[str], dict]  # the fields of a choice holding the whole text
    piece: Callable[[str], dict]  # the fields of a streamed choice holding a piece of it
    finish: dict  # the fields of the streamed choice that finishes (no text)
    opening: dict | None = None  # the fields of a streamed choice sent before any text, if any
    max_tokens_default: int | None = None  # max_tokens of a request silent on it (None: the coordinator's)


CHAT = Dialect("chatcmpl", "messages", "chat.completion.chunk", "chat.completion", chat_logprobs,
               whole=lambda text: {"message": {"role": "assistant", "content": text}},
               piece=lambda text: {"delta": {"content": text}}, finish={"delta": {}},
               opening={"delta": {"role": "assistant", "content": ""}})
COMPLETION = Dialect("cmpl", "prompt", "text_completion", "text_completion", completion_logprobs,
                     whole=lambda text: {"text": text}, piece=lambda text: {"text": text}, finish={"text": ""},
                     max_tokens_default=COMPLETION_MAX_TOKENS)


class Responder:
    """Answers chat completions (``chat``) and legacy completions (``completion``) from ``engine``'s
    deltas, with the prompts prepared by ``prompts``."""

    def __init__(self, engine: Engine, prompts: PromptPreparer) -> None:
        self.engine, self.prompts = engine, prompts
        self.vocab = TokenBytes(engine.tokenizer.tokenizer)
        self.tool_format = engine_tool_format(engine)

    async def chat(self, body: ChatCompletionRequest, http: HttpRequest) -> dict | StreamingResponse:
        """The answer to a chat completion request: its messages through the chat template; with tools
        (or earlier calls and results), rendered and answered by ``tool_chat.ToolAnswer``."""
        messages = [m.as_dict() for m in body.messages]
        tools, choice = body.tool_request()
        await self.engine.grammar_check.check(tool_schemas(tools))
        if not uses_tools(messages, tools):
            return await self.respond(CHAT, body, http, lambda: self.prompts.chat(messages))
        answer = ToolAnswer(self.tool_format, tools, choice, body.parallel_tool_calls)
        rendered, variables, extra = answer.prompt(messages)
        return await self.respond(CHAT, body, http, lambda: self.prompts.chat(rendered, variables, extra), answer)

    async def completion(self, body: CompletionRequest, http: HttpRequest) -> dict | StreamingResponse:
        """The answer to a legacy completion request: its raw prompt (a string or token ids), no template."""
        vocab_size = self.engine.manifest.architecture.vocab_size
        return await self.respond(COMPLETION, body, http,
                                  lambda: self.prompts.completion(body.single_prompt(), vocab_size))

    async def respond(self, dialect: Dialect, body: SamplingRequest, http: HttpRequest,
                      prompt: Callable[[], Awaitable[list[int]]],
                      tools: ToolAnswer | None = None) -> dict | StreamingResponse:
        """The answer to ``body`` in ``dialect``, whole or (``stream``) as an SSE stream; ``prompt()`` gives
        its prompt's token ids, asked for once the model and sampling fields passed their checks. ``tools``
        (a chat with tools) spells the message or delta, the finish reason, and constrains a forced call.

        Generation starts before the 200 goes out, so errors of the queue, admission and the pipeline keep
        their status codes; a client gone before its answer is complete ends it (``Generation``)."""
        engine = self.engine
        check_model(body.model, engine)
        params, sampling = resolve_sampling(body, engine, dialect.max_tokens_default)
        if tools is not None and tools.constraint is not None:
            params = replace(params, constraint=tools.constraint)
        whole = dialect.whole if tools is None else tools.whole
        reason = (lambda r: r) if tools is None else tools.finish_reason
        request = engine.request_for(await prompt(), params, dialect.param, dialect.kind)
        request.cache_scope = request_scope(http.headers)
        head = {"id": request.request_id, "object": dialect.chunk_object, "created": int(time.time()),
                "model": engine.model_name}

        def logprobs(records: tuple[TokenLogprob, ...]) -> dict | None:
            n = params.logprobs
            return None if n is None else dialect.logprobs(list(records), self.vocab, n)

        def report() -> dict:
            return {"usage": usage(request), "fleet": fleet_stats(engine, request, sampling)}

        gen = Generation(engine, request, http)
        await gen.start()
        if not body.stream:
            deltas = await gen.deltas()
            choice = {"index": 0, **whole("".join(d.text for d in deltas)),
                      "logprobs": logprobs(tuple(r for d in deltas for r in d.logprobs)),
                      "finish_reason": reason(request.finish_reason.value)}
            return {**head, "object": dialect.whole_object, "choices": [choice], **report()}

        def piece(delta: TextDelta) -> dict | None:
            if tools is None:
                fields = dialect.piece(delta.text) if delta.text or delta.logprobs else None
            else:
                fields = tools.piece(delta.text, delta.finish_reason is not None)
                fields = fields if fields is not None or not delta.logprobs else dialect.finish
            if fields is None:
                return None
            return {"index": 0, **fields, "logprobs": logprobs(delta.logprobs), "finish_reason": None}

        def finish(delta: TextDelta) -> dict:
            return {"index": 0, **dialect.finish, "logprobs": None, "finish_reason": reason(delta.finish_reason.value)}

        opening = None if dialect.opening is None else {"index": 0, **dialect.opening, "logprobs": None,
                                                        "finish_reason": None}
        tail = report if body.stream_options is not None and body.stream_options.include_usage else None
        return sse_response(gen, head, piece, finish, tail, opening)
