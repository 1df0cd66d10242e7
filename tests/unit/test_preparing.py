"""coordinator/api/preparing_page.py: while a planned fleet is prepared, its port answers /health (503, fleet.state
preparing), the page, and 503 with Retry-After elsewhere; once the work ends its socket, still listening, goes to
the API (a connection in between is answered, not refused); a failed preparation frees the port; a port in
use fails at once, before the work runs. Real uvicorn on loopback, real HTTP."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from coordinator.api.preparing_page import serving_while
from coordinator.fleet.local import free_port
from coordinator.fleet.preparing import Preparation
from coordinator.settings import CoordinatorSettings


def test_the_port_serves_the_preparation_then_is_free(tmp_path):
    port = free_port()
    settings = CoordinatorSettings(model=tmp_path, host="127.0.0.1", port=port)
    prep = Preparation("m.gguf")

    async def work() -> dict:
        prep.step("building layers 0:15,15:30 of m.gguf")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            health = await client.get("/health")
            api = await client.post("/v1/chat/completions", json={})
            page = await client.get("/")
        assert health.status_code == 503 and api.status_code == 503 and page.status_code == 200
        assert api.headers["retry-after"] == "5" and "building layers" in api.json()["error"]["message"]
        return health.json()

    health, listening = asyncio.run(serving_while(prep, settings, work()))
    assert health["fleet"]["state"] == "preparing" and health["fleet"]["progress"].startswith("building layers")
    # the preparing server has stopped, the port still listens: a client connecting now (the page's next
    # /health read) waits in the backlog and is answered by the API's server on the handed-over socket
    with listening, socket.create_connection(("127.0.0.1", port), timeout=5) as early:
        early.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        config = uvicorn.Config(_api_app(), log_level="warning")
        api = uvicorn.Server(config)

        async def answer() -> bytes:
            serving = asyncio.ensure_future(api.serve(sockets=[listening]))
            reply = await asyncio.to_thread(_read_until_closed, early)
            api.should_exit = True
            await serving
            return reply

        reply = asyncio.run(answer())
    assert reply.startswith(b"HTTP/1.1 200") and b'"api"' in reply, reply
    with socket.socket() as again:  # closed by the caller: the port is free
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def _read_until_closed(sock: socket.socket) -> bytes:
    """Every byte the server sends before it closes (the headers and the body may come in separate reads)."""
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    return reply


def _api_app():  # noqa: ANN202 - a FastAPI app
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/health")(lambda: {"api": True})
    return app


def test_a_failed_preparation_closes_the_port(tmp_path):
    port = free_port()
    settings = CoordinatorSettings(model=tmp_path, host="127.0.0.1", port=port)

    async def work() -> None:
        raise ValueError("no worker answered")

    with pytest.raises(ValueError, match="no worker answered"):
        asyncio.run(serving_while(Preparation("m.gguf"), settings, work()))
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen(1)


def test_a_port_in_use_fails_before_the_work_runs(tmp_path):
    ran = []

    async def work() -> None:
        ran.append(True)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        settings = CoordinatorSettings(model=tmp_path, host="127.0.0.1", port=taken.getsockname()[1])
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:\d+"):
            asyncio.run(serving_while(Preparation("m.gguf"), settings, work()))
    assert not ran
