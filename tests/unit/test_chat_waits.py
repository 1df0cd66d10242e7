"""fleet-chat while the fleet is not serving yet or re-plans (real processes, real HTTP): against the port of a
coordinator preparing its fleet (coordinator/api/preparing_page.py, real uvicorn) fleet-chat waits on the 503
``fleet_preparing`` as its Retry-After says, shows the progress on stderr, and asks once the API answers there
(a real local HTTP server standing in for it); a stream's SSE comments (``: re-planning ...``) show on stderr,
never in the answer; ``--wait-s`` bounds the wait."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from coordinator.api.preparing_page import serving_while
from coordinator.fleet.local import free_port
from coordinator.fleet.preparing import Preparation
from coordinator.settings import CoordinatorSettings

CHAT = [str(Path(sys.executable).parent / "fleet-chat")]


class Api(BaseHTTPRequestHandler):
    """/v1/models, and /v1/chat/completions streaming two re-planning comments before 'Hello there.'."""

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass

    def do_GET(self) -> None:  # noqa: N802
        data = json.dumps({"object": "list", "data": [{"id": "double"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in (": re-planning shipping stage 1 (of 2 stages) to 10.0.0.7:50051 (3 s); stage 1 lost",
                     ": replaying 12 tokens on a new pipeline"):
            self.wfile.write(f"{line}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.2)
        for delta, finish in (({"content": "Hello"}, None), ({"content": " there."}, None), ({}, "stop")):
            event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def api_on(port: int, listening: socket.socket | None = None) -> ThreadingHTTPServer:
    """The stand-in API on ``port``, or on ``listening`` (the preparing page's socket, handed over as the
    coordinator's API takes it: coordinator/cli.py)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), Api, bind_and_activate=listening is None)
    if listening is not None:
        server.socket.close()
        server.socket = listening
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_sse_comments_show_on_stderr_not_in_the_answer():
    server = api_on(0)
    try:
        run = subprocess.run([*CHAT, "--url", f"http://127.0.0.1:{server.server_address[1]}", "-p", "Hi"],
                             capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr
    assert "Hello there." in run.stdout and "re-planning" not in run.stdout and "replaying" not in run.stdout
    assert "re-planning shipping stage 1 (of 2 stages)" in run.stderr and "replaying 12 tokens" in run.stderr


def test_fleet_chat_waits_for_a_preparing_coordinator_then_asks(tmp_path):
    port = free_port()
    settings = CoordinatorSettings(model=tmp_path, host="127.0.0.1", port=port)
    prep = Preparation("m.gguf")

    async def work() -> subprocess.Popen:
        prep.step("collecting the empty --peer workers (2 expected)")
        prep.heard({}, ["10.0.0.9:50051: UNAUTHENTICATED wrong fleet token"])
        chat = subprocess.Popen([*CHAT, "--url", f"http://127.0.0.1:{port}", "-p", "Hi"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        await asyncio.sleep(3)  # fleet-chat's first try meets the preparing page
        prep.step("building layers 0:15,15:30 of m.gguf")
        await asyncio.sleep(6)  # after its Retry-After (5 s), the next try shows the new step
        return chat

    chat, listening = asyncio.run(serving_while(prep, settings, work()))
    server = api_on(port, listening)  # the API takes the listening socket over
    try:
        out, err = chat.communicate(timeout=60)
    finally:
        server.shutdown()
        server.server_close()  # closes the handed-over socket
    assert chat.returncode == 0, err
    assert "Hello there." in out and "waiting" not in out
    assert "waiting for the fleet" in err and "collecting the empty --peer workers" in err, err
    assert "UNAUTHENTICATED wrong fleet token" in err and "building layers 0:15,15:30" in err, err
    assert "connected to" in err and "not as a fleet coordinator" not in err


def test_the_wait_is_bounded_by_wait_s(tmp_path):
    port = free_port()
    settings = CoordinatorSettings(model=tmp_path, host="127.0.0.1", port=port)
    prep = Preparation("m.gguf")

    async def work() -> subprocess.CompletedProcess:
        prep.step("shipping stage 0 (of 2 stages)")
        return await asyncio.to_thread(subprocess.run, [*CHAT, "--url", f"http://127.0.0.1:{port}", "--wait-s", "2",
                                                        "-p", "Hi"], capture_output=True, text=True, timeout=60)

    run, listening = asyncio.run(serving_while(prep, settings, work()))
    listening.close()
    assert run.returncode == 2 and "still being prepared after 2 s" in run.stderr, run.stderr
