"""The browser chat page: ``GET /`` and its static files (``coordinator/api/static``), and the addresses
``fleet-coordinator serve`` prints for it.

The page is HTML, CSS and ES modules (no build step, nothing fetched from the internet; its one
third-party file, markdown-it, is vendored in ``static/vendor``), so it works on a LAN without one. It calls
the same API as any client: ``/v1/models``, ``/v1/chat/completions`` (streamed) and ``/health``; ``/v1/*``
needs the API key when the coordinator has keys, the page and its files do not (they hold no secret), so the
key middleware leaves them alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")

# The page renders model output as HTML (markdown-it with raw HTML escaped and links limited to http(s) and
# mailto, static/markdown.js): this policy is a second line of defence, so an escaping bug could still not run
# a script or send the conversation elsewhere.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def add_web_routes(app: FastAPI) -> None:
    """Serve the chat page at ``/`` and its files under ``/static/`` (index.html, style.css, the ES modules
    app.js, sse.js, conversation.js, request.js, tools.js, markdown.js, messages.js, fleet.js, fleet_state.js, dom.js, and the vendored
    vendor/markdown-it.esm.min.js). Raises ``FileNotFoundError`` when the package was installed without them."""
    index = STATIC / "index.html"
    if not index.is_file():
        raise FileNotFoundError(f"the chat page is missing from the installed package ({index})")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)

    @app.head("/", include_in_schema=False)
    async def alive() -> Response:
        """200 with no body: the Ollama CLI's and other clients' heartbeat (``HEAD /``) finds a server."""
        return Response(headers=PAGE_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        """204: browsers ask for it on any document without an icon link (a ``/static/`` file, ``/health``);
        a 404 there is an error in the browser's console."""
        return Response(status_code=204, headers=PAGE_HEADERS)

    # StaticFiles answers with ETag/Last-Modified (a reload revalidates), 404 for anything else
    app.mount("/static", PageFiles(directory=STATIC), name="static")


class PageFiles(StaticFiles):
    """The page's static files with the page's own headers (``PAGE_HEADERS``: CSP, ``nosniff``,
    ``frame-ancestors 'none'``): ``/static/index.html`` is the page too, and must not be framed or run
    without its policy."""

    def file_response(self, *args, **kwargs) -> Response:  # noqa: ANN002, ANN003 - StaticFiles' own signature
        """StaticFiles' response for a file, with ``PAGE_HEADERS`` added."""
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses on interfaces that are up, loopback and link-local left out
    (from ``psutil.net_if_addrs``; no packet is sent)."""
    import psutil

    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    found = []
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if name in up and a.family == socket.AF_INET:
                ip = ipaddress.ip_address(a.address)
                if not (ip.is_loopback or ip.is_link_local or a.address in found):
                    found.append(a.address)
    return found


def page_urls(host: str, port: int) -> list[str]:
    """The chat page's URLs for a coordinator bound to ``host``:``port``, the LAN's first: for a wildcard
    bind (``0.0.0.0``, ``::``, empty) each LAN IPv4 address of this machine and then loopback; else the
    bound address alone (an IPv6 literal in brackets)."""
    if host in ("0.0.0.0", "::", ""):
        hosts = [*lan_addresses(), "127.0.0.1"]
    else:
        hosts = [f"[{host}]" if ":" in host else host]
    return [f"http://{h}:{port}/" for h in hosts]


async def print_page_urls(server, host: str) -> None:  # noqa: ANN001 - uvicorn.Server
    """Once ``server`` listens, print the chat page's URLs (the port it actually bound, so ``--port 0``
    prints the right one) for the person who started it."""
    while not server.started:
        await asyncio.sleep(0.05)
    ports = [s.getsockname()[1] for srv in server.servers for s in srv.sockets]
    if not ports:
        return
    urls = page_urls(host, ports[0])
    lan, local = (urls[:-1], urls[-1]) if len(urls) > 1 else (urls, None)
    line = "chat page: " + ", ".join(lan) + (f" (on this machine: {local})" if local else "")
    if host in ("127.0.0.1", "localhost", "::1"):
        line += "; only this machine can open it: --host 0.0.0.0 serves the LAN"
    print(line, flush=True)
