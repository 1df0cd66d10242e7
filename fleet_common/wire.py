"""Tensors on the wire: raw bytes + shape + dtype (``fleet.v1.Tensor``), and gRPC channel options."""

from __future__ import annotations

import numpy as np

from . import MAX_MESSAGE_BYTES
from .fleet_pb2 import Tensor

ALLOWED_DTYPES = frozenset({"int64", "int32", "float32", "float16"})

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect fast to a restarted worker instead of gRPC's default backoff of up to 2 minutes
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
"""Channel and server options used by every fleet role (size caps set on purpose, keepalive so a
dead peer is noticed while a call is idle)."""


class WireError(ValueError):
    """A tensor message that cannot be decoded (bad dtype, shape/byte-count mismatch, ...)."""


def to_tensor(array: np.ndarray) -> Tensor:
    """Encode ``array`` (any shape, dtype in ``ALLOWED_DTYPES``) as a little-endian C-order Tensor."""
    dtype = array.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise WireError(f"dtype {dtype} cannot travel on the wire; allowed: {sorted(ALLOWED_DTYPES)}")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return Tensor(data=data.tobytes(), shape=list(array.shape), dtype=dtype)


def from_tensor(msg: Tensor, *, dtype: str | None = None, ndim: int | None = None) -> np.ndarray:
    """Decode a Tensor into a read-only ndarray view of its bytes.

    ``dtype``/``ndim``, when given, are required to match. Raises ``WireError`` on an unknown dtype,
    a negative dimension, or a byte count that does not equal prod(shape) * itemsize.
    """
    if msg.dtype not in ALLOWED_DTYPES:
        raise WireError(f"unknown tensor dtype {msg.dtype!r}; allowed: {sorted(ALLOWED_DTYPES)}")
    if dtype is not None and msg.dtype != dtype:
        raise WireError(f"tensor dtype is {msg.dtype}, expected {dtype}")
    shape = tuple(int(d) for d in msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"tensor has shape {list(shape)}, expected {ndim} dimensions")
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {list(shape)} has a negative dimension")
    np_dtype = np.dtype(msg.dtype).newbyteorder("<")
    expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if len(msg.data) != expected:
        raise WireError(f"tensor of shape {list(shape)} {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    return np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)
