"""fleet-chat in a real pseudo-terminal against a real local HTTP server that records what it is sent
(a test double of the coordinator's API): Ctrl-C during an answer keeps the partial answer in the
conversation and says so; keys typed during an answer are not echoed into it; the arrow keys recall
earlier lines (issue 20, item 8); with --tools a streamed tool call is printed, its result typed at the
'result of NAME>' prompt goes back as a tool message, and the model's next answer follows (issue 29, item 6)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


class Recorder(BaseHTTPRequestHandler):
    """/v1/models, and /v1/chat/completions: the first request streams 'word N ' slowly until the client
    leaves, later ones answer 'ok.' at once; a request with tools gets a get_weather call in OpenAI's
    streamed pieces, or, when its last message is the tool's result, an answer that quotes it. Every
    request body is kept in ``server.bodies``."""

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._send(json.dumps({"object": "list", "data": [{"id": "double", "generation_defaults": {}}]}).encode(),
                   "application/json")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if body.get("tools"):
                self._tool_answer(body["messages"][-1])
                return
            if len(self.server.bodies) == 1:
                for i in range(600):
                    self._event({"content": f"word{i} "})
                    time.sleep(0.05)
            self._event({"content": "ok."})
            self._event({}, "stop")
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.server.disconnects += 1

    def _tool_answer(self, last: dict) -> None:
        if last["role"] == "tool":
            self._event({"content": f"It is {last['content']} in Paris."})
            self._event({}, "stop")
        else:
            self._event({"content": "Checking."})
            self._event({"tool_calls": [{"index": 0, "id": "call_w1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"ci'}}]})
            self._event({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]})
            self._event({}, "tool_calls")
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, delta: dict, finish: str | None = None) -> None:
        event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()

    def _send(self, data: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.bodies, server.disconnects = [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


class Terminal:
    """A child process on a pseudo-terminal; ``screen`` is everything it wrote."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200", "LINES": "50"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            # as a terminal's shell starts it: a suite run in the background (``cmd &`` in a script) ignores
            # SIGINT, an ignored signal stays ignored across exec, and Python then installs no Ctrl-C handler
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, env)
        self.screen = ""

    def read_until(self, text: str, timeout: float = 20.0, start: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while (at := self.screen.find(text, start)) < 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not on the terminal after {timeout} s:\n{self.screen[-3000:]}")
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    break
        return at

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_ctrl_c_keeps_the_partial_answer_and_typed_keys_stay_out_of_it(api):
    url = f"http://127.0.0.1:{api.server_address[1]}"
    term = Terminal([str(BIN / "fleet-chat"), "--url", url])
    try:
        term.read_until(">")
        term.type("Tell me a story\r")
        at = term.read_until("word5 ")
        term.type("xyz")  # typed during the answer
        after = term.read_until("word12 ", start=at)
        assert "xyz" not in term.screen[at:after + 7], "typed keys were echoed into the answer"
        term.type("\x03")  # Ctrl-C
        said = term.read_until("(interrupted; kept in the conversation)")
        term.read_until(">", start=said)
        term.type("\x15Summarize that\r")  # Ctrl-U clears the line of any type-ahead first
        term.read_until("ok.", start=said)
        deadline = time.monotonic() + 10
        while len(api.bodies) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        messages = api.bodies[1]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[0]["content"] == "Tell me a story"
        partial = messages[1]["content"]
        assert partial.startswith("word0 word1 ") and "word12 " in partial, partial
        assert messages[2]["content"].endswith("Summarize that")
        # the arrow keys: Up recalls the last line sent
        term.read_until(">", start=term.screen.index("ok.", said))
        term.type("\x1b[A\r")
        deadline = time.monotonic() + 10
        while len(api.bodies) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert api.bodies[2]["messages"][-1]["content"].endswith("Summarize that")
    finally:
        term.close()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_call_is_printed_and_the_typed_result_goes_back_as_a_tool_message(api, tmp_path):
    url = f"http://127.0.0.1:{api.server_address[1]}"
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    term = Terminal([str(BIN / "fleet-chat"), "--url", url, "--tools", str(tmp_path / "tools.json")])
    try:
        term.read_until(">")
        term.type("Weather in Paris?\r")
        at = term.read_until("[tool call get_weather · call_w1]")
        asked = term.read_until("result of get_weather>", start=at)
        printed = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.screen[at:asked])  # the dimming's escapes
        assert '[tool call get_weather · call_w1] {"city": "Paris"}\r\n' in printed, printed
        term.type("21 C\r")
        term.read_until("It is 21 C in Paris.", start=asked)
        first, second = api.bodies
        assert first["tools"] == second["tools"] == [WEATHER] and "tool_choice" not in first
        assert second["messages"] == [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_w1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_w1", "content": "21 C"}]
    finally:
        term.close()
