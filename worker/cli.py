"""``fleet-worker``: serve one shard over gRPC and announce it with zeroconf; without ``--shard`` and
``--model``, start empty and serve the stage shipped to it (worker/stage_slot.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial

import psutil
from pydantic import ValidationError

from fleet_common import PROTOCOL_VERSION
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.cli import describe_validation_error, dump_tasks_on_signal
from fleet_common.discovery import Capacity, WorkerAd
from fleet_common.manifest import LoadedManifest, ManifestError, load_manifest
from fleet_common.security import open_server
from fleet_common.wire import add_servicer

from .capacity import measured_speed
from .identity import claim
from .loader import default_cache_dir
from .log_role import RoleFilter, set_role
from .runner import ShardRunner
from .server import StageService, create_server
from .sessions import SessionStore
from .settings import WorkerSettings
from .stage_cache import StageCache, default_stages_dir
from .stage_slot import StageSlot, StageStoreService

log = logging.getLogger(__name__)


def available_memory() -> int:
    """Memory available to new processes in bytes (psutil: MemAvailable on Linux)."""
    return psutil.virtual_memory().available


def offered(capacity: Capacity, memory_mb: int) -> Capacity:
    """``capacity`` with its memory capped at ``memory_mb`` MiB (``--memory-mb``; 0: as measured)."""
    if not memory_mb:
        return capacity
    return dataclasses.replace(capacity, memory_available_bytes=min(capacity.memory_available_bytes, memory_mb << 20))


def _kv_budget(settings: WorkerSettings) -> int:
    """The KV budget (bytes) of a worker whose stage is loaded: ``--kv-budget-mb``, else half the memory
    available now, and with ``--memory-mb`` at most what that leaves beside this process's resident memory
    (its weights and compiled model; at least 1 MiB, so a session too large is refused by name)."""
    if settings.kv_budget_mb:
        return settings.kv_budget_mb << 20
    budget = available_memory() // 2
    if settings.memory_mb:
        held = psutil.Process().memory_info().rss
        budget = max(1 << 20, min(budget, (settings.memory_mb << 20) - held))
    return budget


async def open_stage(settings: WorkerSettings, loaded: LoadedManifest, shard: int, *, verify_hashes: bool,
                     worker_id: str | None = None) -> StageService:
    """``shard`` of the build ``loaded`` compiled (or imported) and warmed up, with its session store, as the
    ``StageService`` a worker serves (``settings``: device, threads, precision, caches, KV budget, security).
    Raises ``ManifestError`` for a shard the build lacks or files that do not match (``verify_hashes``),
    ``RuntimeError`` when it does not compile."""
    manifest = loaded.manifest
    if not 0 <= shard < manifest.num_stages:
        raise ManifestError(f"--shard {shard} out of range: this build has stages 0..{manifest.num_stages - 1}")
    cache_dir = (settings.cache_dir or default_cache_dir()) if settings.model_cache else None
    runner = await asyncio.to_thread(partial(ShardRunner, loaded, shard, settings.device, settings.threads,
                                             settings.inference_precision, blobs=settings.blobs,
                                             verify_hashes=verify_hashes, cache_dir=cache_dir,
                                             cache_max_bytes=int(settings.cache_max_gb * 2**30)))
    max_context = min(settings.max_context or manifest.architecture.max_context, manifest.architecture.max_context)
    store = SessionStore(runner.new_request, settings.max_sessions, settings.idle_timeout_s,
                         kv_bytes_per_slot=manifest.kv_bytes_per_token(shard, runner.kv_value_bytes),
                         kv_budget_bytes=_kv_budget(settings), owner_timeout_s=settings.owner_timeout_s,
                         sliding=manifest.sliding_kv(shard),
                         sliding_bytes_per_slot=manifest.sliding_kv_bytes_per_token(shard, runner.kv_value_bytes))
    service = StageService(runner, store, loaded.sha256, max_context, settings.security)
    if worker_id is not None:
        service.worker_id = worker_id
    return service


def stage_ad(service: StageService, port: int) -> WorkerAd:
    """What a worker serving ``service``'s stage announces."""
    loaded, entry = service.runner.loaded, service.runner.entry
    return WorkerAd(service.runner.stage, loaded.manifest.num_stages, entry.start, entry.end, loaded.sha256,
                    PROTOCOL_VERSION, loaded.manifest.model_id, service.worker_id, port)


async def _announce(settings: WorkerSettings, ad: WorkerAd, capacity: Capacity | None = None):
    if not settings.announce:
        return None
    from .announce import Announcer

    announcer = Announcer(ad, settings.host, settings.advertise_addr, capacity)
    await announcer.start()
    return announcer


def loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) is reachable from this machine only: ``localhost``, 127.0.0.0/8, ``::1``."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MAKE_KEY = "python -c \"import secrets; print(secrets.token_urlsafe(32))\" > fleet.key && chmod 600 fleet.key"


def check_store_open(settings: WorkerSettings) -> None:
    """The empty worker's default (issue 45): bound beyond loopback, its stage store takes stages only from a
    coordinator holding the fleet key (``--secret``); ``--open-store`` opens it on purpose. Raises ``ValueError``
    naming both ways otherwise (``fleet-worker`` exits 2 before it serves anything)."""
    if loopback(settings.host) or settings.security.secret:
        return
    if settings.open_store:
        log.warning("!!! --open-store: any host that reaches port %s can write stages into %s and have this worker "
                    "serve them. Use it only on a network you trust; elsewhere give every PC --secret FILE. !!!",
                    settings.port or "(chosen at start)", settings.stages_dir or default_stages_dir())
        return
    raise ValueError(
        f"an empty worker on {settings.host} without --secret would take stages from any host on the network: give "
        "it the fleet's key with --secret FILE, and the coordinator the same file (make one with: "
        f"{MAKE_KEY}; then copy it to every PC), or start it with --open-store on a network you trust (see "
        "docs/security.md)")


def _warn_open(settings: WorkerSettings, port: int) -> None:
    if not loopback(settings.host) and not settings.security.secret:
        log.warning("!!! worker bound to %s WITHOUT --secret: anyone who can reach port %d can run sessions on it and "
                    "read them. Give every worker and the coordinator --secret FILE (a shared key), and use "
                    "--tls-cert/--tls-key/--tls-ca across networks you do not trust. !!!", settings.host, port)


def _log_ready(settings: WorkerSettings, service: StageService, port: int) -> None:
    manifest, entry, store = service.runner.loaded.manifest, service.runner.entry, service.store
    log.info("worker ready: stage %d of %d, layers [%d, %d), manifest %s, KV budget %d MiB (%d slots), %s, "
             "serving on %s:%d", service.runner.stage, manifest.num_stages, entry.start, entry.end,
             service.manifest_sha256[:12], store.kv_budget_bytes >> 20,
             store.kv_budget_bytes // store.kv_bytes_per_slot, settings.security.describe(), settings.host, port)


async def serve(settings: WorkerSettings, ready: asyncio.Event | None = None) -> None:
    """Run a worker until SIGINT/SIGTERM (or cancellation); SIGUSR1 logs what every task awaits. Without
    ``--shard``/``--model`` it starts empty (``serve_empty``). Raises ``ManifestError`` for a bad build."""
    dump_tasks_on_signal()
    if settings.model is None:
        return await serve_empty(settings, ready)
    loaded = load_manifest(settings.model)
    service = await open_stage(settings, loaded, settings.shard, verify_hashes=settings.verify_hashes)
    if settings.metrics_port:
        service.metrics.serve(settings.host, settings.metrics_port)
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    server, port = create_server(service, settings.host, settings.port)
    await server.start()
    _warn_open(settings, port)
    announcer = await _announce(settings, stage_ad(service, port))
    _log_ready(settings, service, port)
    if ready is not None:
        ready.set()
    try:
        await _run_until_stopped(settings, lambda: service)
    finally:
        log.info("worker stopping")
        if announcer is not None:
            await announcer.stop()
        await server.stop(grace=1.0)
        await service.close()


async def serve_empty(settings: WorkerSettings, ready: asyncio.Event | None = None) -> None:
    """An empty worker (issue 30): it measures (or reads back) its capacity (worker/capacity.py), announces
    itself as empty with it, and serves ``fleet.v1.StageStore`` (stage files into ``--stages-dir``, then
    ``LoadStage``) beside a ``fleet.v1.Stage`` that serves the loaded stage as ``--shard N --model DIR``
    would, re-announced as that stage. Its id is the stage cache's (worker/identity.py): raises
    ``StagesDirInUse`` when another worker holds that folder. Runs until SIGINT/SIGTERM."""
    check_store_open(settings)
    stages_dir = settings.stages_dir or default_stages_dir()
    worker_id, lock_fd = claim(stages_dir)  # kept open (locked) until this process exits
    capacity = offered(await asyncio.to_thread(measured_speed, stages_dir, settings.device, settings.threads),
                       settings.memory_mb)
    slot = StageSlot(worker_id, capacity, settings.security)
    state: dict = {"announcer": None, "metrics": False}
    port = 0

    async def load(loaded: LoadedManifest, shard: int) -> StageService:
        service = await open_stage(settings, loaded, shard, verify_hashes=False, worker_id=slot.worker_id)
        if settings.metrics_port and not state["metrics"]:  # its registry is this first stage's
            service.metrics.serve(settings.host, settings.metrics_port)
            state["metrics"] = True
        if state["announcer"] is not None:
            await state["announcer"].stop()
        state["announcer"] = await _announce(settings, stage_ad(service, port))
        _log_ready(settings, service, port)
        return service

    cache = StageCache(stages_dir, max_bytes=int(settings.stages_max_gb * 2**30))
    for path in await asyncio.to_thread(cache.clean):
        log.info("stage cache: deleted %s (no transfer will finish it)", path)
    stage_store = StageStoreService(cache, slot, load)
    server, port = open_server(f"{settings.host}:{settings.port}", settings.security)
    add_servicer(pb_grpc.add_StageServicer_to_server, slot, server)
    add_servicer(pb_grpc.add_StageStoreServicer_to_server, stage_store, server)
    await server.start()
    _warn_open(settings, port)
    state["announcer"] = await _announce(settings, WorkerAd(-1, 0, 0, 0, "", PROTOCOL_VERSION, "", slot.worker_id,
                                                            port), capacity)
    log.info("worker ready: empty (no stage yet), %s; stage cache %s, %s, serving on %s:%d", capacity.line(),
             stages_dir, settings.security.describe(), settings.host, port)
    if ready is not None:
        ready.set()
    try:
        await _run_until_stopped(settings, lambda: slot.service)
    finally:
        log.info("worker stopping")
        if state["announcer"] is not None:
            await state["announcer"].stop()
        await server.stop(grace=1.0)
        if slot.service is not None:
            await slot.service.close()
        os.close(lock_fd)  # the stage cache's lock: another worker may take the folder now


async def _run_until_stopped(settings: WorkerSettings, current: Callable[[], StageService | None]) -> None:
    """Wait for SIGINT/SIGTERM, expiring idle sessions of the stage ``current()`` serves meanwhile."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass

    async def expire_idle() -> None:
        while True:
            await asyncio.sleep(min(10.0, settings.idle_timeout_s / 2, settings.owner_timeout_s / 3))
            service = current()
            for sid in service.store.expire() if service is not None else ():
                log.info("session %s expired (idle %.0f s, or its coordinator silent %.0f s); KV freed", sid,
                         settings.idle_timeout_s, settings.owner_timeout_s)

    async with asyncio.TaskGroup() as tg:
        expiry = tg.create_task(expire_idle())
        await stop.wait()
        expiry.cancel()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-worker`` console script (``--profile``: worker/profile.py, serves nothing)."""
    if "--profile" in (sys.argv[1:] if argv is None else argv):
        from .profile import main as profile_main

        return profile_main(sys.argv[1:] if argv is None else argv)
    try:
        settings = WorkerSettings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="fleet-worker")
    except ValidationError as exc:
        print(f"fleet-worker: error: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    set_role("empty" if settings.shard is None else str(settings.shard))  # an empty one's: the stage it loads
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s worker[%(worker_role)s] %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RoleFilter())
    try:
        asyncio.run(serve(settings))
    except (ManifestError, ValueError, RuntimeError) as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
