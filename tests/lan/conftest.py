"""LAN fixtures: namespaces ("PCs") on a bridge (tests/lan/netns.py), real workers and a real coordinator
started inside them, and HTTP to a coordinator from a thread inside its namespace. ``pytest -m lan``."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import BIN, Proc

from .netns import Lan, LanUnavailable, check_available, remove_stale

WORKER_FLAGS = ("--inference-precision", "f32", "--threads", "1")  # f32: token-equal to the reference


@pytest.fixture(scope="session")
def lan_ok() -> None:
    """Skip (with the reason) where network namespaces cannot be made; remove dead runs' leftovers."""
    try:
        remove_stale()
        check_available()
    except LanUnavailable as exc:
        pytest.skip(f"LAN tests need network namespaces: {exc}")


@pytest.fixture(scope="module")
def lan(lan_ok, request) -> Lan:  # noqa: ANN001
    """This module's LAN (empty: add PCs with ``lan.add_pc``); removed when the module ends, failed or not."""
    net = Lan()
    request.addfinalizer(net.close)
    return net


class LanWorker:
    """A ``fleet-worker`` running in a PC of the LAN, bound to 0.0.0.0 there: stage ``shard`` of ``build``, or
    with ``build`` None an empty worker (issue 30) whose stage cache and model cache are ``extra``'s."""

    def __init__(self, lan: Lan, pc: str, build: Path | None, shard: int, log_dir: Path, *extra: str,
                 port: int = 0, log_name: str = "") -> None:
        self.lan, self.pc, self.shard = lan, pc, shard
        what = ("--shard", str(shard), "--model", str(build)) if build is not None else ()
        self.proc = Proc(lan.pcs[pc].cmd(str(BIN / "fleet-worker"), *what, "--host", "0.0.0.0", "--port", str(port),
                                         *WORKER_FLAGS, *extra),
                         log_dir / (log_name or f"worker-{pc}-{shard if build is not None else 'empty'}.log"))
        self.address = ""

    def ready(self, timeout: float = 180.0) -> str:
        """Wait until it serves; its address on the PC's first interface (host:port)."""
        port = self.proc.wait_for(r"serving on [\d.]+:(\d+)", timeout).group(1)
        self.address = f"{self.lan.pcs[self.pc].address}:{port}"
        return self.address

    @property
    def rss(self) -> int:
        """Its resident memory in bytes (/proc; ``ip netns exec`` execs the worker, same pid)."""
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.proc.popen.pid}")


def start_workers(lan: Lan, build: Path, log_dir: Path, placement: dict[str, int | tuple]) -> dict[str, LanWorker]:
    """One worker per PC of ``placement`` (PC name -> shard, or (shard, port, *flags)), all started at once;
    returns them once every one serves (stopped, all of them, if one fails)."""
    specs = {pc: spec if isinstance(spec, tuple) else (spec, 0) for pc, spec in placement.items()}
    workers = {pc: LanWorker(lan, pc, build, shard, log_dir, *extra, port=port)
               for pc, (shard, port, *extra) in specs.items()}
    try:
        for w in workers.values():
            w.ready()
    except BaseException:
        stop_all(workers.values())
        raise
    return workers


def stop_all(procs) -> None:  # noqa: ANN001 - LanWorker / LanCoordinator
    """SIGTERM every one at once, then wait for each (a worker takes a second or two to withdraw its
    announcement and drain)."""
    procs = list(procs)
    for p in procs:
        if p.proc.popen.poll() is None:
            p.proc.popen.terminate()
    for p in procs:
        p.proc.stop()


class LanCoordinator:
    """``fleet-coordinator serve`` in a PC, its API on that PC's loopback (with ``announce``: on all its
    addresses, announced for fleet-chat); the test's requests go from a thread in that PC."""

    def __init__(self, lan: Lan, pc: str, build: Path, log_dir: Path, *extra: str, name: str = "coordinator",
                 announce: bool = False) -> None:
        from coordinator.fleet.local import free_port

        self.lan, self.pc, self.port = lan, pc, free_port()
        if "--draft" not in extra:
            extra = (*extra, "--draft", "none")
        where = ("--host", "0.0.0.0", "--announce") if announce else ("--host", "127.0.0.1", "--no-announce")
        self.proc = Proc(lan.pcs[pc].cmd(str(BIN / "fleet-coordinator"), "serve", "--model", str(build),
                                         "--port", str(self.port), *where, *extra), log_dir / f"{name}.log")
        self.url = f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, timeout: float = 120.0, **kw) -> httpx.Response:
        """An HTTP request to the coordinator (made inside its PC's namespace)."""
        return self.lan.call_in(self.pc, httpx.request, method, self.url + path, timeout=timeout, **kw)

    def chat(self, content: str, **kw) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
        return self.request("POST", "/v1/chat/completions", json=body)

    def health(self) -> dict:
        return self.request("GET", "/health", timeout=10).json()

    def wait_ready(self, timeout: float = 120.0, workers: int = 0) -> dict:
        """Wait until every stage is served (and at least ``workers`` workers are healthy); the /health."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"coordinator exited:\n{self.proc.text()[-3000:]}")
            try:
                last = self.health()
                if last["ready"] and sum(w["healthy"] for w in last["workers"]) >= workers:
                    return last
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.2)
        raise TimeoutError(f"coordinator not ready after {timeout} s: {last}\n{self.proc.text()[-3000:]}")

    def stop(self) -> None:
        self.proc.stop()
