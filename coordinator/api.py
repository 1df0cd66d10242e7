"""OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/models``, ``/health``) and Prometheus
``/metrics``."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, model_validator
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .engine import Engine, SamplingParams
from .sampling import Penalties
from .errors import ContextLengthExceeded, FleetError, InvalidApiKey, InvalidRequest, ModelNotFound
from .web import add_web_routes

log = logging.getLogger(__name__)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _unicode(self) -> ChatMessage:
        """JSON may carry lone surrogates (``"\\ud800"``, or their UTF-8-like bytes): not characters,
        and the tokenizer cannot take them."""
        try:
            self.text().encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"content is not valid Unicode: a lone surrogate at character {exc.start}") from None
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat completion request fleet honours (unknown fields are ignored)."""

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # sampling fields left out take the model's defaults (generation_config.json), else OpenAI's
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="fleet extension (as in vLLM): sample among the k best (0 = all)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="fleet extension (as in vLLM, "
                                             "transformers): > 1 discourages tokens of the prompt and output")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    ignore_eos: bool = Field(False, description="fleet extension (as in vLLM): do not stop at end-of-sequence")


# what a field is when neither the request nor the model's generation_config.json sets it (OpenAI's defaults)
SAMPLING_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "frequency_penalty": 0.0,
                      "presence_penalty": 0.0, "repetition_penalty": 1.0}


def resolve_sampling(body: ChatCompletionRequest, engine: Engine) -> tuple[SamplingParams, dict]:
    """The request's sampling parameters: its own fields, else the model's defaults, else OpenAI's; and
    the report of what was used (the response's ``fleet.sampling``, ``from_model`` naming the defaults taken)."""
    model = engine.generation_defaults
    used, from_model = {}, []
    for name, fallback in SAMPLING_FALLBACKS.items():
        value = getattr(body, name)
        if value is None and name in model:
            value = model[name]
            from_model.append(name)
        used[name] = fallback if value is None else value
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None and "max_tokens" in model:
        max_tokens = max(1, int(model["max_tokens"]))
        from_model.append("max_tokens")
    used["max_tokens"] = max_tokens or engine.settings.max_tokens_default
    params = SamplingParams(
        max_tokens=used["max_tokens"], temperature=used["temperature"], top_p=used["top_p"], seed=body.seed,
        ignore_eos=body.ignore_eos, top_k=used["top_k"],
        penalties=Penalties(used["frequency_penalty"], used["presence_penalty"], used["repetition_penalty"]))
    return params, {**used, "from_model": from_model}


def _error_response(exc: FleetError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class ApiKeys:
    """ASGI middleware: requests to ``/v1`` and below need ``Authorization: Bearer KEY`` with one of
    ``keys``, else HTTP 401 with an OpenAI error body (``invalid_api_key``). Other paths (``/health``,
    ``/metrics``) stay open. Keys are compared as SHA-256 digests in constant time, against every key."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def refusal(self, authorization: str | None) -> InvalidApiKey | None:
        """Why a request with this ``Authorization`` header value is refused, or None when it may pass."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return InvalidApiKey("this fleet requires an API key: send 'Authorization: Bearer KEY' "
                                 "(fleet-chat --api-key, or the OpenAI client's api_key)")
        digest = hashlib.sha256(key.strip().encode()).digest()
        if not sum(hmac.compare_digest(digest, d) for d in self._digests):  # no early exit
            return InvalidApiKey("invalid API key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            refused = self.refusal(header.decode("latin-1") if header is not None else None)
            if refused is not None:
                await _error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def prompt_byte_limit(engine: Engine) -> int:
    """Message text (UTF-8 bytes) beyond which a prompt cannot fit the context whatever it says: no
    token of the vocabulary stands for more bytes than its own UTF-8 spelling, so a longer text needs
    more than ``max_context`` tokens. Refusing it before tokenizing keeps a megabyte-long prompt from
    holding the event loop (and every stream) for seconds."""
    vocab = engine.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return engine.max_context * max(len(token.encode("utf-8")) for token in vocab)


def create_app(engine: Engine, health: callable) -> FastAPI:  # type: ignore[valid-type]
    """Build the FastAPI app around ``engine``; ``health()`` returns the fleet status dict. When
    ``engine.settings.allowed_api_keys`` holds keys, ``/v1/*`` requires one of them (``ApiKeys``)."""
    app = FastAPI(title="fleet", description="OpenAI-compatible API of a fleet coordinator")
    byte_limit = prompt_byte_limit(engine)
    if keys := engine.settings.allowed_api_keys:
        app.add_middleware(ApiKeys, keys=keys)
        log.info("HTTP API: /v1/* requires one of %d API key(s)", len(keys))

    @app.exception_handler(FleetError)
    async def fleet_error(_: HttpRequest, exc: FleetError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request refused: %s%s", exc.message, f" ({exc.detail})" if exc.detail else "")
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(InvalidRequest("request body is not valid JSON"))
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if param is None:
            return _error_response(InvalidRequest(f"request body must be a JSON object: {first.get('msg', '')}"))
        return _error_response(InvalidRequest(f"invalid {param}: {first.get('msg', 'bad value')}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.get("/health")
    async def get_health() -> JSONResponse:
        status = health()
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "fleet",
                                            # fleet extension: what requests silent on a field get
                                            "generation_defaults": engine.generation_defaults}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):  # noqa: ANN202
        if body.model and body.model != engine.model_name:
            raise ModelNotFound(f"model {body.model!r} not served here; this fleet serves {engine.model_name!r}",
                                param="model")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise InvalidRequest("stop takes up to 4 non-empty strings", param="stop")
        params, sampling = resolve_sampling(body, engine)
        params.stop = tuple(stop)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        size = sum(len(m["content"].encode("utf-8")) for m in messages)
        if size > byte_limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.max_context} tokens. However, your messages are "
                f"{size} bytes long, more than {engine.max_context} tokens can hold ({byte_limit} bytes). Please "
                "reduce the length of the messages.", param="messages")
        request = engine.make_request(messages, params)
        created = int(time.time())
        stream = engine.generate(request)

        def usage() -> dict:
            n_in, n_out = len(request.prompt_ids), len(request.output_ids)
            return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

        def stats() -> dict:
            return {"ttft_ms": request.ttft_ms, "decode_tokens_per_s": request.decode_tokens_per_s,
                    "draft": engine.draft_source, **request.speculation_stats(),
                    "sampling": {**sampling, "max_tokens": request.params.max_tokens},
                    # the exact ids behind the text (tests compare them with a reference model's)
                    "completion_token_ids": list(request.output_ids)}

        if not body.stream:
            try:
                text = "".join([d.text async for d in stream])
            finally:
                await stream.aclose()
            return {
                "id": request.request_id, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": request.finish_reason.value, "logprobs": None}],
                "usage": usage(), "fleet": stats(),
            }

        # Start generating before the 200 goes out, so admission and pipeline errors get a status code.
        first = await anext(stream)

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({
                "id": request.request_id, "object": "chat.completion.chunk", "created": created,
                "model": engine.model_name, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }) + "\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                delta = first
                while True:
                    if delta.text:
                        yield chunk({"content": delta.text})
                    if delta.finish_reason is not None:
                        yield chunk({}, delta.finish_reason.value)
                        break
                    delta = await anext(stream)
                if body.stream_options and body.stream_options.include_usage:
                    yield "data: " + json.dumps({"id": request.request_id, "object": "chat.completion.chunk",
                                                 "created": created, "model": engine.model_name, "choices": [],
                                                 "usage": usage(), "fleet": stats()}) + "\n\n"
            except FleetError as exc:
                log.warning("%s: failed mid-stream: %s%s", request.request_id, exc.message,
                            f" ({exc.detail})" if exc.detail else "")
                yield "data: " + json.dumps(exc.body()) + "\n\n"
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    add_web_routes(app)  # the chat page at / (open: /v1/* alone needs a key)
    return app
