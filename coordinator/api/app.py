"""OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``), the Anthropic Messages API (``/v1/messages``: ``anthropic_api``) and Prometheus ``/metrics``.
The OpenAI request bodies and the fields fleet refuses are in ``openai_schema``; the answers to both
completion endpoints come from ``completions.Responder``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .access import ApiKeys, key_given, public_health
from .anthropic_api import MessagesResponder, add_anthropic_routes
from .anthropic_errors import anthropic_path, anthropic_response, error_body
from .completions import Responder, check_model
from ..errors import FleetError, InvalidRequest
from .http_guard import HostCheck, served_host_names
from .limits import BodyLimit
from .ollama_api import add_ollama_routes
from .ollama_errors import ollama_path, ollama_response
from .openai_schema import ChatCompletionRequest, CompletionRequest
from .prompts import PromptPreparer
from ..engine.sampling import fallback_sampling
from .web import add_web_routes

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..settings import CoordinatorSettings

__all__ = ["create_app", "model_card"]

log = logging.getLogger(__name__)


def create_app(engine: Engine, health: Callable[[], dict]) -> FastAPI:
    """Build the FastAPI app around ``engine``; ``health()`` returns the fleet status dict. When
    ``engine.settings.allowed_api_keys`` holds keys, ``/v1/*`` requires one of them (``access``: what else
    does). Requests for a Host the coordinator does not serve are refused (``http_guard.HostCheck``); no
    Swagger UI (``/docs`` would load it from a CDN)."""
    prompts = PromptPreparer(engine.tokenizer, engine.max_context)  # size checks, then off the event loop
    app = FastAPI(title="fleet", description="OpenAI-compatible API of a fleet coordinator", docs_url=None,
                  redoc_url=None)
    add_guards(app, engine.settings, prompts.body_limit)
    add_error_handlers(app)
    add_status_routes(app, engine, health)
    add_model_routes(app, engine)
    responder = Responder(engine, prompts)
    add_completion_routes(app, responder)
    add_ollama_routes(app, responder)  # /api/* (the Ollama API), on the same responder
    add_anthropic_routes(app, MessagesResponder(engine, prompts))
    add_web_routes(app)  # the chat page at / (open: /v1/* alone needs a key)
    return app


def add_guards(app: FastAPI, settings: CoordinatorSettings, body_limit: int) -> None:
    """The middleware every request passes first: the Host check, then the body cap (``body_limit`` bytes:
    a 413 before any parsing), then the API keys (when ``settings`` has any)."""
    if keys := settings.allowed_api_keys:
        app.add_middleware(ApiKeys, keys=keys, public_metrics=settings.public_metrics)
        log.info("HTTP API: /v1/* and /api/* require one of %d API key(s)", len(keys))
    app.add_middleware(BodyLimit, max_bytes=body_limit)
    app.add_middleware(HostCheck, names=served_host_names(settings.host, settings.allowed_host))


def _error_response(exc: FleetError, http: HttpRequest | None = None) -> JSONResponse:
    if http is not None and anthropic_path(http.url.path):
        return anthropic_response(exc)
    if http is not None and ollama_path(http.url.path):
        return ollama_response(exc)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error body (on the Anthropic API's paths, as Anthropic's:
    ``anthropic_errors``): fleet's own (``FleetError``), a body that does not validate (400 naming the
    field), and Starlette's (404, 405, a chunked body over the cap: 413)."""

    @app.exception_handler(FleetError)
    async def fleet_error(http: HttpRequest, exc: FleetError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request refused: %s%s", exc.message, f" ({exc.detail})" if exc.detail else "")
        return _error_response(exc, http)

    @app.exception_handler(RequestValidationError)
    async def validation_error(http: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(InvalidRequest("request body is not valid JSON"), http)
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if param is None:
            return _error_response(InvalidRequest(f"request body must be a JSON object: {first.get('msg', '')}"),
                                   http)
        return _error_response(InvalidRequest(f"invalid {param}: {first.get('msg', 'bad value')}", param=param),
                               http)

    @app.exception_handler(HTTPException)
    async def http_error(http: HttpRequest, exc: HTTPException) -> JSONResponse:
        if anthropic_path(http.url.path):
            return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)
        if ollama_path(http.url.path):
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "request_too_large" if exc.status_code == 413 else None  # limits.BodyLimit, a chunked body
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": code}},
                            status_code=exc.status_code)


def add_status_routes(app: FastAPI, engine: Engine, health: Callable[[], dict]) -> None:
    """``GET /health`` (``health()``; without a key where keys are needed, only ``access.PUBLIC_HEALTH``
    unless ``--public-health``) and ``GET /metrics``."""
    settings = engine.settings

    @app.get("/health")
    async def get_health(http: HttpRequest) -> JSONResponse:
        status = health()
        if not (settings.public_health or key_given(http.scope)):
            status = public_health(status)
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(engine: Engine) -> dict:
    """The model entry of ``/v1/models``, with fleet extensions: ``generation_defaults`` (what requests
    silent on a field get from the model's generation_config.json), ``fallback_sampling`` (what a chat
    client sends when its user sets no sampling field: ``sampling.fallback_sampling``, {} when the model
    has defaults of its own) and, for a calibrated sparse FFN build, ``sparse_ffn`` (its S and the loss its
    manifest states against the dense build)."""
    defaults = engine.generation_defaults
    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "fleet",
            "generation_defaults": defaults, "fallback_sampling": fallback_sampling(defaults)}
    if (sparse := engine.manifest.sparse_ffn) is not None:
        card["sparse_ffn"] = {"sparsity": sparse.sparsity, "ppl_increase": sparse.ppl_increase,
                              "agreement": sparse.agreement, "quality_tokens": sparse.quality_tokens}
    return card


def add_model_routes(app: FastAPI, engine: Engine) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{id}`` (404 for a model not served here)."""

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(engine)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id or "?", engine)
        return model_card(engine)


def add_completion_routes(app: FastAPI, responder: Responder) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's legacy completions), both
    answered by ``responder``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):  # noqa: ANN202
        return await responder.chat(body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):  # noqa: ANN202
        return await responder.completion(body, http)
