"""coordinator/preparing.py: while a planned fleet is prepared, its port answers /health (503, fleet.state
preparing), the page, and 503 with Retry-After elsewhere; the port is free again once the work ends; a port in
use fails at once, before the work runs. Real uvicorn on loopback, real HTTP."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from coordinator.local import free_port
from coordinator.preparing import Preparation, serving_while
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

    health = asyncio.run(serving_while(prep, settings, work()))
    assert health["fleet"]["state"] == "preparing" and health["fleet"]["progress"].startswith("building layers")
    with socket.socket() as again:  # the API can take the port now
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


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
