"""Errors in the Ollama API's shape, for its paths only (``/api`` and below): the body ``{"error": "message"}``
with the HTTP status (https://github.com/ollama/ollama/blob/main/docs/api.md; the ``ollama`` Python client
raises ``ResponseError(error, status_code)`` from it, and a streamed response's line ``{"error": ...}`` the
same). The status is fleet's own (``errors.FleetError.status``): 400 for a bad request or a field fleet does
not implement, 401 without a valid API key, 404 for a model not served here, 413, 429, 503. Ollama's body
has no field name, so the message names the field when it does not already."""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..errors import FleetError

OLLAMA_PATH = "/api"


def ollama_path(path: str) -> bool:
    """Whether ``path`` is the Ollama API's (``/api`` and below)."""
    return path == OLLAMA_PATH or path.startswith(OLLAMA_PATH + "/")


def ollama_error(exc: FleetError) -> dict:
    """``exc`` as an Ollama error body (also a streamed response's error line)."""
    return {"error": exc.one_line()}


def ollama_response(exc: FleetError) -> JSONResponse:
    """``exc`` as an Ollama error response: its body, its status and headers."""
    return JSONResponse(ollama_error(exc), status_code=exc.status, headers=exc.headers)
