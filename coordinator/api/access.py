"""Who may see what over HTTP when the coordinator has API keys (``--api-key-file``, ``--api-keys``).

| path | without a key | with a key |
|---|---|---|
| ``/``, ``/static/*``, ``/favicon.ico`` (the chat page) | yes: it holds no secret | yes |
| ``/v1/*`` | 401 (on ``/v1/messages``: in Anthropic's shape) | yes |
| ``/api/*`` (the Ollama API) | 401 in Ollama's shape | yes |
| ``/openapi.json`` (the API's schema) | 401 | yes |
| ``/metrics`` (names every worker's address) | 401; ``--public-metrics``: yes | yes |
| ``/health`` | ready, model, stages, missing stages, request counts (``PUBLIC_HEALTH``); ``--public-health``: all | all |
| ``/docs``, ``/redoc`` | not served (Swagger UI would load from a CDN) | not served |

A key comes as ``Authorization: Bearer KEY`` (OpenAI's clients) or as ``x-api-key: KEY`` (Anthropic's).
Without keys everything above is open (as the API itself is); the Host check (``http_guard.HostCheck``)
keeps web pages of other origins out either way.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .anthropic_errors import anthropic_path, anthropic_response
from ..errors import InvalidApiKey
from .ollama_errors import ollama_path, ollama_response

# the /health fields any caller sees: enough for a load balancer or a readiness probe, no address
PUBLIC_HEALTH = ("ready", "shutting_down", "model", "num_stages", "protocol_version", "missing_stages", "queued",
                 "running")
KEY_SCOPE = "fleet_api_key"  # scope["state"][KEY_SCOPE]: the request carried a valid key (or none is needed)


def public_health(status: dict) -> dict:
    """``status`` (the ``/health`` JSON) cut down to ``PUBLIC_HEALTH``, with a note on how to see the rest."""
    return {**{k: status[k] for k in PUBLIC_HEALTH if k in status},
            "workers_hidden": "send the API key (or start the coordinator with --public-health) to see the workers"}


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization`` header value ``Bearer KEY`` (stripped; the scheme in any case), or
    None for another scheme, an empty key or no header."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def request_key(authorization: str | None, x_api_key: str | None = None) -> str | None:
    """The API key a request carries: its ``Authorization: Bearer`` key, else its ``x-api-key`` header
    value (stripped; how Anthropic's clients send it), else None."""
    key = bearer_key(authorization)
    if key is None and x_api_key is not None:
        key = x_api_key.strip() or None
    return key


def key_digest(key: str) -> bytes:
    """The SHA-256 digest of an API key: what keys are compared as, and what a cache scope is made of."""
    return hashlib.sha256(key.encode()).digest()


def cache_scope(authorization: str | None, x_api_key: str | None = None) -> str:
    """Whose retained KV (prefix cache) a request with this ``Authorization`` header value (and this
    ``x-api-key``) may reuse: a digest of its key (``request_key``), so requests under different keys never
    see each other's conversations; "" without a key (whether or not the coordinator has keys: a client
    may send one anyway)."""
    key = request_key(authorization, x_api_key)
    return "" if key is None else key_digest(key).hex()[:32]


def request_scope(headers: Mapping[str, str]) -> str:
    """``cache_scope`` of a request with these HTTP ``headers`` (its ``Authorization`` and ``x-api-key``):
    every API takes a key either way (``ApiKeys``), so every API's requests are scoped by both."""
    return cache_scope(headers.get("authorization"), headers.get("x-api-key"))


def key_given(scope: Scope) -> bool:
    """Whether the request of ``scope`` carried a valid API key, or the coordinator needs none."""
    return bool(scope.get("state", {}).get(KEY_SCOPE, True))


class ApiKeys:
    """ASGI middleware: requests to ``/v1`` and below, ``/api`` and below (Ollama's), ``/openapi.json`` and
    (unless ``public_metrics``) ``/metrics`` need ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) with one
    of ``keys``, else HTTP 401 with an OpenAI error body (``invalid_api_key``; Anthropic's
    ``authentication_error`` on its paths, Ollama's ``{"error": ...}`` on its own).
    Other paths pass, marked with whether they carried a valid key (``key_given``). Keys are compared as SHA-256 digests in constant time, against every key."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], public_metrics: bool = False) -> None:
        self.app = app
        self._digests = [key_digest(k) for k in keys]
        self.public_metrics = public_metrics

    def refusal(self, authorization: str | None, x_api_key: str | None = None) -> InvalidApiKey | None:
        """Why a request with this ``Authorization`` header value (and ``x-api-key``) is refused, or None
        when it may pass."""
        key = request_key(authorization, x_api_key)
        if key is None:
            return InvalidApiKey("this fleet requires an API key: send 'Authorization: Bearer KEY' or 'x-api-key: "
                                 "KEY' (fleet-chat --api-key, or the OpenAI or Anthropic client's api_key)")
        digest = key_digest(key)
        if not sum(hmac.compare_digest(digest, d) for d in self._digests):  # no early exit
            return InvalidApiKey("invalid API key")
        return None

    def guarded(self, path: str) -> bool:
        """Whether ``path`` needs a key."""
        return (path == "/v1" or path.startswith("/v1/") or ollama_path(path) or path == "/openapi.json"
                or (path == "/metrics" and not self.public_metrics))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", ())
            header = next((v for k, v in headers if k == b"authorization"), None)
            x_api_key = next((v for k, v in headers if k == b"x-api-key"), None)
            refused = self.refusal(header.decode("latin-1") if header is not None else None,
                                   x_api_key.decode("latin-1") if x_api_key is not None else None)
            path = scope.get("path", "")
            if refused is not None and self.guarded(path):
                exc = refused
                if anthropic_path(path):
                    response = anthropic_response(exc)
                elif ollama_path(path):
                    response = ollama_response(exc)
                else:
                    response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})[KEY_SCOPE] = refused is None
        await self.app(scope, receive, send)
