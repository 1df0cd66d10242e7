"""Typed coordinator errors, each mapped once to an HTTP status and an OpenAI error body."""

from __future__ import annotations


MAX_TEXT = 2000
"""Characters of an error's message or detail a client gets: a worker's error text (which it chooses, 100 KB
were seen) is cut there."""


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_TEXT else f"{text[:MAX_TEXT]}... ({len(text) - MAX_TEXT:,} more characters)"


class FleetError(Exception):
    """Base of errors a client may see; ``status``/``type``/``code`` fill the OpenAI error JSON.

    ``message`` is one plain sentence for a person (what failed, where, what to do); ``detail`` holds
    the technical cause (a gRPC status, a socket error) for logs and for the body's ``detail`` field."""

    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None  # extra HTTP response headers

    def __init__(self, message: str, param: str | None = None, *, detail: str | None = None) -> None:
        message, detail = _bounded(message), None if detail is None else _bounded(detail)
        super().__init__(message)
        self.message = message
        self.param = param
        self.detail = detail

    def one_line(self) -> str:
        """The message naming its field (for error bodies with no ``param``: Anthropic's, Ollama's) and
        ending with the technical detail, if any."""
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return f"{message} ({self.detail})" if self.detail else message

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.detail:
            error["detail"] = self.detail
        return {"error": error}


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


class CopyRefused(Exception):
    """A stage cannot copy a retained session's prefix because its sliding-window layers no longer hold the
    end of it (fleet_common/runtime.py ``PrefixNotHeld``): the prompt is prefilled in full, the retained session
    stays for its own conversation. Never shown to a client."""


class PipelineUnavailable(FleetError):
    """No complete pipeline: some stage has no healthy worker."""

    status = 503
    type = "server_error"
    code = "pipeline_unavailable"


class StageFailure(FleetError):
    """A stage failed or timed out during a step; the request cannot continue. ``stage`` and
    ``address`` name the failed worker when known; ``summary`` says what happened without the advice
    that ends ``message`` (for messages that add their own)."""

    status = 503
    type = "server_error"
    code = "stage_failure"

    def __init__(self, message: str, param: str | None = None, *, detail: str | None = None,
                 stage: int | None = None, address: str | None = None, summary: str | None = None) -> None:
        super().__init__(message, param, detail=detail)
        self.stage, self.address, self.summary = stage, address, summary or message

    def again(self) -> StageFailure:
        """A fresh copy, to raise in another task (one exception object raised in many gathers tracebacks)."""
        return StageFailure(self.message, self.param, detail=self.detail, stage=self.stage, address=self.address,
                            summary=self.summary)


def stages_phrase(stages: list[int], num_stages: int) -> str:
    """Stage indices for a person, unambiguous about what the numbers are: ``stage 1 (of stages 0..2)``,
    ``stages 0, 2 (of stages 0..3)`` (a stage is named by its index from 0 everywhere: logs, /health, errors)."""
    names = f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(map(str, stages))
    return f"{names} (of stages 0..{num_stages - 1})"


def _retry_advice(stage: int) -> str:
    return (f"send the request again; if this keeps happening, look at that worker's log or restart it "
            f"(a static fleet's `fleet-worker --shard {stage}`; a fleet served from `serve --model SOURCE` re-plans "
            "around a worker that is gone)")


def stage_failed(stage: int, address: str, what: str, detail: str | None = None) -> StageFailure:
    """``StageFailure`` of the worker serving ``stage`` at ``address``, in plain words: ``what`` it
    failed (e.g. "a pipeline step"); the cause (gRPC status and details) goes to ``detail``."""
    summary = f"stage {stage} (worker {address}) failed {what}"
    return StageFailure(f"{summary}; {_retry_advice(stage)}", detail=detail, stage=stage, address=address,
                        summary=summary)


def stage_lost(stage: int, address: str, detail: str | None = None, how: str = "stopped answering") -> StageFailure:
    """``StageFailure`` of a worker that stopped answering (dead, unreachable) or lost its state (``how``)."""
    summary = f"stage {stage} (worker {address}) {how}"
    return StageFailure(f"{summary}; {_retry_advice(stage)}", detail=detail, stage=stage, address=address,
                        summary=summary)


class ShuttingDown(FleetError):
    """The coordinator is stopping (Ctrl-C, SIGTERM): it takes no new requests and ends running ones."""

    status = 503
    type = "server_error"
    code = "shutting_down"


class PromptTimeout(FleetError):
    """Templating and tokenizing a prompt took longer than its deadline (the coordinator is overloaded:
    the size checks before it keep any one prompt's work far below the deadline)."""

    status = 503
    type = "server_error"
    code = "prompt_timeout"


class ClientGone(FleetError):
    """The client disconnected before its answer was complete: the request ends (nobody reads this)."""

    status = 499  # nginx's "client closed request"
    type = "invalid_request_error"
    code = "client_closed_request"
