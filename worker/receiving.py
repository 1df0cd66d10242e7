"""An empty worker's progress bars while it receives a stage (issue 30): one rich bar per file being written
into its stage cache, from the bytes it held to the file's size, with the rate.

The bars are drawn while at least one file is being received and removed when none is (a worker serves for
days: no display stays open between transfers). On a terminal they redraw in place; into a log file (not a
terminal) rich prints each bar's last state once, when the display closes: one line per file with the bytes
received of its size.
"""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

from fleet_common.console import bar_console


class ReceiveBars:
    """The bars of the files a worker is receiving, by key (``<build sha256>/<path>``). Thread-safe (the
    worker updates it from its event loop; rich redraws from its own thread)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or bar_console(stderr=True)  # into a log file: wide, not wrapped at 80 columns
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def update(self, key: str, label: str, done: int, total: int) -> None:
        """Show ``done`` of ``total`` bytes (the file's size) of the file ``key``, titled ``label`` (its bar is
        opened at the first call, and the display with it when no bar was open)."""
        with self._lock:
            if self._progress is None:
                self._progress = Progress(TextColumn("receiving {task.description}"), BarColumn(), DownloadColumn(),
                                          TransferSpeedColumn(), console=self.console)
                self._progress.start()
            if key not in self._tasks:
                self._tasks[key] = self._progress.add_task(label, total=total, completed=done)
            self._progress.update(self._tasks[key], completed=done, total=total)

    @property
    def active(self) -> bool:
        """Whether a bar is shown (a file is being received)."""
        return self._progress is not None or bool(self._tasks)

    def end(self, key: str) -> None:
        """The file ``key`` is no longer being received (complete, or its call ended): its bar's last state is
        kept on screen; the display closes once no file is received."""
        with self._lock:
            if self._tasks.pop(key, None) is not None and not self._tasks and self._progress is not None:
                self._progress.stop()
                self._progress = None
