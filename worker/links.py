"""A stage's streams to the next stage (``Link`` RPC): one long-lived bidirectional stream per address,
carrying every session's steps in order, with failures coming back as ``LinkAck`` messages.

A unary call per step per hop cost about 0.5 ms of CPU on each side (issue 17's measurements,
bench/pipeline/hop_overhead.py); a message on an open stream costs a fifth of that. What the unary chain gave
for free is kept explicitly:

* **errors name their stage**: a failure below is relayed up as ``stage N at ADDRESS: ...`` (nested,
  as the unary chain's abort details were), to the upstream that sent the session's last step;
* **deadlines**: each step carries what is left of its deadline (``timeout_ms``); a write that cannot
  complete in it (the next stage stopped reading) breaks the link;
* **a broken link is reported**: every upstream that forwarded through it gets an ack with no session
  ("the link below broke"), so its steps fail now rather than at their deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.channels import StreamClosed, StreamWriter, describe

log = logging.getLogger(__name__)

Upstream = asyncio.Queue  # the LinkAck queue of one upstream stream (its handler yields what is put there)


class LinkBroken(Exception):
    """The stream to the next stage at an address is gone; ``str()`` says why (gRPC status and details)."""


class Downlink:
    """The stream from this stage to one next-stage address. ``relay(ack)`` is called for each failure
    the next stage reports; ``on_broken(downlink, reason)`` once when the stream ends or fails."""

    def __init__(self, address: str, stub: pb_grpc.StageStub,
                 relay: Callable[[Downlink, pb.LinkAck], None],
                 on_broken: Callable[[Downlink, str], None]) -> None:
        self.address = address
        self.upstreams: set[Upstream] = set()  # upstreams that forwarded through this link (told if it breaks)
        self.broken: str | None = None
        self.closing = False  # close() was called: the stream's end is expected, not a broken link
        self._relay, self._on_broken = relay, on_broken
        self._link = StreamWriter(stub.Link())
        self._reader = asyncio.ensure_future(self._read())

    async def send(self, request: pb.ForwardRequest, timeout_s: float) -> None:
        """Write ``request`` on the stream within ``timeout_s``. Raises ``LinkBroken`` if the link is
        broken or breaks (the write timed out: the next stage is not reading)."""
        if self.broken:
            raise LinkBroken(self.broken)
        try:
            await self._link.write(request, timeout_s)
        except TimeoutError:
            self._break(f"DEADLINE_EXCEEDED: a step could not be written in {timeout_s:.1f} s (it stopped reading)")
            raise LinkBroken(self.broken) from None
        except StreamClosed as exc:
            self._break(str(exc))
            raise LinkBroken(self.broken) from None

    async def _read(self) -> None:
        """Relay each ack the next stage sends; break the link when its stream ends, fails or is closed."""
        try:
            async for ack in self._link.call:
                self._relay(self, ack)
            reason = "UNAVAILABLE: the stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = describe(exc)
        except asyncio.CancelledError:
            reason = "CANCELLED: the link was closed"
        self._break(reason)

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self._link.call.cancel()
            if self.closing:  # this stage closed it (a reload, a shutdown): expected
                log.info("link to the next stage at %s closed", self.address)
            else:
                log.warning("link to the next stage at %s broke: %s", self.address, reason)
            self._on_broken(self, reason)

    async def close(self) -> None:
        """End the stream and stop its reader (logged as closed, not as broken)."""
        self.closing = True
        self._link.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

