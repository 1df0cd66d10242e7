"""Errors in the Anthropic Messages API's shape, for its paths only (``/v1/messages`` and below): the body
``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's error types and statuses
(https://docs.anthropic.com/en/api/errors). The OpenAI endpoints keep OpenAI's body (``errors.FleetError.body``).

| fleet's error | status | Anthropic type |
|---|---|---|
| a bad request, a field fleet does not implement, a prompt too long | 400 | ``invalid_request_error`` |
| no API key, a wrong one | 401 | ``authentication_error`` |
| a model not served here, an unknown path | 404 | ``not_found_error`` |
| a body over the cap | 413 | ``request_too_large`` |
| the queue is full, a prompt's preparation timed out (``Overloaded``, ``PromptTimeout``) | 529 | ``overloaded_error`` |
| no complete pipeline, a stage failed, shutting down | 503 | ``api_error`` |
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..errors import FleetError, Overloaded, PromptTimeout

ANTHROPIC_PATH = "/v1/messages"
OVERLOADED_STATUS = 529  # Anthropic's "API temporarily overloaded" (the client retries it, as a 429)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is the Anthropic API's (``/v1/messages``, ``/v1/messages/count_tokens``)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP ``status``: ``TYPES``, else ``invalid_request_error`` below 500
    and ``api_error`` from 500 on."""
    return TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict:
    """The Anthropic error body of ``status`` with ``message``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_status(exc: FleetError) -> int:
    """The status ``exc`` goes out with on the Anthropic paths: its own, but 529 for an overloaded fleet."""
    return OVERLOADED_STATUS if isinstance(exc, (Overloaded, PromptTimeout)) else exc.status


def anthropic_error(exc: FleetError) -> dict:
    """``exc`` as an Anthropic error body (also the data of a stream's ``error`` event)."""
    return error_body(error_status(exc), exc.one_line())


def anthropic_response(exc: FleetError) -> JSONResponse:
    """``exc`` as an Anthropic error response: its body, status and headers."""
    return JSONResponse(anthropic_error(exc), status_code=error_status(exc), headers=exc.headers)
