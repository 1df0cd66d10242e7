"""The Ollama API (https://github.com/ollama/ollama/blob/main/docs/api.md) over the same generation path as the
OpenAI endpoints (``completions.Generation``, ``openai_schema.resolve_sampling``, ``prompts.PromptPreparer``,
``tool_chat.ToolAnswer``): ``POST /api/chat`` and ``POST /api/generate``, streamed as NDJSON unless
``stream`` is false (one JSON object per line, the last with ``done: true``, ``done_reason`` and the timings in
nanoseconds), ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps`` and ``GET /api/version``. Every error
of these paths comes as ``{"error": "message"}`` with its status (``ollama_errors``); what fleet does not
implement is refused by name (``ollama_schema``).

Model names: the fleet's model id, or the id with Ollama's default tag (``<id>:latest``, how ``/api/tags``
lists it). Tools: Ollama's ``tools`` are OpenAI's shape; the model decides whether to call (Ollama has no
``tool_choice``), and the answer's calls come as ``message.tool_calls`` (arguments as an object), streamed
once each call is complete. Beyond Ollama's fields, the last object carries fleet's report (``fleet``: the
sampling used, speculation, the output token ids), as the OpenAI responses do.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .access import request_scope
from .completions import Generation, Responder, fleet_stats
from ..errors import FleetError, InvalidRequest
from ..engine.logprobs import chat_logprobs
from .ollama_errors import ollama_error, ollama_response
from .ollama_schema import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaRequest,
    chat_messages,
    check_model_name,
    sampling_request,
)
from .openai_schema import resolve_sampling
from ..engine.request import Request, SamplingParams, TextDelta
from .tool_chat import ToolAnswer, uses_tools
from .tools import AUTO, parse_tools, tool_schemas

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["OLLAMA_API_VERSION", "add_ollama_routes"]

log = logging.getLogger(__name__)

OLLAMA_API_VERSION = "0.6.0"  # the Ollama release whose API this follows (tools, structured outputs), for /api/version
NDJSON = "application/x-ndjson"
FOREVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the workers keep the model loaded while they run
ROUTES = {"/api/chat": "POST", "/api/generate": "POST", "/api/tags": "GET", "/api/show": "POST", "/api/ps": "GET",
          "/api/version": "GET"}


def now_iso() -> str:
    """The current UTC time in RFC 3339 (Ollama's ``created_at``)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    """``seconds`` in whole nanoseconds (Ollama's durations)."""
    return max(0, int(seconds * 1e9))


def timings(request: Request, received: float) -> dict:
    """The last object's counts and durations (ns): ``total_duration`` since the request arrived
    (``received``, ``time.perf_counter``), ``load_duration`` its preparation (template, tokens: fleet's
    model is always loaded), ``prompt_eval_*`` the prompt's tokens and the time to the first token
    (queue and prefill), ``eval_*`` the answer's tokens and the time after the first."""
    end = request.finished_at or time.perf_counter()
    first = request.first_token_at or end
    return {"total_duration": ns(end - received), "load_duration": ns(request.created - received),
            "prompt_eval_count": len(request.prompt_ids), "prompt_eval_duration": ns(first - request.created),
            "eval_count": len(request.output_ids), "eval_duration": ns(end - first)}


class ChatSpelling:
    """How ``/api/chat`` spells an answer: ``message`` with ``content`` and ``tool_calls`` (``answer``: the
    request's tools, None without)."""

    def __init__(self, answer: ToolAnswer | None) -> None:
        self.parser = None if answer is None else answer.parser
        self._calls_sent = 0

    @staticmethod
    def _message(content: str, calls: list | None = None) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments_value()}} for c in calls]
        return {"message": message}

    def piece(self, text: str, last: bool) -> dict | None:
        """A streamed object's fields for the answer's next ``text`` (``last``: the answer ends with it): its
        content, and the calls completed with it; None when it decides nothing yet."""
        if self.parser is None:
            return self._message(text) if text else None
        decided = self.parser.feed(text)
        content = decided.content + (self.parser.finish().content if last else "")
        calls = self.parser.calls[self._calls_sent:]
        self._calls_sent = len(self.parser.calls)
        return self._message(content, calls) if content or calls else None

    def whole(self, text: str) -> dict:
        """The fields of an answer not streamed: the whole ``text``, or its content and calls."""
        if self.parser is None:
            return self._message(text)
        self.parser.feed(text)
        self.parser.finish()
        return self._message(self.parser.content, self.parser.calls)

    done: ClassVar[dict] = {"message": {"role": "assistant", "content": ""}}  # the last streamed object's


class GenerateSpelling:
    """How ``/api/generate`` spells an answer: ``response`` text."""

    @staticmethod
    def piece(text: str, last: bool) -> dict | None:
        """A streamed object's fields for the next ``text``."""
        return {"response": text} if text else None

    @staticmethod
    def whole(text: str) -> dict:
        """The fields of an answer not streamed."""
        return {"response": text}

    done: ClassVar[dict] = {"response": ""}


Spelling = ChatSpelling | GenerateSpelling


class OllamaResponder:
    """Answers ``/api/chat`` and ``/api/generate`` with the OpenAI endpoints' ``responder`` parts (its
    engine, prompt preparer, token bytes and tool format)."""

    def __init__(self, responder: Responder) -> None:
        self.engine: Engine = responder.engine
        self.prompts, self.vocab, self.tool_format = responder.prompts, responder.vocab, responder.tool_format

    def _sampling(self, body: OllamaRequest, **extra: Any) -> tuple:
        """(SamplingParams, the report of what was used) of ``body``'s options; errors name the option."""
        engine = self.engine
        if body.top_logprobs and body.top_logprobs > (limit := engine.settings.sample_top_k):
            raise InvalidRequest(f"top_logprobs is {body.top_logprobs}, more than the {limit} candidates this "
                                 f"fleet's last stage returns per token (the coordinator's --sample-top-k)",
                                 param="top_logprobs")
        try:
            return resolve_sampling(sampling_request(body, engine.max_context), engine, **extra)
        except InvalidRequest as exc:
            if exc.param == "stop":  # resolve_sampling names the OpenAI field
                raise InvalidRequest(exc.message.replace("stop", "options.stop", 1), param="options.stop") from None
            raise

    def _loaded(self, body: OllamaRequest, spelling: Spelling) -> JSONResponse:
        """The answer to a request with no prompt: Ollama loads the model, and says so (``done_reason``)."""
        body.refuse_unload()
        return JSONResponse({"model": body.model, "created_at": now_iso(), **spelling.whole(""), "done": True,
                             "done_reason": "load"})

    async def chat(self, body: OllamaChatRequest, http: HttpRequest, received: float) -> Response:
        """The answer to ``/api/chat``: the messages through the model's chat template, with the tools."""
        check_model_name(body.model, self.engine.model_name)
        body.refuse_unsupported()
        messages = chat_messages(body.messages)
        tools = parse_tools(body.tools or None)
        await self.engine.grammar_check.check(tool_schemas(tools))
        if tools and body.format not in (None, ""):
            raise InvalidRequest("format with tools: the answer could not be a call; send one of them",
                                 param="format")
        params, sampling = self._sampling(body)  # options are checked even when there is nothing to answer
        if not messages:
            return self._loaded(body, ChatSpelling(None))
        answer = None
        if uses_tools(messages, tools):
            answer = ToolAnswer(self.tool_format, tools, AUTO, None)
            rendered, variables, extra = answer.prompt(messages)
            if answer.constraint is not None:
                params = replace(params, constraint=answer.constraint)
            prompt = lambda: self.prompts.chat(rendered, variables, extra)
        else:
            prompt = lambda: self.prompts.chat(messages)
        return await self._respond(body, http, received, params, sampling, prompt, "messages", ChatSpelling(answer))

    async def generate(self, body: OllamaGenerateRequest, http: HttpRequest, received: float) -> Response:
        """The answer to ``/api/generate``: the prompt as a user turn (after ``system``) through the chat
        template, or with ``raw`` as it is."""
        check_model_name(body.model, self.engine.model_name)
        body.refuse_unsupported()
        params, sampling = self._sampling(body)
        if not body.prompt:
            return self._loaded(body, GenerateSpelling())
        if body.raw:
            prompt = lambda: self.prompts.text(body.prompt)
        else:
            turns = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": body.prompt}]
            prompt = lambda: self.prompts.chat(turns)
        return await self._respond(body, http, received, params, sampling, prompt, "prompt", GenerateSpelling())

    async def _respond(self, body: OllamaRequest, http: HttpRequest, received: float, params: SamplingParams, sampling: dict,
                       prompt: Callable[[], Awaitable[list[int]]], param: str, spelling: Spelling) -> Response:
        """Generate for ``prompt()`` and answer whole or as NDJSON; generation starts before the 200 goes out,
        so errors of the queue, admission and the pipeline keep their status (``completions.Generation``)."""
        engine = self.engine
        request = engine.request_for(await prompt(), params, param, "ollama")
        request.cache_scope = request_scope(http.headers)
        gen = Generation(engine, request, http)
        await gen.start()

        def last(text_fields: dict) -> dict:
            return {"model": body.model, "created_at": now_iso(), **text_fields, "done": True,
                    "done_reason": request.finish_reason.value, **timings(request, received),
                    "fleet": fleet_stats(engine, request, sampling)}

        def logprobs(deltas: list[TextDelta]) -> dict:
            if params.logprobs is None:
                return {}
            records = [r for d in deltas for r in d.logprobs]
            return {"logprobs": chat_logprobs(records, self.vocab, params.logprobs)["content"]}

        if not body.stream:
            deltas = await gen.deltas()
            return JSONResponse({**last(spelling.whole("".join(d.text for d in deltas))), **logprobs(deltas)})

        async def lines() -> AsyncIterator[str]:
            try:
                async for delta in gen.events():
                    if isinstance(delta, str):  # prefill progress: NDJSON has no comments
                        continue
                    fields = spelling.piece(delta.text, delta.finish_reason is not None)
                    if fields is not None or delta.logprobs:
                        fields = fields or spelling.done
                        yield json.dumps({"model": body.model, "created_at": now_iso(), **fields, "done": False,
                                          **logprobs([delta])}) + "\n"
                yield json.dumps(last(spelling.done)) + "\n"
            except FleetError as exc:
                log.warning("%s: failed mid-stream: %s", request.request_id, exc.message)
                yield json.dumps(ollama_error(exc)) + "\n"
            finally:
                await gen.aclose()

        gen.unwatch()  # the StreamingResponse watches the connection itself
        return StreamingResponse(lines(), media_type=NDJSON)


class ShowRequest(BaseModel):
    """``POST /api/show``: the ``model`` (``name`` in Ollama's older clients); ``verbose`` adds nothing here."""

    model: str = ""
    name: str = ""
    verbose: bool = False


def model_entry(engine: Engine) -> dict:
    """The model as ``/api/tags`` lists it: ``<id>:latest``, the build's weights size (bytes of its stages),
    its digest (the build's identity, the sha256 of its manifest) and details."""
    loaded = engine.registry.loaded
    directory, manifest = loaded.directory, loaded.manifest
    size = sum((directory / s.bin).stat().st_size for s in manifest.stages if (directory / s.bin).is_file())
    modified = datetime.fromtimestamp((directory / "manifest.json").stat().st_mtime, UTC)
    family = manifest.architecture.model_type
    name = f"{engine.model_name}:latest"
    return {"name": name, "model": name, "modified_at": modified.isoformat().replace("+00:00", "Z"), "size": size,
            "digest": loaded.sha256, "details": {"parent_model": "", "format": "openvino", "family": family,
                                                 "families": [family], "parameter_size": "",
                                                 "quantization_level": manifest.weights.upper()}}


def model_info(engine: Engine) -> dict:
    """``/api/show``'s answer: the details, the architecture as ``model_info`` (GGUF's key names, as Ollama
    gives them), the model's generation defaults as ``parameters``, its chat template (Jinja, not Ollama's Go
    template) and ``capabilities``."""
    arch = engine.manifest.architecture
    kind = arch.model_type
    info = {"general.architecture": kind, f"{kind}.block_count": arch.num_layers,
            f"{kind}.context_length": engine.max_context, f"{kind}.embedding_length": arch.hidden_size,
            f"{kind}.attention.head_count": arch.num_attention_heads,
            f"{kind}.attention.head_count_kv": arch.num_key_value_heads, f"{kind}.vocab_size": arch.vocab_size}
    parameters = "\n".join(f"{k:<30} {json.dumps(v)}" for k, v in sorted(engine.generation_defaults.items()))
    entry = model_entry(engine)
    return {"modelfile": "", "parameters": parameters, "template": engine.tokenizer.chat_template or "",
            "details": entry["details"], "model_info": info, "modified_at": entry["modified_at"],
            "capabilities": ["completion", "tools"]}


async def read_body(http: HttpRequest, model: type[BaseModel]) -> Any:
    """The request's JSON body validated as ``model``; raises ``InvalidRequest`` naming the field."""
    raw = await http.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or None
        raise InvalidRequest(f"invalid {param}: {first['msg']}", param=param) from None


def ollama_errors(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """``handler`` with every error it raises answered in Ollama's shape."""
    async def guarded(http: HttpRequest) -> Response:
        try:
            return await handler(http)
        except FleetError as exc:
            if exc.status >= 500:
                log.warning("request refused: %s%s", exc.message, f" ({exc.detail})" if exc.detail else "")
            return ollama_response(exc)
        except HTTPException as exc:  # a chunked body over the cap (limits.BodyLimit)
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
    return guarded


def add_ollama_routes(app: FastAPI, responder: Responder) -> None:
    """The Ollama API's routes (module docstring) on ``app``, answered with ``responder``'s parts; any
    other path under ``/api`` is a 404 (a 405 for a known path with another method) in Ollama's shape."""
    ollama = OllamaResponder(responder)
    engine = responder.engine

    @ollama_errors
    async def chat(http: HttpRequest) -> Response:
        received = time.perf_counter()
        return await ollama.chat(await read_body(http, OllamaChatRequest), http, received)

    @ollama_errors
    async def generate(http: HttpRequest) -> Response:
        received = time.perf_counter()
        return await ollama.generate(await read_body(http, OllamaGenerateRequest), http, received)

    @ollama_errors
    async def show(http: HttpRequest) -> Response:
        body = await read_body(http, ShowRequest)
        check_model_name(body.model or body.name, engine.model_name)
        return JSONResponse(model_info(engine))

    async def tags() -> dict:
        return {"models": [model_entry(engine)]}

    async def ps() -> dict:
        entry = model_entry(engine)
        return {"models": [{**entry, "expires_at": FOREVER, "size_vram": 0, "context_length": engine.max_context}]}

    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION}

    async def unknown(http: HttpRequest) -> JSONResponse:
        path = http.url.path.rstrip("/")
        if path in ROUTES:
            return JSONResponse({"error": f"{http.method} {path} is not allowed: use {ROUTES[path]}"}, status_code=405)
        return JSONResponse({"error": f"fleet does not implement {path}; its Ollama API serves "
                             + ", ".join(f"{m} {p}" for p, m in ROUTES.items())}, status_code=404)

    app.add_api_route("/api/chat", chat, methods=["POST"])
    app.add_api_route("/api/generate", generate, methods=["POST"])
    app.add_api_route("/api/show", show, methods=["POST"])
    app.add_api_route("/api/tags", tags, methods=["GET"])
    app.add_api_route("/api/ps", ps, methods=["GET"])
    app.add_api_route("/api/version", version, methods=["GET"])
    app.add_api_route("/api/{rest:path}", unknown, methods=["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"],
                      include_in_schema=False)  # one route of six methods: no duplicate operation ids
