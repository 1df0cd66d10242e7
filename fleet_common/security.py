"""Security of the links between roles: HMAC call tokens (``--secret``) and TLS (``--tls-cert``,
``--tls-key``, ``--tls-ca``), in one place for every role.

* With a secret, every gRPC call carries ``authorization: fleet-hmac <unix_ts>.<nonce>.<mac>`` in its
  metadata, ``mac`` = hex HMAC-SHA256(secret, ``method \\n ts \\n nonce``). A worker checks it in a
  server interceptor before any handler runs (constant-time compare, ``MAX_SKEW_S`` clock skew) and
  answers UNAUTHENTICATED otherwise, so a caller without the key never touches session state. The
  token proves the caller knows the key; it does not hide or sign the message: without TLS the
  traffic is readable and a captured token can be replayed within the skew window.
* With TLS, workers serve TLS (client certificates required when a CA is given: mutual TLS) and
  clients present their certificate and verify the worker's against the CA (or the system's roots).
  Certificates must name the host or IP the clients dial: there is no hostname override.

``open_channel`` (clients: the coordinator, a worker forwarding to the next stage) and
``open_server`` (workers) are the only places where fleet gRPC channels and ports are made.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from .wire import GRPC_OPTIONS

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
SCHEME = "fleet-hmac"
MAX_SKEW_S = 300
"""Largest difference between the caller's clock and the worker's that a token survives, seconds."""

_TOKEN = re.compile(rf"{SCHEME} (\d{{1,12}})\.([0-9A-Za-z_-]{{8,64}})\.([0-9a-f]{{64}})")
_LOG_EVERY_S = 10.0


class SecurityError(ValueError):
    """A secret, certificate or key file that cannot be used (unreadable, empty, not PEM, a key that
    does not match its certificate, half a TLS configuration)."""


class TokenError(ValueError):
    """A call's token is missing, malformed, too old or too new, or made with another secret."""


# -- tokens ------------------------------------------------------------------------------------
def _mac(secret: bytes, method: str, ts: str, nonce: str) -> str:
    return hmac.new(secret, f"{method}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def make_token(secret: bytes, method: str, now: float | None = None, nonce: str | None = None) -> str:
    """The ``authorization`` metadata value for one call of ``method`` (e.g. ``/fleet.v1.Stage/Forward``).

    ``now`` is a unix time in seconds (default: the clock), ``nonce`` 8-64 URL-safe characters (default:
    16 random hex digits)."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(8) if nonce is None else nonce
    return f"{SCHEME} {ts}.{nonce}.{_mac(secret, method, ts, nonce)}"


def check_token(secret: bytes, method: str, value: str | None, now: float | None = None,
                max_skew_s: float = MAX_SKEW_S) -> None:
    """Accept ``value`` (an ``authorization`` metadata value) for a call of ``method``, or raise
    ``TokenError`` saying why not. ``now`` is a unix time in seconds (default: the clock); a token
    whose time differs from it by more than ``max_skew_s`` seconds is refused."""
    if not value:
        raise TokenError("this worker requires a fleet token (it runs with --secret); the call carried none: "
                         "start the caller with the same --secret")
    m = _TOKEN.fullmatch(value)
    if m is None:
        raise TokenError(f"malformed fleet token: expected '{SCHEME} <unix_ts>.<nonce>.<hex HMAC-SHA256>'")
    ts, nonce, mac = m.groups()
    if not hmac.compare_digest(mac, _mac(secret, method, ts, nonce)):
        raise TokenError("wrong fleet token: the caller's --secret differs from this worker's")
    skew = int(ts) - (time.time() if now is None else now)
    if abs(skew) > max_skew_s:
        raise TokenError(f"fleet token is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} this worker's "
                         f"clock (limit {max_skew_s:.0f} s): synchronise the clocks (NTP)")


# -- configuration -----------------------------------------------------------------------------
def worker_proof(secret: bytes, challenge: str, worker_id: str) -> str:
    """A worker's answer to a coordinator's Info ``challenge``: hex HMAC-SHA256(secret, ``worker-proof \n
    challenge \n worker_id``). Call tokens prove the caller holds the secret; this proves the worker does, so a
    host on the LAN without it is never shipped a stage's weights nor sent anyone's hidden states. Bound to the
    worker's id: one relaying another worker's proof answers with that worker's id, which the coordinator then
    hears twice (a refused duplicate). Mutual TLS (``--tls-ca``) authenticates both ends by certificate."""
    return hmac.new(secret, f"worker-proof\n{challenge}\n{worker_id}".encode(), hashlib.sha256).hexdigest()


def _read(path: Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from exc
    if not data.strip():
        raise SecurityError(f"{flag} {path}: the file is empty")
    return data


def read_secret(path: Path) -> bytes:
    """The fleet secret in ``path``, surrounding whitespace stripped. Raises ``SecurityError`` when the
    file cannot be read or holds only whitespace."""
    return _read(path, "--secret").strip()


@dataclass(frozen=True)
class Security:
    """What one role uses on its fleet links. ``Security()`` is plaintext without tokens; build others
    with ``Security.load``. The file paths are kept to pass on to child workers (``cli_args``)."""

    secret_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    secret: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    ca_pem: bytes | None = field(default=None, repr=False)

    @classmethod
    def load(cls, secret_file: Path | None = None, tls_cert: Path | None = None, tls_key: Path | None = None,
             tls_ca: Path | None = None) -> Security:
        """Read and check the files. Raises ``SecurityError`` for an unreadable or empty file, a
        certificate or key that is not PEM or do not match, a CA that is not PEM, ``--tls-cert``
        without ``--tls-key`` (or the reverse) and ``--tls-ca`` without both."""
        if (tls_cert is None) != (tls_key is None):
            raise SecurityError("--tls-cert and --tls-key go together (this role's certificate and its private key)")
        if tls_ca is not None and tls_cert is None:
            raise SecurityError("--tls-ca needs --tls-cert and --tls-key (mutual TLS: every role has a certificate)")
        secret = read_secret(secret_file) if secret_file is not None else None
        cert = key = ca = None
        if tls_cert is not None:
            cert, key = _read(tls_cert, "--tls-cert"), _read(tls_key, "--tls-key")
            try:  # the standard library checks both are PEM and that the key belongs to the certificate
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(tls_cert, tls_key)
            except (ssl.SSLError, OSError) as exc:
                raise SecurityError(f"--tls-cert {tls_cert} / --tls-key {tls_key}: not a PEM certificate and its "
                                    f"unencrypted private key: {exc}") from exc
        if tls_ca is not None:
            ca = _read(tls_ca, "--tls-ca")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=ca.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise SecurityError(f"--tls-ca {tls_ca}: not a PEM CA certificate: {exc}") from exc
        return cls(secret_file, tls_cert, tls_key, tls_ca, secret, cert, key, ca)

    @property
    def tls(self) -> bool:
        return self.cert_pem is not None

    def challenge(self) -> str:
        """A fresh Info challenge (32 hex digits) when this role has a secret, else "" (nothing to prove)."""
        return secrets.token_hex(16) if self.secret else ""

    def prove(self, challenge: str, worker_id: str) -> str:
        """The worker's ``InfoReply.proof`` for ``challenge`` ("" without a secret or a challenge)."""
        return worker_proof(self.secret, challenge, worker_id) if self.secret and challenge else ""

    def proven(self, challenge: str, worker_id: str, proof: str) -> bool:
        """Whether a worker answering ``challenge`` as ``worker_id`` with ``proof`` holds this role's secret
        (always true without a secret: there is nothing to check)."""
        if not self.secret:
            return True
        return hmac.compare_digest(proof.encode(), worker_proof(self.secret, challenge, worker_id).encode())

    def describe(self) -> str:
        """For logs: ``HMAC tokens, mutual TLS``, ``plaintext, no authentication``, ..."""
        parts = ["HMAC tokens" if self.secret else "no authentication"]
        parts.append("plaintext" if not self.tls else "mutual TLS" if self.ca_pem else "TLS")
        return ", ".join(parts)

    def cli_args(self) -> list[str]:
        """The flags that give a child ``fleet-worker`` this configuration (paths, never the secret)."""
        args = []
        for flag, path in (("--secret", self.secret_file), ("--tls-cert", self.tls_cert),
                           ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path is not None:
                args += [flag, str(Path(path).resolve())]
        return args




# -- clients -----------------------------------------------------------------------------------
class _Refusals:
    """Logs why the worker at one address refused this role's credentials, at most once per status every
    ``_LOG_EVERY_S`` for that address (over every channel to it: a coordinator collecting empty workers opens one
    per round of Info calls), with the refusals left unlogged meanwhile counted in the next line."""

    _last: dict[tuple[str, str], tuple[float, int]] = {}  # (address, status) -> (last logged, refusals since)

    def __init__(self, address: str, tls: bool) -> None:
        self.address, self.tls = address, tls

    def done(self, call: grpc.aio.Call) -> None:
        """A call's done callback: look at its status (a coroutine in grpc.aio) on the loop."""
        if not call.cancelled():
            task = asyncio.get_running_loop().create_task(self._report(call))
            _reports.add(task)  # keep a reference until it ran
            task.add_done_callback(_reports.discard)

    async def _report(self, call: grpc.aio.Call) -> None:
        code = await call.code()
        details = await call.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            reason = f"worker {self.address} refused this caller's credentials: {details}"
        elif self.tls and code == grpc.StatusCode.UNAVAILABLE and re.search(
                r"ssl|tls|handshake|certificate|socket closed", details, re.IGNORECASE):
            # "Socket closed" is what a client sees when the worker refuses its certificate
            reason = (f"TLS with worker {self.address} failed: {details} (does it run with --tls-cert, were both "
                      f"certificates signed by the same --tls-ca, and does its certificate name that address?)")
        else:
            return
        key, now = (self.address, code.name), time.monotonic()
        last, unlogged = self._last.get(key, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._last[key] = (last, unlogged + 1)
            return
        self._last[key] = (now, 0)
        more = f" (and {unlogged} more refused calls since the last report)" if unlogged else ""
        log.error("%s%s", reason, more)


_reports: set[asyncio.Task] = set()


def _with_token(details: grpc.aio.ClientCallDetails, secret: bytes) -> grpc.aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(METADATA_KEY, make_token(secret, method))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _Token:
    """Adds the HMAC token (when there is a secret) and watches each call for refusals; gRPC wants
    one interceptor class per call kind, below."""

    def __init__(self, secret: bytes | None, refusals: _Refusals) -> None:
        self.secret, self.refusals = secret, refusals

    async def _intercept(self, continuation, client_call_details, request):  # noqa: ANN001, ANN202
        details = _with_token(client_call_details, self.secret) if self.secret else client_call_details
        call = await continuation(details, request)
        call.add_done_callback(self.refusals.done)
        return call


class _UnaryUnaryToken(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStreamToken(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnaryToken(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # noqa: ANN001, ANN201
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStreamToken(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # noqa: ANN001, ANN201
        return await self._intercept(continuation, client_call_details, request_iterator)


def open_channel(address: str, security: Security) -> grpc.aio.Channel:
    """A grpc.aio channel to the worker at ``address`` (host:port) with ``GRPC_OPTIONS``: TLS when
    ``security`` has a certificate (presented as the client certificate; the worker's is verified
    against ``--tls-ca``, else the system's roots, and must name ``host``), and an HMAC token on every
    call (unary, server-streaming, the ``Link`` stream and ``PutStage``'s client stream) when it has a
    secret. Refusals by the worker are logged."""
    interceptors = None
    if security.secret or security.tls:
        refusals = _Refusals(address, security.tls)
        interceptors = [_UnaryUnaryToken(security.secret, refusals), _UnaryStreamToken(security.secret, refusals),
                        _StreamUnaryToken(security.secret, refusals), _StreamStreamToken(security.secret, refusals)]
    if not security.tls:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(root_certificates=security.ca_pem, private_key=security.key_pem,
                                               certificate_chain=security.cert_pem)
    return grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS, interceptors=interceptors)


# -- servers -----------------------------------------------------------------------------------
class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid token before their handler runs (the request is not even parsed)."""

    def __init__(self, secret: bytes, on_reject: Callable[[], None] | None) -> None:
        self.secret, self.on_reject = secret, on_reject
        self._last_log, self._unlogged = -_LOG_EVERY_S, 0

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        value = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), None)
        try:
            check_token(self.secret, handler_call_details.method, value if isinstance(value, str) else None)
        except TokenError as exc:
            self._log(handler_call_details.method, str(exc))
            if self.on_reject is not None:
                self.on_reject()
            return _refusal(await continuation(handler_call_details), str(exc))
        return await continuation(handler_call_details)

    def _log(self, method: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_log < _LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more refused calls since the last report)" if self._unlogged else ""
        log.warning("refused %s: %s%s", method, reason, more)
        self._last_log, self._unlogged = now, 0


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED ``message`` to raw, unparsed bytes."""
    if handler is None:
        return None

    async def deny(_request, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN001
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(_request, context: grpc.aio.ServicerContext):  # noqa: ANN001, ANN202
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny_stream)


def open_server(address: str, security: Security,
                on_reject: Callable[[], None] | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with ``GRPC_OPTIONS`` bound at ``address`` (host:port; port 0 picks one);
    returns (server, bound port). With a secret it refuses calls without a valid token (calling
    ``on_reject()`` for each); with a certificate it serves TLS, requiring client certificates signed
    by ``--tls-ca`` when one is given. Raises ``RuntimeError`` when the address cannot be bound."""
    interceptors = [_TokenCheck(security.secret, on_reject)] if security.secret else None
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    if security.tls:
        credentials = grpc.ssl_server_credentials([(security.key_pem, security.cert_pem)],
                                                  root_certificates=security.ca_pem,
                                                  require_client_auth=security.ca_pem is not None)
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot bind {address}")
    return server, bound
