"""The compatibility suite's fleet: ``FLEET_BASE_URL`` (and ``FLEET_API_KEY`` if it needs one) points
it at any running coordinator; unset, it starts the demo's 2-stage fleet here (real workers on
loopback, no mDNS) once for the whole package.

The assertions are the structure that openai-python, LangChain and Open WebUI rely on (openai-python's
SSE rules in its ``src/openai/_streaming.py``; the endpoints and fields those clients send; the portable
assertions of llama.cpp's ``tools/server/tests`` and vLLM's ``tests/entrypoints/openai``), checked through
the real ``openai`` client and, where the client would hide the wire, with raw httpx.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from openai import OpenAI

from tests.conftest import Fleet

EXTERNAL = os.environ.get("FLEET_BASE_URL", "").rstrip("/")
# the local fleet prefills in small steps, so a 2,000-token prompt takes long enough to report progress
LOCAL_PREFILL_CHUNK = 16


@pytest.fixture(scope="session")
def base_url(request, tmp_path_factory) -> str:
    if EXTERNAL:
        yield EXTERNAL
        return
    build = request.getfixturevalue("build_2")
    fleet = Fleet(build, tmp_path_factory.mktemp("compat"), "--prefill-chunk", str(LOCAL_PREFILL_CHUNK), peers=True)
    yield fleet.url
    fleet.stop()


@pytest.fixture(scope="session")
def headers() -> dict[str, str]:
    key = os.environ.get("FLEET_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="session")
def http(base_url, headers) -> httpx.Client:
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def client(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("FLEET_API_KEY", "unused"), max_retries=0,
                  timeout=120)


@pytest.fixture(scope="session")
def model(http) -> str:
    """The id of the first model the fleet lists (what Open WebUI and the llama.cpp page pick)."""
    return http.get("/v1/models").json()["data"][0]["id"]


@dataclass
class Stream:
    """One SSE response, read off the wire: ``content_type``, the ``comments`` (lines starting with
    ``:``), the JSON ``chunks`` of ``data:`` lines and whether ``data: [DONE]`` ended it."""

    content_type: str
    comments: list[str] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    order: list[str] = field(default_factory=list)  # "comment" / "data" / "done", as they came
    raw: bytes = b""  # the body as it came
    first_content_s: float | None = None  # seconds from the request to the first chunk with text


def read_stream(http: httpx.Client, path: str, body: dict) -> Stream:
    """POST ``body`` with ``stream: true`` and parse the SSE lines as openai-python does
    (``_streaming.py``): comments skipped, each other event's data JSON-decoded, ``[DONE]`` last."""
    t0 = time.perf_counter()
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read().decode()
        out = Stream(response.headers.get("content-type", ""))
        raw = bytearray()
        for line in _lines(response, raw):
            if not line:
                continue
            assert not out.done, f"{line!r} after data: [DONE]"
            if line.startswith(":"):
                out.comments.append(line)
                out.order.append("comment")
            elif line == "data: [DONE]":
                out.done = True
                out.order.append("done")
            else:
                assert line.startswith("data: "), f"not an SSE data line: {line!r}"
                out.chunks.append(json.loads(line[len("data: "):]))
                out.order.append("data")
                choice = (out.chunks[-1].get("choices") or [{}])[0]
                if out.first_content_s is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                    out.first_content_s = time.perf_counter() - t0
    out.raw = bytes(raw)
    return out


def _lines(response: httpx.Response, raw: bytearray) -> Iterator[str]:
    """``response``'s lines (LF or CRLF ends), keeping its bytes in ``raw``."""
    pending = b""
    for part in response.iter_bytes():
        raw.extend(part)
        *lines, pending = (pending + part).split(b"\n")
        yield from (line.removesuffix(b"\r").decode("utf-8") for line in lines)
    if pending:
        yield pending.decode("utf-8")


def replay(raw: bytes, content_type: str = "text/event-stream") -> OpenAI:
    """An openai client whose every request gets ``raw`` back (a recorded fleet response): how the
    real client parses those bytes, without generating again."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=raw,
                                                                   headers={"content-type": content_type}))
    return OpenAI(base_url="http://recorded/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(transport=transport))


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """``response`` is an OpenAI error: ``status``, a body ``{"error": {message, type, param, code}}``
    (openai-python reads ``error.message``/``code``/``param``; LangChain and Open WebUI show ``message``)."""
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    if param is not None:
        assert error["param"] == param, body
    return error
