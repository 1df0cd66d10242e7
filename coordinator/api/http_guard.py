"""What the coordinator's HTTP server does about clients that never finish a request, and about requests
for a host name it does not serve (DNS rebinding).

``guarded_protocol`` makes uvicorn's h11 protocol class bound a connection's life before its request is
complete: its headers must arrive within ``header_timeout_s`` of the connection opening (or of the first
byte of its next request), its body within ``body_timeout_s`` of its headers, and one client address
may hold at most ``max_per_client`` connections at once. uvicorn's own ``timeout_keep_alive`` closes a
connection idle after an answer. (uvicorn has no header or body timeout of its own: 200 idle sockets,
200 with half their headers and 200 with half their bodies were all still open after 40 s.)

``HostCheck`` refuses a request whose ``Host`` header names a host the coordinator does not serve, so
a web page whose DNS name was rebound to this machine's address cannot use the API through its
visitor's browser. An IP literal is always accepted: a browser sends one only to the address it names,
so the page's origin is then the coordinator itself and the same-origin rule holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style error body that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


@dataclass
class ConnectionLimits:
    """Bounds on connections that have not finished their request; shared by all connections of a server."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_per_client: int = 64  # 0: no cap
    open: Counter = field(default_factory=Counter)  # client address -> connections open now
    warned_at: float = float("-inf")  # loop time of the last refusal logged


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a per-client connection cap
    (``limits``, set on the class ``guarded_protocol`` makes)."""

    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection against its client's cap (refused with a 429 beyond it) and start the
        header deadline."""
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""
        self._counted: str | None = None
        self._refused = False
        address = self.client[0] if self.client else "?"
        cap = self.limits.max_per_client
        if cap and self.limits.open[address] >= cap:
            now = self.loop.time()
            if now - self.limits.warned_at >= 10:  # a flood of connections logs a line per 10 s, not per connection
                self.limits.warned_at = now
                log.warning("refused a connection from %s: it already has %d open (--max-connections-per-client)",
                            address, cap)
            transport.write(_raw_error(429, "Too Many Requests", f"this client already has {cap} connections "
                                       "open to the coordinator (--max-connections-per-client)",
                                       "too_many_connections"))
            self._refused = True
            transport.close()
            return
        self.limits.open[address] += 1
        self._counted = address
        self._arm("headers", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        """Release the client's count and the deadline."""
        self._disarm()
        if self._counted is not None:
            self.limits.open[self._counted] -= 1
            if self.limits.open[self._counted] <= 0:
                del self.limits.open[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Start the header deadline on a new request's first byte; move to the body deadline once the
        headers are in, and drop it once the request is complete."""
        if self._refused:
            return
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm("headers", self.limits.header_timeout_s)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.limits.body_timeout_s)
        elif state is not h11.IDLE:
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline, self._phase = None, ""
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        answered = cycle is not None and cycle.response_started
        if not answered and (phase == "body" or self.conn.their_state is not h11.IDLE
                             or self.conn.trailing_data[0]):
            what = "body" if phase == "body" else "headers"
            self.transport.write(_raw_error(408, "Request Timeout", f"the request's {what} did not arrive "
                                            f"within {seconds:g} s", "request_timeout"))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's next receive() is a disconnect, its sends are dropped
            cycle.message_event.set()
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def _host_name(header: str) -> str:
    """The host of a ``Host`` header value, lower case, without port, brackets or a final dot."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def served_host_names(bind_host: str, extra: Iterable[str] = ()) -> list[str]:
    """The host names a coordinator bound to ``bind_host`` answers to: ``localhost``, this machine's
    host name (also with ``.local``, as mDNS names it) and fully qualified name, ``bind_host`` when it is
    a name, and ``extra`` (``--allowed-host``: names, ``*.example.com`` for a domain's subdomains, ``*``
    for any). IP literals are accepted besides these (``HostCheck``)."""
    names = ["localhost"]
    hostname = socket.gethostname().lower()
    if hostname:
        names += [hostname, f"{hostname.partition('.')[0]}.local"]
    try:
        names.append(socket.getfqdn().lower())
    except OSError:
        pass
    if bind_host and bind_host not in ("0.0.0.0", "::") and not _is_ip(bind_host.strip("[]")):
        names.append(bind_host.lower())
    names += [e.strip().lower().rstrip(".") for e in extra if e.strip()]
    return list(dict.fromkeys(n for n in names if n))


class HostCheck:
    """ASGI middleware: an HTTP request whose ``Host`` header is neither an IP literal nor one of
    ``names`` (see ``served_host_names``) gets HTTP 400 with an OpenAI error body (``invalid_host``)
    naming ``--allowed-host``. A request without ``Host`` (HTTP/1.0) passes: browsers always send one."""

    def __init__(self, app: ASGIApp, names: Iterable[str]) -> None:
        self.app = app
        names = list(names)
        self.any = "*" in names
        self.exact = {n for n in names if not n.startswith("*.")}
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))

    def allows(self, header: str) -> bool:
        """Whether a request with this ``Host`` header value may pass."""
        host = _host_name(header)
        return (self.any or host in self.exact or _is_ip(host)
                or (bool(self.suffixes) and host.endswith(self.suffixes)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
            if header is not None and not self.allows(text := header.decode("latin-1")):
                await _refuse_host(text, send)
                return
        await self.app(scope, receive, send)


async def _refuse_host(host: str, send: Send) -> None:
    shown = host if len(host) <= 100 else host[:100] + "..."
    body = json.dumps({"error": {
        "message": f"Host {shown!r} is not a name this coordinator serves (a guard against DNS rebinding): use "
                   "its address, or start it with --allowed-host NAME to accept that name",
        "type": "invalid_request_error", "param": None, "code": "invalid_host"}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its own signal handling: ``_Shutdown`` decides how the coordinator
    stops. (uvicorn re-raises a caught signal once it has stopped, which turned every Ctrl-C into a
    KeyboardInterrupt traceback and exit status 130, and waited for every stream to end by itself.)"""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201
        yield
