"""Turning settings validation errors into one-line CLI errors (no tracebacks for bad flags)."""

from __future__ import annotations

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
