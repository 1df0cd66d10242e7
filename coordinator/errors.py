"""Typed coordinator errors, each mapped once to an HTTP status and an OpenAI error body."""

from __future__ import annotations


class FleetError(Exception):
    """Base of errors a client may see; ``status``/``type``/``code`` fill the OpenAI error JSON."""

    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None  # extra HTTP response headers

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(FleetError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class InvalidApiKey(FleetError):
    """The API requires a key (``--api-key-file``) and the request had none, or another one."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}


class ModelNotFound(FleetError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Overloaded(FleetError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"


class PipelineUnavailable(FleetError):
    """No complete pipeline: some stage has no healthy worker."""

    status = 503
    type = "server_error"
    code = "pipeline_unavailable"


class StageFailure(FleetError):
    """A stage failed or timed out during a step; the request cannot continue."""

    status = 503
    type = "server_error"
    code = "stage_failure"
