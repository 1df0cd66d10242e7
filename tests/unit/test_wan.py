"""fleet-wan links on loopback: delay (with jitter, order kept), bandwidth cap, drops; every run is
bounded (socket timeouts) and ends by itself."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from pathlib import Path

import pytest

from bench.wan.links import LinkProfile, WanLink, load_config, main, profile


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


class _Sink(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        total = 0
        while data := self.request.recv(1 << 16):
            total += len(data)
        self.request.sendall(str(total).encode())


def _server(handler) -> tuple[socketserver.ThreadingTCPServer, str]:  # noqa: ANN001
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def echo():
    server, address = _server(_Echo)
    yield address
    server.shutdown()
    server.server_close()


def _connect(link: WanLink) -> socket.socket:
    sock = socket.create_connection((link.listen_host, link.listen_port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _round_trip_s(link: WanLink, payload: bytes = b"ping") -> float:
    with _connect(link) as sock:
        t0 = time.perf_counter()
        sock.sendall(payload)
        assert _recv_exactly(sock, len(payload)) == payload
        return time.perf_counter() - t0


def test_delay_adds_two_one_way_delays_per_round_trip(echo):
    link = WanLink(echo, LinkProfile(delay_ms=40)).start()
    try:
        rtts = [_round_trip_s(link) for _ in range(3)]
        assert all(0.080 <= r < 0.200 for r in rtts), rtts
        link.profile = LinkProfile()  # changed while running: new bytes follow the new profile
        assert _round_trip_s(link) < 0.040
    finally:
        link.stop()


def test_delay_does_not_serialise_messages_and_jitter_keeps_order(echo):
    link = WanLink(echo, LinkProfile(delay_ms=50, jitter_ms=20), seed=7).start()
    try:
        with _connect(link) as sock:
            t0 = time.perf_counter()
            messages = [f"message {i:03d};".encode() for i in range(50)]
            for m in messages:  # 50 messages sent 1 ms apart: a serialising proxy would take 50 x 100 ms
                sock.sendall(m)
                time.sleep(0.001)
            data = _recv_exactly(sock, sum(len(m) for m in messages))
            elapsed = time.perf_counter() - t0
        assert data == b"".join(messages), "bytes must come out in order despite the jitter"
        assert 0.060 <= elapsed < 0.6, elapsed
    finally:
        link.stop()


def test_bandwidth_cap():
    server, address = _server(_Sink)
    link = WanLink(address, LinkProfile(rate_mbit=8)).start()  # 1 MB/s
    try:
        payload = b"x" * 500_000
        with _connect(link) as sock:
            t0 = time.perf_counter()
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            assert int(_recv_exactly(sock, 6)) == len(payload)
            elapsed = time.perf_counter() - t0
        assert 0.45 <= elapsed < 1.5, f"500 kB at 8 Mbit/s should take ~0.5 s, took {elapsed:.2f} s"
    finally:
        link.stop()
        server.shutdown()
        server.server_close()


def test_drop_after_bytes_and_after_seconds(echo):
    link = WanLink(echo, LinkProfile(drop_after_bytes=100)).start()
    try:
        with _connect(link) as sock:
            sock.sendall(b"a" * 40)
            assert _recv_exactly(sock, 40) == b"a" * 40  # 80 bytes crossed so far
            sock.sendall(b"b" * 40)  # crosses the limit: the link dies
            deadline = time.monotonic() + 5
            with pytest.raises((ConnectionError, AssertionError, TimeoutError, OSError)):
                while time.monotonic() < deadline:
                    assert sock.recv(1 << 16)  # b"" (closed) or a reset ends it
        assert link.dropped == 1
        link.profile = LinkProfile(drop_after_s=0.3)
        with _connect(link) as sock:
            t0 = time.perf_counter()
            sock.sendall(b"hello")
            assert _recv_exactly(sock, 5) == b"hello"
            with pytest.raises((ConnectionError, AssertionError, OSError)):
                assert sock.recv(1 << 16)
            assert 0.25 <= time.perf_counter() - t0 < 3
    finally:
        link.stop()


def test_profiles_config_and_cli_errors(tmp_path: Path, capsys):
    assert profile("wan-50").delay_ms == 50 and profile("wan-50", delay_ms=10).delay_ms == 10
    with pytest.raises(ValueError, match="unknown link profile"):
        profile("moon")
    with pytest.raises(ValueError, match="jitter"):
        LinkProfile(delay_ms=1, jitter_ms=5)
    config = tmp_path / "links.toml"
    config.write_text('[[link]]\nlisten = "127.0.0.1:0"\ntarget = "127.0.0.1:1"\nprofile = "relay"\nrate_mbit = 2\n')
    (listen, target, p), = load_config(config)
    assert p.delay_ms == profile("relay").delay_ms and p.rate_mbit == 2
    assert main(["--link", "nonsense"]) == 2 and "expected LISTEN_HOST:PORT=TARGET_HOST:PORT" in capsys.readouterr().err
    assert main(["--list-profiles"]) == 0 and "wan-100" in capsys.readouterr().out
