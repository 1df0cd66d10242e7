"""``fleet-worker``: serve one shard over gRPC and announce it with zeroconf."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from functools import partial

import psutil
from pydantic import ValidationError

from fleet_common import PROTOCOL_VERSION
from fleet_common.cli import describe_validation_error, dump_tasks_on_signal
from fleet_common.discovery import WorkerAd
from fleet_common.manifest import ManifestError, load_manifest

from .loader import default_cache_dir
from .runner import ShardRunner
from .server import StageService, create_server
from .sessions import SessionStore
from .settings import WorkerSettings

log = logging.getLogger(__name__)


def available_memory() -> int:
    """Memory available to new processes in bytes (psutil: MemAvailable on Linux)."""
    return psutil.virtual_memory().available


async def serve(settings: WorkerSettings, ready: asyncio.Event | None = None) -> None:
    """Run a worker until SIGINT/SIGTERM (or cancellation); SIGUSR1 logs what every task awaits.
    Raises ``ManifestError`` for a bad build."""
    dump_tasks_on_signal()
    loaded = load_manifest(settings.model)
    manifest = loaded.manifest
    if not 0 <= settings.shard < manifest.num_stages:
        raise ManifestError(f"--shard {settings.shard} out of range: this build has stages 0..{manifest.num_stages - 1}")
    entry = manifest.stages[settings.shard]
    cache_dir = (settings.cache_dir or default_cache_dir()) if settings.model_cache else None
    runner = await asyncio.to_thread(partial(ShardRunner, loaded, settings.shard, settings.device, settings.threads,
                                             settings.inference_precision, blobs=settings.blobs,
                                             verify_hashes=settings.verify_hashes, cache_dir=cache_dir,
                                             cache_max_bytes=int(settings.cache_max_gb * 2**30)))
    max_context = min(settings.max_context or manifest.architecture.max_context, manifest.architecture.max_context)
    budget = settings.kv_budget_mb << 20 or available_memory() // 2
    store = SessionStore(runner.new_request, settings.max_sessions, settings.idle_timeout_s,
                         kv_bytes_per_slot=manifest.kv_bytes_per_token(settings.shard, runner.kv_value_bytes),
                         kv_budget_bytes=budget, owner_timeout_s=settings.owner_timeout_s)
    service = StageService(runner, store, loaded.sha256, max_context, settings.security)
    if settings.metrics_port:
        service.metrics.serve(settings.host, settings.metrics_port)
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    server, port = create_server(service, settings.host, settings.port)
    await server.start()
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.security.secret:
        log.warning("!!! worker bound to %s WITHOUT --secret: anyone who can reach port %d can run sessions on it and "
                    "read them. Give every worker and the coordinator --secret FILE (a shared key), and use "
                    "--tls-cert/--tls-key/--tls-ca across networks you do not trust. !!!", settings.host, port)
    announcer = None
    if settings.announce:
        from .announce import Announcer

        announcer = Announcer(
            WorkerAd(settings.shard, manifest.num_stages, entry.start, entry.end, loaded.sha256, PROTOCOL_VERSION,
                     manifest.model_id, service.worker_id, port),
            settings.host, settings.advertise_addr,
        )
        await announcer.start()
    log.info("worker ready: stage %d of %d, layers [%d, %d), manifest %s, KV budget %d MiB (%d slots), %s, "
             "serving on %s:%d", settings.shard, manifest.num_stages, entry.start, entry.end, loaded.sha256[:12],
             budget >> 20, budget // store.kv_bytes_per_slot, settings.security.describe(), settings.host, port)
    if ready is not None:
        ready.set()

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
            for sid in store.expire():
                log.info("session %s expired (idle %.0f s, or its coordinator silent %.0f s); KV freed", sid,
                         settings.idle_timeout_s, settings.owner_timeout_s)

    try:
        async with asyncio.TaskGroup() as tg:
            expiry = tg.create_task(expire_idle())
            await stop.wait()
            expiry.cancel()
    finally:
        log.info("worker stopping")
        if announcer is not None:
            await announcer.stop()
        await server.stop(grace=1.0)
        await service.close()


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
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker[{settings.shard}] %(name)s: %(message)s")
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
