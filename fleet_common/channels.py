"""gRPC plumbing shared by the coordinator's pipelines (coordinator/engine/pipeline.py) and a worker's links to the
next stage (worker/links.py, worker/server.py): one cached channel per worker address, one writer per
bidirectional stream (a write at a time, within a deadline), and a gRPC failure put in words.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import grpc

from . import fleet_pb2_grpc as pb_grpc
from .security import Security, open_channel

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    """A failed call in words: ``CODE: details`` for a gRPC error, else the exception's repr."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


class StreamClosed(Exception):
    """A write on a stream failed: the stream is gone. ``str()`` says why (``CODE: details``)."""


class StreamWriter:
    """Writes messages on one gRPC stream (``call``: a stream-stream call) one at a time, as gRPC requires
    of a stream, each within a deadline."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self._lock = asyncio.Lock()

    async def write(self, message: object, timeout_s: float | None = None) -> None:
        """Write ``message`` once earlier writes are done; ``timeout_s`` bounds the wait and the write
        together (None: no bound of its own, e.g. inside the caller's deadline). Raises ``TimeoutError``
        when it is not written in time (the other end stopped reading) and ``StreamClosed`` when the
        stream failed or was closed."""
        try:
            if timeout_s is None:
                async with self._lock:
                    await self.call.write(message)
                return
            async with asyncio.timeout(timeout_s):
                async with self._lock:
                    await self.call.write(message)
        except grpc.aio.AioRpcError as exc:
            raise StreamClosed(describe(exc)) from exc
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # written after the call ended
            raise StreamClosed(f"UNAVAILABLE: the stream is closed ({exc!r})") from exc


class ChannelCache:
    """One gRPC channel (and ``Stage`` stub) per worker address, opened on first use, secured as ``security``
    says (default: ``Security()``, no secret and no TLS).

    ``max_channels`` bounds how many stay open (None: no bound): beyond it the least recently used one is
    closed, after ``on_evict(address)`` and once its calls end (within ``grace_s``)."""

    def __init__(self, security: Security | None = None, max_channels: int | None = None,
                 grace_s: float | None = None, on_evict: Callable[[str], None] | None = None) -> None:
        self.security = security if security is not None else Security()
        self.max_channels, self.grace_s, self.on_evict = max_channels, grace_s, on_evict
        self._stubs: OrderedDict[str, tuple[grpc.aio.Channel, pb_grpc.StageStub]] = OrderedDict()  # LRU first
        self.closing: set[asyncio.Task] = set()  # evicted channels still closing

    def stub(self, address: str) -> pb_grpc.StageStub:
        """The stub of the worker at ``address`` (host:port), its channel opened on first use."""
        entry = self._stubs.get(address)
        if entry is not None:
            self._stubs.move_to_end(address)
            return entry[1]
        channel = open_channel(address, self.security)
        entry = self._stubs[address] = (channel, pb_grpc.StageStub(channel))
        if self.max_channels is not None and len(self._stubs) > self.max_channels:
            evicted, (old, _) = self._stubs.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(evicted)
            task = asyncio.ensure_future(old.close(grace=self.grace_s))
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)
        return entry[1]

    def addresses(self) -> list[str]:
        """The addresses with an open channel, least recently used first."""
        return list(self._stubs)

    async def drop(self, address: str) -> None:
        """Close the channel to ``address``, if there is one (the next ``stub`` opens a new one)."""
        entry = self._stubs.pop(address, None)
        if entry is not None:
            await entry[0].close()

    async def close(self) -> None:
        """Close every channel now (evicted ones still closing too)."""
        for task in list(self.closing):
            task.cancel()
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
