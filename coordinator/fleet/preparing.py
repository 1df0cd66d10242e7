"""The coordinator's HTTP while ``serve --model SOURCE`` prepares its fleet (issue 30): collecting the empty
workers, planning, building and shipping take from seconds to minutes (a 1B model over 100 Mbit/s: about
100 s), and the API cannot serve before there is a build. Meanwhile a small app on the same host and port
serves the chat page, whose fleet panel shows what is being done, and ``/health`` with ``fleet.state``
``preparing``, its progress and how long it has taken (503: not ready); every other path answers 503 with that
progress and ``Retry-After``. It stops once the fleet is ready, and the coordinator's API serves on the same
listening socket (no moment in which the port refuses a connection).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..api.http_guard import HostCheck, SignalFreeServer, served_host_names
from ..settings import CoordinatorSettings
from ..api.web import add_web_routes

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_AFTER_S = 5


class Preparation:
    """What the coordinator does now while it prepares a planned fleet: ``step`` starts a phase
    (``progress``), ``progress`` may be refined within it (bytes shipped); ``status()`` is ``/health``'s
    ``fleet`` entry in the shape of coordinator/fleet/replan.py ``Replanner.status``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.progress = "starting"
        self.layers = ""
        self.workers: list[str] = []
        self.candidates: list[dict] = []  # while collecting: every worker address asked, counted or why not
        self._t0 = time.monotonic()

    def heard(self, found: dict, why: list[str]) -> None:
        """A round of Info calls while collecting (planned.collect_capacities' ``on_round``): ``found``
        (worker id -> (address, capacity)) are counted, each line of ``why`` (``ADDRESS: reason``) names one that
        is not (unreachable, refusing this coordinator's --secret, a static worker, another fleet's)."""
        self.workers = sorted(address for address, _ in found.values())
        counted = [{"address": a, "worker_id": w, "counted": True, "why": None}
                   for w, (a, _) in sorted(found.items(), key=lambda item: item[1][0])]
        refused = [{"address": line.split(": ", 1)[0], "worker_id": None, "counted": False,
                    "why": line.split(": ", 1)[-1]} for line in why]
        self.candidates = counted + refused

    def step(self, progress: str) -> None:
        """A new phase (collecting, planning, building, shipping stage i, loading), logged."""
        log.info("preparing the fleet: %s", progress)
        self.progress = progress

    def status(self) -> dict:
        """``/health``'s ``fleet`` entry: state ``preparing``, the progress, seconds since the start."""
        return {"state": "preparing", "progress": self.progress, "reason": f"serve --model {self.source}",
                "phase_s": round(time.monotonic() - self._t0, 1), "layers": self.layers,
                "workers": list(self.workers), "candidates": [dict(c) for c in self.candidates], "replans": 0,
                "last_replan_s": None}


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
