"""Code shared by the compiler, worker and coordinator: wire codec, manifest schema, discovery names.

The three roles import this package and never each other's internals.
"""

PROTOCOL_VERSION = 5  # 5: ForwardRequest.token_mask (grammar-constrained decoding)
"""Wire protocol version; a worker and a coordinator talk only when theirs are equal."""

SERVICE_TYPE = "_fleet._tcp.local."
"""zeroconf (mDNS/DNS-SD) service type that workers announce and the coordinator browses."""

API_SERVICE_TYPE = "_fleet-api._tcp.local."
"""zeroconf service type of a coordinator's OpenAI-compatible HTTP API (found by ``fleet-chat``)."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""gRPC send/receive cap on every fleet channel and server (prefill is chunked far below it)."""
