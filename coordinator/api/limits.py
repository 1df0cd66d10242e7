"""What one HTTP request may weigh before the coordinator does any work for it (issue 26 #1): a cap on
the body's bytes (HTTP 413, before the body is read when it declares its length), on the
messages of a chat request and on their content parts (checked before they are validated one by one),
and the bytes a prompt may have at most to fit the context, counting what the chat template adds per
message. Each keeps the work a request makes on the event loop (JSON parsing, validation) small and
bounded, whoever sends it."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .anthropic_errors import anthropic_path, error_body
from .ollama_errors import ollama_path
from ..tokenizer import ChatTokenizer

MAX_MESSAGES = 2048
"""Messages a chat request may hold: OpenAI's own cap. Each costs the chat template's tokens of its own
(5 for the demo model), so even this many empty messages need more than most contexts hold."""

MAX_CONTENT_PARTS = 4096
"""Content parts (``[{"type": "text", ...}]``) all the messages of a request may hold together."""

JSON_EXPANSION = 3
"""Body bytes allowed per prompt byte: a JSON encoder that escapes every non-ASCII character (Python's
default) writes a 3-byte CJK character as 6 bytes and a 4-byte emoji as 12."""

BODY_SLACK_BYTES = 1 << 20
"""Body bytes allowed beyond the prompt's: the fields around it (sampling, metadata, stop strings)."""


def token_byte_limit(tokenizer: ChatTokenizer) -> int:
    """The most UTF-8 bytes any one token of the vocabulary decodes to (special tokens spelt out).

    Byte-level BPE vocabularies store a byte as a character of two UTF-8 bytes (``Ġ`` for a space),
    so the stored spellings overstate it up to 2x; decoding each token alone gives its own bytes
    (a token ending inside a multi-byte character decodes to U+FFFD, 3 bytes: still a bound)."""
    tok = tokenizer.tokenizer
    size = tok.get_vocab_size(with_added_tokens=True)
    return max(len(tok.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(size))


def message_overhead_bytes(tokenizer: ChatTokenizer) -> int:
    """Bytes the chat template adds for each message beyond its content, at least (the smallest over the
    roles it accepts; 0 when it accepts no run of two empty messages or the model has no template)."""
    overheads = []
    for role in ("user", "assistant", "system", "developer", "tool"):
        message = {"role": role, "content": ""}
        try:
            one = tokenizer.render_chat([message], add_generation_prompt=False)
            two = tokenizer.render_chat([message, message], add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that refuses this role or the run: no bound from it
            continue
        overheads.append(max(0, len(two.encode("utf-8")) - len(one.encode("utf-8"))))
    return min(overheads, default=0)


def body_byte_limit(prompt_bytes: int) -> int:
    """The largest request body (bytes) a prompt of up to ``prompt_bytes`` bytes needs."""
    return JSON_EXPANSION * prompt_bytes + BODY_SLACK_BYTES


def count_messages(value: object) -> None:
    """Raise ``ValueError`` when a chat request's raw ``messages`` (before validation) hold more than
    ``MAX_MESSAGES`` messages or more than ``MAX_CONTENT_PARTS`` content parts in all."""
    if not isinstance(value, list):
        return
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"{len(value)} messages, more than the {MAX_MESSAGES} a request may hold; send fewer "
                         "(a conversation this long cannot fit the model's context anyway)")
    parts = sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"{parts} content parts, more than the {MAX_CONTENT_PARTS} a request may hold in all "
                         "its messages; join the text parts")


def _too_large(limit: int, size: int | None = None) -> str:
    said = f"is {size} bytes" if size is not None else "goes on"
    return (f"the request body {said}: more than the {limit} bytes this coordinator takes (a prompt that long "
            "could not fit the model's context); shorten the messages or the prompt")


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused with HTTP 413 and an OpenAI error
    body (code ``request_too_large``): at once when its ``Content-Length`` says so, before it is read;
    else once the bytes received pass the limit (a chunked body: the endpoint's read raises it as an
    ``HTTPException``, which FastAPI passes on to the app's handler). On the Anthropic API's paths the body
    is Anthropic's (``request_too_large``), on the Ollama API's Ollama's (``{"error": message}``). Starlette's own
    ``max_body_size`` answers a declared length in plain text, which OpenAI clients cannot read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            message = _too_large(limit, int(declared))
            path = scope.get("path", "")
            if anthropic_path(path):
                body = error_body(413, message)
            elif ollama_path(path):
                body = {"error": message}
            else:
                body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                  "code": "request_too_large"}}
            await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, _too_large(limit))
            return message

        await self.app(scope, counted, send)
