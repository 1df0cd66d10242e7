"""Tensors on the wire: raw bytes + shape + dtype (``fleet.v1.Tensor``), gRPC channel options, and
servicer registration that answers unparsable requests with INVALID_ARGUMENT."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from . import MAX_MESSAGE_BYTES
from .fleet_pb2 import Tensor

ALLOWED_DTYPES = frozenset({"int64", "int32", "float32", "float16"})
_LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # servers accept those keepalive pings (the default minimum of 5 minutes answered an idle link's
    # pings with GOAWAY "too_many_pings", seen on a worker after a restart)
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # reconnect fast to a restarted worker instead of gRPC's default backoff of up to 2 minutes
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
"""Channel and server options used by every fleet role (size caps set on purpose, keepalive so a
dead peer is noticed while a call is idle)."""


_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a ``host:port`` a stage may forward to (a DNS name or IPv4 address, or
    an IPv6 one in brackets, and a port in 1..65535), or None when it is one."""
    host, _, port = address.rpartition(":")
    if _HOST.fullmatch(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536:
        return None
    shown = repr(address) if len(address) <= 64 else repr(address[:64]) + f"... ({len(address)} characters)"
    return f"route address {shown} is not host:port"


class WireError(ValueError):
    """A tensor message that cannot be decoded (bad dtype, shape/byte-count mismatch, ...)."""


def to_tensor(array: np.ndarray) -> Tensor:
    """Encode ``array`` (any shape, dtype in ``ALLOWED_DTYPES``) as a little-endian C-order Tensor."""
    dtype = array.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise WireError(f"dtype {dtype} cannot travel on the wire; allowed: {sorted(ALLOWED_DTYPES)}")
    return Tensor(data=array.astype(_LITTLE_ENDIAN[dtype], order="C", copy=False).tobytes(), shape=array.shape,
                  dtype=dtype)


def from_tensor(msg: Tensor, *, dtype: str | None = None, ndim: int | None = None) -> np.ndarray:
    """Decode a Tensor into a read-only ndarray view of its bytes.

    ``dtype``/``ndim``, when given, are required to match. Raises ``WireError`` on an unknown dtype,
    a negative dimension, or a byte count that does not equal prod(shape) * itemsize.
    """
    if msg.dtype not in ALLOWED_DTYPES:
        raise WireError(f"unknown tensor dtype {msg.dtype!r}; allowed: {sorted(ALLOWED_DTYPES)}")
    if dtype is not None and msg.dtype != dtype:
        raise WireError(f"tensor dtype is {msg.dtype}, expected {dtype}")
    shape = tuple(msg.shape)  # protobuf int64s: Python ints
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"tensor has shape {list(shape)}, expected {ndim} dimensions")
    if shape and (min(shape) < 0 or max(shape) > MAX_MESSAGE_BYTES):
        if min(shape) < 0:
            raise WireError(f"tensor shape {list(shape)} has a negative dimension")
        # more elements than a message has bytes, even with a 0 beside
        raise WireError(f"tensor shape {list(shape)} has a dimension larger than a message can hold")
    np_dtype = _LITTLE_ENDIAN[msg.dtype]
    expected = math.prod(shape) * np_dtype.itemsize  # Python ints: no overflow
    if len(msg.data) != expected:
        raise WireError(f"tensor of shape {list(shape)} {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    return np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)


class Malformed:
    """Stands for a request whose bytes do not parse as the method's message (see ``add_servicer``)."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _lenient(handler: grpc.RpcMethodHandler | None,
             on_malformed: Callable[[], None] | None) -> grpc.RpcMethodHandler | None:
    """``handler`` (a grpc.aio method handler), answering INVALID_ARGUMENT to bytes that do not parse
    instead of gRPC's UNKNOWN "Unexpected DecodeError". A stream-request handler (``Link``) receives a
    ``Malformed`` in place of such a message and answers it itself."""
    if handler is None or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(exc)

    if handler.request_streaming:
        return handler._replace(request_deserializer=deserialize)

    async def refuse(request: Malformed, context: grpc.aio.ServicerContext) -> None:
        if on_malformed is not None:
            on_malformed()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")

    if handler.unary_unary is not None:
        behaviour = handler.unary_unary

        async def unary_unary(request, context):  # noqa: ANN001, ANN202
            if isinstance(request, Malformed):
                await refuse(request, context)
            return await behaviour(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
    behaviour = handler.unary_stream

    async def unary_stream(request, context):  # noqa: ANN001, ANN202
        if isinstance(request, Malformed):
            await refuse(request, context)
        async with contextlib.aclosing(behaviour(request, context)) as stream:
            async for item in stream:
                yield item

    return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)


class _GenericLenient(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, on_malformed: Callable[[], None] | None) -> None:
        self._inner, self._on_malformed = inner, on_malformed

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return _lenient(self._inner.service(handler_call_details), self._on_malformed)


class _LenientRegistrar:
    """What a generated ``add_XServicer_to_server`` sees as the server: it registers every handler
    wrapped by ``_lenient``."""

    def __init__(self, server: grpc.aio.Server, on_malformed: Callable[[], None] | None) -> None:
        self._server, self._on_malformed = server, on_malformed

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GenericLenient(h, self._on_malformed) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: _lenient(h, self._on_malformed) for name, h in handlers.items()})


def add_servicer(add_to_server: Callable[[object, object], None], servicer: object, server: grpc.aio.Server,
                 on_malformed: Callable[[], None] | None = None) -> None:
    """Register ``servicer`` on a grpc.aio ``server`` through its generated ``add_to_server``
    (e.g. ``add_StageServicer_to_server``), so that a request whose bytes do not parse as the
    method's message gets INVALID_ARGUMENT "malformed request: ..." (and ``on_malformed()`` is
    called) instead of grpc's UNKNOWN "Unexpected DecodeError" from its default deserialization.
    A stream-request method (``Link``) gets a ``Malformed`` in the stream for such a message."""
    add_to_server(servicer, _LenientRegistrar(server, on_malformed))
