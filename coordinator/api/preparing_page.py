"""The coordinator's HTTP while ``serve --model SOURCE`` prepares its fleet (issue 30; what is being done is
coordinator/fleet/preparing.py's ``Preparation``): the API cannot serve before there is a build, so meanwhile a
small app on the same host and port serves the chat page, whose fleet panel shows what is being done, and
``/health`` with ``fleet.state`` ``preparing``, its progress and how long it has taken (503: not ready); every
other path answers 503 with that progress and ``Retry-After``. It stops once the fleet is ready, and the
coordinator's API serves on the same listening socket (no moment in which the port refuses a connection).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .http_guard import HostCheck, SignalFreeServer, served_host_names
from ..settings import CoordinatorSettings
from .web import add_web_routes

if TYPE_CHECKING:
    from ..fleet.preparing import Preparation

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_AFTER_S = 5


def preparing_app(prep: Preparation, settings: CoordinatorSettings) -> FastAPI:
    """The app served while ``prep`` runs: the chat page, ``/health`` (503, ``fleet`` from ``prep``) and a
    503 naming the progress for anything else (in the OpenAI error shape)."""
    app = FastAPI(title="fleet (preparing)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HostCheck, names=served_host_names(settings.host, settings.allowed_host))

    @app.get("/health")
    async def health() -> JSONResponse:
        fleet = prep.status()
        if settings.allowed_api_keys:  # as the API's /health: no worker addresses without a key
            fleet["workers"] = ["(hidden)"] * len(fleet["workers"])
            fleet["candidates"] = [{"address": "(hidden)", "counted": c["counted"],
                                    "why": c["why"] and "(hidden)"} for c in fleet["candidates"]]
        return JSONResponse({"ready": False, "shutting_down": False, "model": prep.source, "num_stages": 0,
                             "missing_stages": [], "queued": 0, "running": 0, "workers": [],
                             "fleet": fleet}, status_code=503)

    add_web_routes(app)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unavailable(path: str, request: Request) -> JSONResponse:
        message = (f"the fleet is being prepared ({prep.progress}, {prep.status()['phase_s']:.0f} s so far): "
                   f"retry in a few seconds")
        return JSONResponse({"error": {"message": message, "type": "server_error", "code": "fleet_preparing"}},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    return app


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (SO_REUSEADDR, as uvicorn's own). Raises ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def serving_while(prep: Preparation, settings: CoordinatorSettings,
                        work: Awaitable[T]) -> tuple[T, socket.socket]:
    """``work``'s result, with ``preparing_app`` served on ``settings.host``/``port`` while it runs, and the
    port's listening socket, still open, for the API's server (``uvicorn.Server.serve(sockets=[...])``): the
    preparing server stops before this returns, and a client that connects before the API serves waits in the
    socket's backlog instead of being refused (the page's next /health read lands on the API). The caller
    closes the socket. Raises ``OSError`` naming the address when it cannot be bound (before any of ``work``
    runs: a port in use fails at once, not after a build of minutes); whatever ``work`` raises, with the
    socket closed."""
    try:
        sock = _listen(settings.host, settings.port)
    except OSError as exc:
        if asyncio.iscoroutine(work):
            work.close()
        raise OSError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    config = uvicorn.Config(preparing_app(prep, settings), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1)
    server = SignalFreeServer(config)  # the coordinator's own signal handling stays
    # a duplicate descriptor: stopping this server closes it, and the port keeps listening on ``sock``
    task = asyncio.ensure_future(server.serve(sockets=[sock.dup()]))
    try:
        result = await work
    except BaseException:
        sock.close()
        raise
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.TimeoutError:
            log.warning("the preparing page did not stop in 10 s")
    return result, sock
