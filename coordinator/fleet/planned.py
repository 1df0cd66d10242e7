"""The coordinator's side of a fleet with nothing on the PCs (issue 30 item 2): ``serve --model SOURCE``
(an HF folder or a GGUF file) over empty ``--peer`` workers. ``prepare_build`` collects their capacities
(fleet_common.discovery.Capacity, ``collect_capacities``), plans over them (``plan_fleet``), builds the plan's
stages into the coordinator's cache (``build_for_plan``, keyed by ``build_key``) and ships each worker its
stage (``ship_plan``, fleet_common.shipping). coordinator/fleet/replan.py calls those three again
when a stage has no worker left (item 3). Without
--peer the empty workers are those zeroconf hears (``browsing``).

Imports compiler.planner lazily: it needs the compile extra (``pip install .[compile]``)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.discovery import Capacity, implausible, implausible_endpoint, printable, record_problem
from fleet_common.security import Security, open_channel
from fleet_common.settings import cache_home

if TYPE_CHECKING:
    from compiler.nodes import Node
    from compiler.planner import ModelDims, ModelSource, Plan
    from fleet_common.shipping import Progress

    from .preparing import Preparation

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0  # one Info call's deadline while collecting
GGUF_INT8_BYTES = 1.1  # a GGUF's tensor bytes per parameter up to which its weights are planned as int8
POLL_S = 0.5  # between rounds of Info calls while fewer than the expected workers answer as empty
SETTLE_S = 5.0  # without --expect-workers: plan once no new empty worker has answered for this long
RESOLVE_TIMEOUT_MS = 3000  # one zeroconf resolution of a worker's announcement
SOURCE_HASHES = "source-hashes.json"  # in the build cache dir: source path -> stat key, sha256
SOURCE_HASHES_KEPT = 64  # sources remembered there (the newest)
SPEED_TOLERANCE = 0.2  # measured speeds this close are planned as equal (planning_speeds)


class SourceError(RuntimeError):
    """``serve --model SOURCE`` could not collect workers, plan, build or ship; the message names the worker,
    the numbers and the cause (a timeout, ``PlanRefused``, ``BuildError``, ``ShippingError``, ...)."""


class DuplicateWorkerId(ValueError):
    """Two addresses answer Info with one worker id (a cloned disk): the message names both and the fix."""


def _planner():  # noqa: ANN202
    """compiler.planner, or ``RuntimeError`` naming the extra to install."""
    try:
        from compiler import planner
    except ImportError as exc:
        raise RuntimeError(f"serving a model source that is not a build needs the compile extra "
                           f"(pip install .[compile]): {exc}") from exc
    return planner


def planning_speeds(ms_per_gb: dict[str, float], tolerance: float = SPEED_TOLERANCE) -> dict[str, float]:
    """Worker id -> the ms per GB the planner takes for it: the measured figures (worker/capacity.py) in
    groups, from the fastest, of those within ``tolerance`` (0.2: 20% slower) of the group's fastest, each
    group at its median. Two equal PCs do not measure equal (another process on the PC, its thermal state):
    planned as measured, two workers started together on one machine were split 13/17, 10/20 and 27/3 over
    three starts, each split a new build shipped again. The planner's cost model (weight reads per token) is
    not closer than 20% to a decode step's time anyway. Ties go to the order of the ids."""
    planned: dict[str, float] = {}
    group: list[tuple[float, str]] = []
    for ms, name in sorted((ms, name) for name, ms in ms_per_gb.items()):
        if group and ms > group[0][0] * (1 + tolerance):
            planned.update((n, statistics.median(m for m, _ in group)) for _, n in group)
            group = []
        group.append((ms, name))
    planned.update((n, statistics.median(m for m, _ in group)) for _, n in group)  # the last group, whatever its speed
    return planned


def nodes_from_capacities(capacities: dict[str, Capacity], dims: ModelDims) -> list[Node]:
    """One planner ``Node`` per worker id, in sorted id order (an empty worker keeps its id across restarts:
    worker/identity.py): memory = MemAvailable bytes, device as announced, ``ms_per_layer`` = the
    ``planning_speeds`` ms per GB x one layer's f16 weight bytes (2 per parameter) / 1e9."""
    from compiler.nodes import Node

    layer_gb = dims.layer_params * 2 / 1e9
    speeds = planning_speeds({name: c.ms_per_gb for name, c in capacities.items()})
    return [Node(name, c.memory_available_bytes, device=c.device, ms_per_layer=speeds[name] * layer_gb)
            for name, c in sorted(capacities.items())]


def plan_fleet(dims: ModelDims, capacities: dict[str, Capacity], weights: str = "fp16",
               kv_cache_precision: str = "f16") -> Plan:
    """The plan over these workers. Raises ``PlanRefused`` (names the worker and the shortfall bytes) when
    the model does not fit, ``ValueError`` without workers or with more workers than layers."""
    if not capacities:
        raise ValueError("no empty worker found: nothing to plan the model over")
    return _planner().plan(dims, nodes_from_capacities(capacities, dims), weights=weights,
                           kv_cache_precision=kv_cache_precision)


def build_key(source_sha256: str, layer_ranges: str, weights: str, kv_cache_precision: str = "f16",
              devices: tuple[str, ...] = (), code: str | None = None) -> str:
    """The build cache's folder name for a plan: 16 hex of sha256 over the source's hash, the ranges
    (``0:14,14:30``), the weights as built (``gguf``: its blocks kept), the KV cache precision, the stages'
    devices (written into the manifest) and the compiler's code key (``code``, default
    compiler.code_key.compiler_key: a build made by other compiler code is not taken), so only the same
    source, plan, options and compiler find the same build."""
    if code is None:
        from compiler.code_key import compiler_key

        code = compiler_key()
    parts = (source_sha256, layer_ranges, weights, kv_cache_precision, ",".join(devices), code)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def plan_source(source: ModelSource, capacities: dict[str, Capacity]) -> Plan:
    """``plan_fleet`` of ``source`` (its dimensions, weights and KV precision) over ``capacities`` (worker id ->
    capacity). Raises ``PlanRefused`` (a ``ValueError``) as ``plan_fleet`` does."""
    return plan_fleet(source.dims, capacities, weights=source.weights, kv_cache_precision=source.kv_cache_precision)


def plan_workers(source: ModelSource, found: dict[str, tuple[str, Capacity]], label: str = "workers") -> Plan:
    """``plan_source`` over ``found`` (worker id -> (address, capacity)). Raises ``ValueError`` (the planner's
    ``PlanRefused``: a worker too small for any plan, a model too big for the whole fleet; or more workers
    than layers) whose message, after the planner's reason (which names a worker by its id, the MiB it has and
    the MiB it lacks), names each worker by id, address and capacity: ``\n<label>: ID at HOST:PORT (N MiB
    available, ...); ...``."""
    try:
        return plan_source(source, {w: c for w, (_, c) in found.items()})
    except ValueError as exc:
        where = "; ".join(f"{w} at {a} ({c.line()})" for w, (a, c) in sorted(found.items()))
        raise ValueError(f"{exc}\n{label}: {where}") from exc


ONE_LAYER = "cannot hold even one layer"  # the planner's refusal of a node too small for any stage


def plan_without_small(source: ModelSource, found: dict[str, tuple[str, Capacity]],
                       label: str = "workers") -> tuple[Plan, dict[str, tuple[str, Capacity]], list[str]]:
    """``plan_workers`` over ``found`` less each worker the planner refuses as too small for even one layer (a PC
    keeping its memory for other work, one announcing 0 bytes), as long as one worker is left: (the plan, the
    workers kept, one line per worker left out naming its id, address, capacity and the planner's reason). For a
    re-plan, and a start-up by mDNS, where any PC may announce itself. Raises ``ValueError`` as ``plan_workers``."""
    kept, left_out = dict(found), []
    while len(kept) > 1:
        try:
            plan_source(source, {w: c for w, (_, c) in kept.items()})
            break
        except ValueError as exc:
            node = getattr(exc, "node", None)
            if ONE_LAYER not in str(exc) or node not in kept:
                break
            address, capacity = kept.pop(node)
            left_out.append(f"{printable(node)} at {address} ({capacity.line()}): {exc}")
    return plan_workers(source, kept, label), kept, left_out


def build_cache(settings) -> Path:  # noqa: ANN001 - coordinator.settings.CoordinatorSettings
    """Where a SOURCE's builds are cached: ``--build-cache-dir``, else ``$XDG_CACHE_HOME/fleet/coordinator``."""
    return settings.build_cache_dir or cache_home("coordinator")


async def _capacity(address: str, security: Security, model_id: str | None = None,
                    timeout: float = INFO_TIMEOUT_S) -> tuple[str, Capacity] | str:
    """(worker id, capacity) of the worker at ``address`` if it started empty (it may serve a shipped stage
    already: its capacity is still the one measured at its start), or why it is not counted (unreachable, a
    static worker, or, given ``model_id``, a stage of another model: another fleet's worker)."""
    challenge = security.challenge()
    try:
        async with open_channel(address, security) as channel:
            info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(challenge=challenge), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return f"{address}: {exc.code().name} {exc.details()}"
    if not security.proven(challenge, info.worker_id, info.proof):
        return (f"{address} (worker {printable(info.worker_id or '?')}): does not hold this fleet's --secret (its "
                "Info answer proves no key): not counted, nothing is shipped to it")
    if not info.empty and info.ms_per_gb <= 0:  # started with --shard/--model: it has no stage store
        return (f"{address}: a static worker (--shard/--model) serving stage {info.stage} of {info.model_id!r} "
                f"(manifest {info.manifest_sha256[:12]}): it takes no shipped stage")
    if not info.empty and model_id is not None and info.model_id != model_id:
        return (f"{address}: serves stage {info.stage} of {info.model_id!r}, not of {model_id!r} (another fleet's "
                "worker?): found by mDNS, it is not taken; name it with --peer to ship over it")
    worker, capacity = info.worker_id or address, Capacity(info.memory_available_bytes, info.device, info.ms_per_gb)
    if (odd := implausible(capacity)) is not None:
        return f"{address} (worker {printable(worker)}): announces {odd}: not a measured capacity, not counted"
    return worker, capacity


async def collect_capacities(addresses: list[str], security: Security, expect: int, timeout_s: float,
                             heard: set[str] | None = None, settle_s: float = SETTLE_S,
                             model_id: str | None = None,
                             on_round: Callable[[dict, list[str]], None] | None = None) -> dict[str, tuple[str, Capacity]]:
    """worker id -> (address, capacity) of the workers among ``addresses`` (--peers) and ``heard`` (addresses
    zeroconf adds while this waits: ``browsing``) that started empty, once ``expect`` of them answer Info
    (empty, or serving a stage shipped to them: a restarted coordinator finds them so); with ``expect`` 0, those
    that answer once no new one has turned up for ``settle_s`` (at least one). A heard worker serving a stage
    counts only when it serves ``model_id`` (if given): mDNS does not take another fleet's workers. Raises
    ``TimeoutError`` after ``timeout_s`` naming what was found and why each other address is not counted.
    ``on_round(found, why)`` (if given) gets each round's answers (``/health`` shows them while preparing)."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    ids: dict[str, str] = {}  # address -> the worker id it answered last
    changed = time.monotonic()
    while True:
        found, why = await answering(sorted(set(addresses) | (heard or set())), security, addresses, model_id)
        found, why = _steady(found, why, ids)
        if on_round is not None:
            on_round(found, why)
        if {a for a, _ in found.values()} != seen:  # addresses: an id that changes is not a new worker
            seen, changed = {a for a, _ in found.values()}, time.monotonic()
        if (expect and len(found) >= expect) or (not expect and found and time.monotonic() - changed >= settle_s):
            return found
        if time.monotonic() >= deadline:
            names = ", ".join(f"{wid} at {addr} ({cap.line()})" for wid, (addr, cap) in found.items()) or "none"
            raise TimeoutError(f"expected {expect or 'at least 1'} empty workers, {len(found)} answered in "
                               f"{timeout_s:.0f} s: {names}; not counted: {'; '.join(why) or '-'}")
        await asyncio.sleep(POLL_S)


def _steady(found: dict[str, tuple[str, Capacity]], why: list[str],
            ids: dict[str, str]) -> tuple[dict[str, tuple[str, Capacity]], list[str]]:
    """``found`` less each address whose worker id differs from the one it answered in the last round (``ids``,
    updated): an empty worker keeps its id in its stage cache (worker/identity.py), so one answering a new id
    at each Info (a broken or hostile host) is never counted and cannot keep the collection from settling; a
    restarted worker that made itself a new id counts from the next round."""
    steady, why = {}, list(why)
    for worker, (address, capacity) in found.items():
        last, ids[address] = ids.get(address), worker
        if last is not None and last != worker:
            why.append(f"{address}: answered worker id {printable(worker)} after {printable(last)} (a worker keeps "
                       "its id): not counted until it answers one id twice")
        else:
            steady[worker] = (address, capacity)
    return steady, why


@contextlib.asynccontextmanager
async def browsing() -> AsyncIterator[set[str]]:
    """The ``host:port`` addresses of every ``_fleet._tcp`` worker zeroconf hears while the block runs (a set
    that grows; an announcement resolved once, within ``RESOLVE_TIMEOUT_MS``): where ``collect_capacities``
    finds empty workers without --peer. Which of them started empty, Info says."""
    from zeroconf import IPVersion, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    from fleet_common import SERVICE_TYPE

    heard: set[str] = set()
    ignored: set[str] = set()  # names logged as ignored (a malformed TXT, an address no LAN worker has): once each
    tasks: set[asyncio.Future] = set()
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if await info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS):
            # a hint anyone on the LAN can send: a malformed record, or an address no LAN worker has, is never dialed
            problem = record_problem(info.properties, info.port)
            bad = {} if problem else {h: why for h in info.parsed_addresses(IPVersion.V4Only)
                                      if (why := implausible_endpoint(h, info.port))}
            hosts = [] if problem else [h for h in info.parsed_addresses(IPVersion.V4Only) if h not in bad]
            if (problem or bad) and name not in ignored:
                ignored.add(name)
                log.warning("zeroconf: ignoring %s: %s", printable(name, 200),
                            problem or "; ".join(f"{h}:{info.port}: {why}" for h, why in bad.items()))
            new = {f"{h}:{info.port}" for h in hosts} - heard
            if new:
                log.info("zeroconf: %s at %s", name, ", ".join(sorted(new)))
            heard.update(new)
        else:
            log.warning("zeroconf: %s announced but not resolved in %d ms", name, RESOLVE_TIMEOUT_MS)

    def done(task: asyncio.Future) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("zeroconf: resolving a worker failed", exc_info=task.exception())

    def on_change(zeroconf, service_type, name, state_change) -> None:  # noqa: ANN001 - zeroconf's handler
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.ensure_future(resolve(name))
            tasks.add(task)
            task.add_done_callback(done)

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        yield heard
    finally:
        await browser.async_cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await zc.async_close()


def _source_files(src: Path) -> list[Path]:
    return [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())


def _stat_key(src: Path) -> str:
    """What says a source is unchanged without reading it: each file's relative path, size and mtime_ns."""
    parts = [f"{p.relative_to(src) if p != src else p.name}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}"
             for p in _source_files(src)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _hash_source(src: Path) -> str:
    h = hashlib.sha256()
    for path in _source_files(src):
        h.update(str(path.relative_to(src) if path != src else path.name).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def source_sha256(src: Path, cache_dir: Path | None = None) -> str:
    """sha256 over a GGUF file's bytes, or over an HF folder's files (relative path and bytes, sorted). With
    ``cache_dir``, remembered in ``cache_dir/SOURCE_HASHES`` by the source's resolved path and its files'
    (path, size, mtime_ns): a 40 GB source is read once, not at every start (a file rewritten in place with
    its size and mtime restored would not be noticed). The file keeps the ``SOURCE_HASHES_KEPT`` newest
    sources; an unreadable one is hashed over with a warning."""
    src = Path(src)
    if cache_dir is None:
        return _hash_source(src)
    path, where, stat = Path(cache_dir) / SOURCE_HASHES, str(src.resolve()), _stat_key(src)
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        log.warning("source hash cache %s unreadable (%s): hashing %s again", path, exc, src)
        known = {}
    entry = known.get(where) if isinstance(known, dict) else None
    if isinstance(entry, dict) and entry.get("stat") == stat and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    t0 = time.monotonic()
    digest = _hash_source(src)
    log.info("hashed %s in %.1f s (kept in %s)", src, time.monotonic() - t0, path)
    known = {k: v for k, v in (known if isinstance(known, dict) else {}).items() if k != where}
    known = dict(list(known.items())[-(SOURCE_HASHES_KEPT - 1):]) | {where: {"stat": stat, "sha256": digest}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot keep the source hash in %s: %s", path, exc)
    return digest


def is_gguf(src: Path) -> bool:
    """Whether the source ``src`` is a GGUF file (built with its own blocks kept), not an HF folder."""
    from compiler.source import is_gguf_path

    return Path(src).is_file() and is_gguf_path(Path(src))


def source_model(src: Path) -> ModelSource:
    """What the planner needs of the source ``src``: an HF folder's config.json (``planner.read_model``), or a
    GGUF's dimensions from its metadata (compiler.gguf.gguf_config, as the builder reads them). A GGUF's weights
    are counted as int8 when its tensors hold at most ``GGUF_INT8_BYTES`` bytes per parameter (every kept block
    type: Q8_0 is 1.06), else as fp16; its build keeps its blocks whatever the count. Raises ``ValueError`` /
    ``FileNotFoundError`` naming the file."""
    planner = _planner()
    if not is_gguf(src):
        return planner.read_model(src)
    from compiler.gguf import gguf_config, open_reader

    reader = open_reader(src)
    dims = planner.ModelDims.from_config(gguf_config(reader, str(src)), Path(src).stem)
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    counted = "int8" if stored <= GGUF_INT8_BYTES * dims.parameters else "fp16"
    return planner.ModelSource(dims, counted, "f16")


def build_for_plan(src: Path, p: Plan, cache_dir: Path) -> Path:
    """The build of ``p``'s stages from ``src`` under ``cache_dir/builds/<build_key>``, made with
    compiler.build.build (memory-bounded, as ``fleet-compiler build --plan``; a GGUF keeps its blocks, as
    ``fleet-compiler build FILE.gguf`` does) unless that folder already holds a manifest.json (then nothing is
    built). Built into a temporary sibling and renamed, so a half-made build is never taken for a cached one."""
    from fleet_common.manifest import MANIFEST_NAME

    gguf = is_gguf(src)
    out = cache_dir / "builds" / build_key(source_sha256(src, cache_dir), p.layers, "gguf" if gguf else p.weights,
                                           p.kv_cache_precision, tuple(s.node.device for s in p.stages))
    if (out / MANIFEST_NAME).is_file():
        return out
    _planner()  # the compile extra's clear error before anything else
    from compiler.build import build
    from compiler.planner import record_devices

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build(src, tmp, layers=p.layers, weights=None if gguf else p.weights, kv_cache_precision=p.kv_cache_precision,
          devices=tuple(s.node.device for s in p.stages))
    record_devices(tmp, tuple(s.node.device for s in p.stages))
    tmp.rename(out)
    log.info("built layers %s of %s in %.1f s: build key %s (%s)", p.layers, Path(src).name, time.monotonic() - t0,
             out.name, out)
    return out


async def _served(channel: grpc.aio.Channel, address: str, security: Security) -> pb.InfoReply:
    """The worker's Info (what it serves now); ``ShippingError`` naming it when the call fails or, with a
    secret, the worker does not prove it holds it (nothing is shipped to a host without the fleet's key)."""
    from fleet_common.shipping import ShippingError

    challenge = security.challenge()
    try:
        info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(challenge=challenge), timeout=INFO_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise ShippingError(f"worker {address}: Info failed before shipping: {exc.code().name} {exc.details()}",
                            exc.code()) from None
    if not security.proven(challenge, info.worker_id, info.proof):
        raise ShippingError(f"worker {address}: does not hold this fleet's --secret (its Info answer proves no "
                            "key): nothing shipped to it", grpc.StatusCode.UNAUTHENTICATED)
    return info


async def ship_plan(build_dir: Path, addresses: list[str], security: Security,
                    progress: Callable[[int, str], Progress] | None = None,
                    events: Callable[[str], None] | None = None, load: bool = True) -> list:
    """Stage i of the build at ``build_dir`` shipped to ``addresses[i]`` (only its files, only the bytes the
    worker lacks) and loaded there; ``progress(stage, address)`` (if given) gives each stage's ``Progress``
    callback (``prepare_build`` draws rich bars with it, the re-plan its status line). The stages are shipped one after
    another (they share this PC's link, which one stream fills) and each is loaded while the next ones ship:
    a worker's load (hashing and compiling its stage) takes none of the link. A worker whose Info says it
    serves stage i of this build already (the same manifest sha256: a restarted coordinator) is asked nothing
    (its report says ``already_served``); one serving another build or stage is shipped and loaded over it
    (the worker refuses while it holds sessions: ``ShippingError``). Returns the ``ShipReport`` per stage once
    every stage is loaded; ``events`` (if given) gets a line as each load starts and ends. ``load`` False: the files
    only, nothing loaded (a worker serves on what it serves: a re-plan ships ahead while the fleet serves). Raises
    ``ShippingError`` naming the worker (the other loads still running are cancelled)."""
    from contextlib import AsyncExitStack

    from fleet_common.manifest import load_manifest
    from fleet_common.shipping import ShipReport, ship_stage

    sha = load_manifest(build_dir).sha256
    reports, loads = [], []
    async with AsyncExitStack() as channels:
        try:
            for stage, address in enumerate(addresses):
                channel = await channels.enter_async_context(open_channel(address, security))
                info = await _served(channel, address, security)
                if not info.empty and info.manifest_sha256 == sha and info.stage == stage:
                    reports.append(ShipReport(stage, [], already_served=True))
                    continue
                if not info.empty:
                    log.info("worker %s serves stage %d of manifest %s, not stage %d of manifest %s: shipping over it",
                             address, info.stage, info.manifest_sha256[:12], stage, sha[:12])
                reports.append(await ship_stage(channel, build_dir, stage,
                                                progress(stage, address) if progress else None, address=address))
                if load:
                    loads.append(asyncio.ensure_future(_load(channel, build_dir, stage, address, events)))
            await asyncio.gather(*loads)
        except BaseException:
            for task in loads:
                task.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
            raise
    return reports


async def _load(channel: grpc.aio.Channel, build_dir: Path, stage: int, address: str,
                events: Callable[[str], None] | None) -> None:
    """``load_stage``, told to ``events`` as it starts and ends."""
    from fleet_common.shipping import load_stage

    if events is not None:
        events(f"loading stage {stage} on {address}")
    reply = await load_stage(channel, build_dir, stage, address=address)
    if events is not None:
        events(f"stage {stage} loaded on {address} in {reply.load_s:.1f} s")


@dataclass
class PlannedFleet:
    """What ``prepare_build`` made: the build it serves, the plan, the source's planner view and the workers
    planned over (worker id -> (address, capacity)); coordinator/fleet/replan.py plans again from these."""

    build_dir: Path
    plan: Plan
    source: ModelSource
    members: dict[str, tuple[str, Capacity]]
    source_path: Path  # the HF folder or GGUF file planned from


async def answering(addresses: list[str], security: Security, peers: list[str], model_id: str | None,
                    timeout: float = INFO_TIMEOUT_S) -> tuple[dict[str, tuple[str, Capacity]], list[str]]:
    """One round of Info over ``addresses`` (each call's deadline ``timeout``, seconds): (worker id -> (address,
    capacity) of those that started empty, why each other is not counted). An address not among ``peers``
    (heard by mDNS) counts only when it is empty or serves ``model_id``, as in ``collect_capacities``. Raises
    ``DuplicateWorkerId`` (a ``ValueError``) when two addresses answer with one worker id."""
    answers = await asyncio.gather(*(_capacity(a, security, None if a in peers else model_id, timeout)
                                     for a in addresses))
    found: dict[str, tuple[str, Capacity]] = {}
    for addr, a in zip(addresses, answers, strict=True):
        if isinstance(a, tuple) and a[0] in found:
            raise DuplicateWorkerId(
                f"two workers answer with the worker id {printable(a[0])}: {found[a[0]][0]} and {addr} (a cloned disk "
                "or a copied stage cache?): delete <stages-dir>/worker-id on one of them (fleet-worker --stages-dir, "
                "default ~/.cache/fleet/stages) and restart it; it makes itself a new id")
        if isinstance(a, tuple):
            found[a[0]] = (addr, a[1])
    return found, [a for a in answers if isinstance(a, str)]


def ship_lines(reports: list, addresses: list[str], build_dir: Path) -> list[str]:
    """One line per stage of ``ship_plan``'s reports: what was sent to whom, or that it served it already."""
    return [f"stage {stage}: {addresses[stage]} serves it already (build key {build_dir.name}): nothing shipped"
            if r.already_served else f"stage {stage}: sent {r.sent_bytes / 1e6:.1f} MB ({r.mb_per_s:.0f} MB/s), "
            f"{r.held_bytes / 1e6:.1f} MB already held"
            + (f", {r.reused_bytes / 1e6:.1f} MB copied from the stages it held" if r.reused_bytes else "")
            for stage, r in enumerate(reports)]


async def prepare_build(settings, prep: Preparation | None = None) -> PlannedFleet:  # noqa: ANN001 - CoordinatorSettings
    """``serve --model SOURCE``: the empty workers collected (the --peer ones; without --peer, those zeroconf
    hears; ``--expect-workers`` of them, default every --peer, or by mDNS all that answer until none is new
    for ``SETTLE_S``), planned over, the plan built (cached, in a thread) and each stage shipped and loaded;
    returns the build folder to serve as usual with the plan and the workers. Each phase is told to ``prep``
    (coordinator/api/preparing_page.py: the page and /health show it). Raises ``ValueError`` without --peer and with
    --no-discover."""
    if not settings.peer and not settings.discover:
        raise ValueError(f"{settings.model} is a model source, not a build: give the empty workers with --peer, "
                         "or let zeroconf find them (drop --no-discover)")
    from fleet_common.shipping import RichProgress

    from ..errors import stages_phrase
    from .preparing import Preparation

    prep = prep or Preparation(str(settings.model))
    # in threads: importing the compiler and reading a GGUF's metadata take seconds (4 s for the demo's GGUF, as
    # it imports transformers), in which the event loop would not answer the preparing page's /health
    planner = await asyncio.to_thread(_planner)  # the compile extra's clear error before any wait
    source = await asyncio.to_thread(source_model, settings.model)  # and a bad source's
    expect = settings.expect_workers or len(settings.peer)
    async with browsing() if not settings.peer else contextlib.nullcontext(None) as heard:
        waiting = f"{expect} expected" if expect else f"all that answer until none is new for {SETTLE_S:.0f} s"
        prep.step(f"browsing zeroconf for empty workers ({waiting})" if heard is not None
                  else f"collecting the empty --peer workers ({waiting})")
        found = await collect_capacities(settings.peer, settings.security, expect, settings.workers_timeout_s, heard,
                                         model_id=source.dims.model_id, on_round=prep.heard)
    if heard is None:
        p = plan_workers(source, found)  # the --peers named: one too small is the user's to hear of (exit 2)
    else:  # mDNS: any PC may announce itself
        p, found, left_out = plan_without_small(source, found)
        for line in left_out:
            log.warning("left out of the plan: %s", line)
    prep.workers = sorted(a for a, _ in found.values())
    prep.layers = p.layers
    print("\n".join(planner.report_lines(p)), flush=True)
    prep.step(f"building layers {p.layers} of {Path(settings.model).name} (a cached build is taken at once)")
    build_dir = await asyncio.to_thread(build_for_plan, settings.model, p, build_cache(settings))
    addresses = [found[s.node.name][0] for s in p.stages]
    with RichProgress() as bars:
        def progress(stage: int, address: str) -> Progress:
            prep.step(f"shipping {stages_phrase([stage], len(addresses))} to {address}")

            def on_bytes(path: str, done: int, total: int) -> None:
                bars(f"stage {stage} -> {address}: {path}", done, total)
                prep.progress = (f"shipping {stages_phrase([stage], len(addresses))} to {address}: {path} "
                                 f"{done / 1e6:.0f} of {total / 1e6:.0f} MB")
            return on_bytes

        reports = await ship_plan(build_dir, addresses, settings.security, progress, events=prep.step)
    print("\n".join(ship_lines(reports, addresses, build_dir)), flush=True)
    return PlannedFleet(build_dir, p, source, found, settings.model)
