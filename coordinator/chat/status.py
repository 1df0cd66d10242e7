"""What fleet-chat shows while no token comes (coordinator/chat/client.py): one transient status line on stderr, the
coordinator's SSE comments (``: re-planning ...``, ``: replaying N tokens ...``) and a preparing fleet's progress
(its 503 ``fleet_preparing`` and ``/health``'s ``fleet`` entry)."""

from __future__ import annotations

import math
import re
import shutil
import sys
import time

import httpx

class StatusLine:
    """A transient status line on stderr (what the coordinator is doing while no token comes: preparing the
    fleet, re-planning, replaying a failed-over request): on a terminal one line rewritten in place and
    cleared by ``clear``; into a pipe or file, a line per new status (a status that differs only in its
    numbers, e.g. the seconds waited, at most every ``PIPE_EVERY_S``). Never written to stdout, so the
    answer's text stays as the model wrote it."""

    PIPE_EVERY_S = 10.0

    def __init__(self, stream=None) -> None:  # noqa: ANN001 - a text stream, default sys.stderr
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False  # a line is on the terminal
        self._last, self._last_t = "", -math.inf

    def show(self, text: str, mid_line: bool = False) -> None:
        """Show ``text`` (one line) as the status; ``mid_line``: the answer printed so far does not end its
        line (the status then starts on a line of its own)."""
        text = " ".join(text.split())
        if self.tty:
            width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
            lead = "\n" if mid_line and not self.shown else "\r\x1b[K"
            self.stream.write(f"{lead}{text[:width]}")
            self.stream.flush()
            self.shown = True
            return
        shape = re.sub(r"[0-9.]+", "#", text)
        if shape != self._last or time.monotonic() - self._last_t >= self.PIPE_EVERY_S:
            self._last, self._last_t = shape, time.monotonic()
            print(("\n" if mid_line and not self.shown else "") + text, file=self.stream, flush=True)
            self.shown = True

    def clear(self) -> None:
        """Remove the status from the terminal (tokens flow again); nothing to do in a pipe."""
        if self.shown and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self.shown, self._last = False, ""


def sse_status(line: str) -> str | None:
    """The status an SSE comment line of the coordinator carries (``: re-planning ...``, ``: replaying N tokens
    on a new pipeline``; ``: prefill i/n`` as ``prefill i/n``), or None for any other line."""
    if not line.startswith(":"):
        return None
    text = line[1:].strip()
    return text or None


PREPARING_CODES = ("fleet_preparing",)
"""503 codes of a coordinator that will serve soon (``serve --model SOURCE`` planning, building, shipping:
coordinator/api/preparing_page.py): fleet-chat waits, as their Retry-After says, instead of giving up."""


def preparing_status(response: httpx.Response) -> str | None:
    """What a coordinator that is preparing its fleet says it does (its 503 ``fleet_preparing`` body's message,
    without the advice to retry), or None when ``response`` is no such answer."""
    if response.status_code != 503:
        return None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict) or error.get("code") not in PREPARING_CODES:
        return None
    return re.sub(r":? *retry in a few seconds\.?$", "", str(error.get("message") or "preparing")).strip()


def health_progress(client: httpx.Client, url: str) -> str | None:
    """``/health``'s ``fleet`` progress of a preparing coordinator (``progress, N s so far; workers heard: ...``),
    or None when it does not say."""
    try:
        fleet = client.get(f"{url}/health", timeout=5.0).json().get("fleet") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(fleet, dict) or not fleet.get("progress"):
        return None
    line = f"{fleet['progress']}, {fleet.get('phase_s', 0):.0f} s so far"
    refused = [f"{c.get('address')}: {c.get('why')}" for c in fleet.get("candidates") or []
               if isinstance(c, dict) and c.get("why")]
    return line + (f"; not counted: {'; '.join(refused)}" if refused else "")


def retry_after(response: httpx.Response) -> float:
    """The response's Retry-After in seconds (a number; 5 when absent or a date), kept within 0.5..30 s."""
    try:
        return min(30.0, max(0.5, float(response.headers.get("retry-after", "5"))))
    except ValueError:
        return 5.0
