"""Shared CLI plumbing: one-line errors for bad settings, and a task dump for stuck processes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import signal

from pydantic import ValidationError


def describe_validation_error(exc: ValidationError, skip: tuple[str, ...] = ()) -> str:
    """``--port: Input should be less than or equal to 65535; --shard: Field required`` for a settings error
    (an error of the whole settings, from a model validator, is given by its message alone)."""
    parts = []
    for err in exc.errors():
        name = "-".join(str(p) for p in err.get("loc", ()) if isinstance(p, str) and p not in skip).replace("_", "-")
        msg = err.get("msg", "invalid value")
        parts.append(f"--{name}: {msg}" if name else msg.removeprefix("Value error, "))  # no name: a whole-model check
    return "; ".join(parts) or str(exc)


def dump_tasks_on_signal(signum: int = signal.SIGUSR1) -> None:
    """On ``signum`` (default SIGUSR1: ``kill -USR1 PID``), log every asyncio task of the running loop
    with the stack it is suspended in: what each request is waiting for when a process seems stuck
    (py-spy shows threads, not coroutines). Call from inside the loop; a no-op where signals are not
    supported (Windows)."""
    loop = asyncio.get_running_loop()

    def dump() -> None:
        out = io.StringIO()
        tasks = asyncio.all_tasks(loop)
        out.write(f"{len(tasks)} asyncio tasks:\n")
        for task in sorted(tasks, key=lambda t: t.get_name()):
            out.write(f"task {task.get_name()}:\n")
            for line in awaiting(task.get_coro()):
                out.write(f"  {line}\n")
        logging.getLogger("fleet.tasks").warning("%s", out.getvalue())

    with contextlib.suppress(NotImplementedError, AttributeError):
        loop.add_signal_handler(signum, dump)


def awaiting(coro, depth: int = 40) -> list[str]:  # noqa: ANN001
    """``file:line in function`` down the chain of awaits of a suspended coroutine, outermost first
    (``Task.get_stack`` shows only the outermost frame), ending with what the innermost one awaits."""
    lines = []
    while coro is not None and depth:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(repr(coro)[:200])
            break
        ids = [f"{k}={v}" for k in ("session", "session_id") if isinstance(v := frame.f_locals.get(k), str)]
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name} {' '.join(ids)}".rstrip())
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
        if type(coro).__name__ in ("async_generator_asend", "async_generator_athrow"):  # into the generator
            coro = next((r for r in gc.get_referents(coro) if hasattr(r, "ag_frame")), coro)
        depth -= 1
    return lines
