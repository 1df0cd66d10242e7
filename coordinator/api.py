"""OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``) and Prometheus ``/metrics``. The request bodies and the fields fleet refuses are in
``openai_schema``; what chat and legacy completions share in ``completions``."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .access import ApiKeys, key_given, public_health
from .completions import Generation, add_completions, cache_scope, check_model, fleet_stats, sse_response, usage
from .engine import Engine
from .request import TextDelta
from .errors import FleetError, InvalidRequest
from .limits import BodyLimit
from .logprobs import TokenBytes, chat_logprobs
from .openai_schema import ChatCompletionRequest, resolve_sampling
from .prompts import PromptPreparer
from .http_guard import HostCheck, served_host_names
from .web import add_web_routes

__all__ = ["ApiKeys", "ChatCompletionRequest", "create_app", "resolve_sampling"]

log = logging.getLogger(__name__)


def _error_response(exc: FleetError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(engine: Engine, health: callable) -> FastAPI:  # type: ignore[valid-type]
    """Build the FastAPI app around ``engine``; ``health()`` returns the fleet status dict. When
    ``engine.settings.allowed_api_keys`` holds keys, ``/v1/*`` requires one of them (``access``: what else
    does). Requests for a Host the coordinator does not serve are refused (``http_guard.HostCheck``); no
    Swagger UI (``/docs`` would load it from a CDN)."""
    settings = engine.settings
    prompts = PromptPreparer(engine.tokenizer, engine.max_context)  # size checks, then off the event loop
    app = FastAPI(title="fleet", description="OpenAI-compatible API of a fleet coordinator", docs_url=None,
                  redoc_url=None)
    vocab = TokenBytes(engine.tokenizer.tokenizer)
    if keys := engine.settings.allowed_api_keys:
        app.add_middleware(ApiKeys, keys=keys, public_metrics=settings.public_metrics)
        log.info("HTTP API: /v1/* requires one of %d API key(s)", len(keys))
    app.add_middleware(BodyLimit, max_bytes=prompts.body_limit)  # before any parsing: 413 for a huge body
    app.add_middleware(HostCheck, names=served_host_names(settings.host, settings.allowed_host))

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
        code = "request_too_large" if exc.status_code == 413 else None  # limits.BodyLimit, a chunked body
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": code}},
                            status_code=exc.status_code)

    @app.get("/health")
    async def get_health(http: HttpRequest) -> JSONResponse:
        status = health()
        if not (settings.public_health or key_given(http.scope)):
            status = public_health(status)
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "fleet",
                # fleet extension: what requests silent on a field get
                "generation_defaults": engine.generation_defaults}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id or "?", engine)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):  # noqa: ANN202
        check_model(body.model, engine)
        params, sampling = resolve_sampling(body, engine)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        request = engine.request_for(await prompts.chat(messages), params)
        request.cache_scope = cache_scope(http)
        head = {"id": request.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": engine.model_name}
        n = params.logprobs

        def logprobs(records: tuple) -> dict | None:
            return None if n is None else chat_logprobs(list(records), vocab, n)

        # Start generating before the 200 goes out, so admission and pipeline errors get a status code.
        gen = Generation(engine, request, http)  # a client gone before its answer is done ends it
        await gen.start()
        if not body.stream:
            deltas = await gen.deltas()
            return {
                **head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                             "finish_reason": request.finish_reason.value,
                             "logprobs": logprobs(tuple(r for d in deltas for r in d.logprobs))}],
                "usage": usage(request), "fleet": fleet_stats(engine, request, sampling),
            }

        def choice(delta: TextDelta) -> dict | None:
            if not delta.text and not delta.logprobs:
                return None
            return {"index": 0, "delta": {"content": delta.text}, "logprobs": logprobs(delta.logprobs),
                    "finish_reason": None}

        def finish(delta: TextDelta) -> dict:
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason.value}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        tail = (lambda: {"usage": usage(request), "fleet": fleet_stats(engine, request, sampling)}) if include_usage \
            else None
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse_response(gen, head, choice, finish, tail, opening)

    add_completions(app, engine, vocab, prompts)
    add_web_routes(app)  # the chat page at / (open: /v1/* alone needs a key)
    return app
