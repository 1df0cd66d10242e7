"""A request's prompt as token ids, prepared off the event loop (issue 26 #1).

First the checks that need no tokenizer, on the event loop: the prompt's UTF-8 bytes, counting for a chat
what its template adds per message at least, against what ``max_context`` tokens can hold (no token stands
for more bytes than the longest the vocabulary decodes to). Then the chat template and the tokenizer run on
a small thread pool of their own, within a deadline: a heavy prompt never holds the event loop, so every
stream, ``/health`` and the workers' session leases (renewed by health checks) go on meanwhile. Large
preparations hand their freed heap back to the OS (glibc ``malloc_trim``), so the coordinator's RSS comes
back to its baseline after them.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import ContextLengthExceeded, InvalidRequest, Overloaded, PromptTimeout
from .limits import body_byte_limit, message_overhead_bytes, token_byte_limit
from ..tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

PREPARE_DEADLINE_S = 10.0
"""Longest a prompt may take to template and tokenize, its wait for a thread included. The heaviest prompt
the size checks let through (663 KB for the demo model at 8,192 tokens) takes 0.2-0.5 s on this machine."""

PREPARE_THREADS = 2
MAX_PREPARING = 64
"""Prompts being prepared or waiting for a thread at once; more get HTTP 429."""

TRIM_AFTER_BYTES = 64 * 1024
"""A prompt this long or longer gets the heap its tokenizing freed handed back to the OS afterwards."""


def _malloc_trim() -> Callable[[], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


class PromptPreparer:
    """Size checks, then templating and tokenizing on ``threads`` threads within ``deadline_s`` seconds.

    ``byte_limit``: prompt bytes (chat: content plus ``message_overhead`` per message) beyond which a
    prompt cannot fit ``max_context`` tokens; ``body_limit``: the request body bytes such a prompt needs."""

    def __init__(self, tokenizer: ChatTokenizer, max_context: int, deadline_s: float = PREPARE_DEADLINE_S,
                 threads: int = PREPARE_THREADS, max_pending: int = MAX_PREPARING) -> None:
        self.tokenizer, self.max_context, self.deadline_s = tokenizer, max_context, deadline_s
        self.byte_limit = max_context * token_byte_limit(tokenizer)
        self.message_overhead = message_overhead_bytes(tokenizer)
        self.body_limit = body_byte_limit(self.byte_limit)
        self.max_pending, self.pending = max_pending, 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fleet-prompt")
        log.info("prompts: at most %d bytes (%d per message for the chat template), bodies of %d bytes; "
                 "prepared on %d threads within %.0f s", self.byte_limit, self.message_overhead, self.body_limit,
                 threads, deadline_s)

    def close(self) -> None:
        """Stop the threads (a preparation running finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_bytes(self, size: int, what: str, param: str) -> None:
        """Raise ``ContextLengthExceeded`` (naming the request field ``param``) when a prompt of ``size``
        UTF-8 bytes (for a chat: counting the template's bytes per message) exceeds ``byte_limit``: then
        it cannot fit ``max_context`` tokens. ``what``: the prompt as the message names it, with its verb
        ("prompt is")."""
        if size > self.byte_limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_context} tokens. However, your {what} {size} "
                f"bytes long, more than {self.max_context} tokens can hold ({self.byte_limit} bytes). Please "
                f"reduce the length of the {param}.", param=param)

    def check_chat(self, messages: list[dict], extra: int = 0) -> None:
        """``check_bytes`` for ``messages`` (``content`` strings): their UTF-8 bytes plus the template's
        ``message_overhead`` per message, plus ``extra`` (tools and calls outside the contents)."""
        size = sum(len(m["content"].encode("utf-8")) for m in messages) + self.message_overhead * len(messages) \
            + extra
        each = self.message_overhead
        overhead = f" (with the chat template's {each} bytes per message)" if each else ""
        self.check_bytes(size, f"{len(messages)} messages are{overhead}", "messages")

    async def chat(self, messages: list[dict], variables: dict | None = None, extra: int = 0) -> list[int]:
        """Token ids of ``messages`` through the chat template (``check_chat`` first, with ``extra`` bytes);
        ``variables``: more for the template (``tools=``: ``tools.render_messages``). Raises
        ``ContextLengthExceeded``, ``InvalidRequest`` (the template refused them), ``Overloaded`` (too
        many prompts in preparation) or ``PromptTimeout``."""
        self.check_chat(messages, extra)
        size = sum(len(m["content"]) for m in messages) + extra
        variables = variables or {}
        return await self._run(lambda: self._ids(self.tokenizer.render_chat(messages, **variables), special=False),
                               size)

    async def text(self, prompt: str) -> list[int]:
        """Token ids of a raw prompt (legacy completions: no template; special tokens the tokenizer's
        post-processor adds, such as a BOS, are added, as transformers' ``tokenizer(prompt)`` does). Raises
        ``InvalidRequest`` (not Unicode, or no token), ``ContextLengthExceeded``, ``Overloaded``,
        ``PromptTimeout``."""
        try:
            size = len(prompt.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"prompt is not valid Unicode: a lone surrogate at character {exc.start}",
                                 param="prompt") from None
        self.check_bytes(size, "prompt is", "prompt")
        ids = await self._run(lambda: self._ids(prompt, special=True), size)
        if not ids:
            raise InvalidRequest("prompt is empty: give at least one token", param="prompt")
        return ids

    async def completion(self, prompt: str | list[int], vocab_size: int) -> list[int]:
        """A legacy completion's prompt as token ids: a string through ``text`` (no chat template); token
        ids as they are, each of which must be below ``vocab_size`` (the model's vocabulary). Raises
        ``InvalidRequest`` for an id outside it, and what ``text`` raises."""
        if isinstance(prompt, str):
            return await self.text(prompt)
        if (bad := next((t for t in prompt if not 0 <= t < vocab_size), None)) is not None:
            raise InvalidRequest(f"prompt token id {bad} is not in the model's vocabulary (0 to {vocab_size - 1})",
                                 param="prompt")
        return list(prompt)

    def _ids(self, text: str, special: bool) -> list[int]:
        """``text``'s token ids (``special``: with what the post-processor adds), as ``ChatTokenizer.encode``
        gives them but without the offsets it computes (half the time and the memory of a long prompt)."""
        return self.tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids

    async def _run(self, work: Callable[[], list[int]], size: int) -> list[int]:
        """``work()`` on the pool within the deadline; ``size``: the prompt's characters (trims after large ones)."""
        if self.pending >= self.max_pending:
            raise Overloaded(f"{self.pending} prompts are being prepared (templated and tokenized); retry shortly")
        loop = asyncio.get_running_loop()

        def run() -> list[int]:
            try:
                return list(work())
            finally:
                if size >= TRIM_AFTER_BYTES and _TRIM is not None:
                    _TRIM(0)

        self.pending += 1
        future = self._pool.submit(run)
        future.add_done_callback(lambda _: self._done_from_thread(loop))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except TimeoutError:
            raise PromptTimeout(f"preparing the prompt (chat template and tokenizer) took longer than "
                                f"{self.deadline_s:.0f} s: the coordinator is overloaded; retry shortly") from None

    def _done_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._done)
        except RuntimeError:  # the loop closed meanwhile (shutdown)
            pass

    def _done(self) -> None:
        self.pending -= 1
