"""The rich console progress bars are drawn on: the terminal's, or, into a log file or pipe (``nohup``, a
service's journal), a wide one, since rich wraps a non-terminal's lines at 80 columns and a bar's label (a
stage's file path, an address) then breaks over several lines of the log."""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = 160  # columns of a bar's line written into a log (not a terminal)


def bar_console(stderr: bool = False) -> Console:
    """A rich ``Console`` on stderr (``stderr``) or stdout: as rich makes it on a terminal, ``LOG_WIDTH`` wide
    otherwise."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)
