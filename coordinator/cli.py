"""``fleet-coordinator serve``: discover workers, assemble the pipeline, serve the OpenAI API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid

import uvicorn
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import CliApp, CliSubCommand

from fleet_common import API_SERVICE_TYPE, PROTOCOL_VERSION
from fleet_common.cli import describe_validation_error, dump_tasks_on_signal
from fleet_common.discovery import announce_addresses
from fleet_common.manifest import ManifestError, load_manifest

from .api.app import create_app
from .engine.engine import Engine
from .engine.leases import LeaseCheck
from .api.http_guard import ConnectionLimits, SignalFreeServer, guarded_protocol
from .engine.pipeline import Channels
from .fleet.planned import PlannedFleet, SourceError
from .fleet.registry import Registry
from .settings import CoordinatorSettings
from .tokenizer import ChatTokenizer
from .api.web import print_page_urls

log = logging.getLogger(__name__)


async def _announce_api(host: str, port: int, model_id: str):  # noqa: ANN202
    """Announce the HTTP API (``_fleet-api._tcp``) for fleet-chat: at the addresses ``host`` serves (every
    non-loopback one for 0.0.0.0; the host name's was 127.0.0.1 from /etc/hosts), under a host record of
    its own (a PC's host name is shared by clones and by namespaces of one machine)."""
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    addrs, interfaces = announce_addresses(host)
    zc = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
    info = AsyncServiceInfo(API_SERVICE_TYPE, f"fleet-{socket.gethostname()}-{port}.{API_SERVICE_TYPE}",
                            addresses=[socket.inet_aton(a) for a in addrs], port=port,
                            properties={"model": model_id[:120]}, server=f"fleet-api-{uuid.uuid4().hex[:12]}.local.")
    await zc.async_register_service(info, allow_name_change=True)
    log.info("announced the API as %s at %s", info.name, ", ".join(f"{a}:{port}" for a in addrs))
    return zc, info


def _source_model_name(settings: CoordinatorSettings) -> str:
    """The model name a SOURCE's build will be served under (``--served-model-name``, else the manifest's
    ``model_id`` as compiler/build.py writes it: a GGUF file's stem, an HF folder's name)."""
    if settings.served_model_name:
        return settings.served_model_name
    source = settings.model
    return source.stem if source.suffix == ".gguf" else source.resolve().name


async def _withdraw(zc) -> None:  # noqa: ANN001 - (AsyncZeroconf, AsyncServiceInfo) of _announce_api, or None
    """Withdraw the API's announcement (nothing when ``zc`` is None)."""
    if zc is not None:
        await zc[0].async_unregister_service(zc[1])
        await zc[0].async_close()


def _worker_health(registry: Registry, w, now: float) -> dict:  # noqa: ANN001 - registry.WorkerState
    """One worker in ``/health``."""
    entry = {"address": w.address, "source": w.source, "healthy": w.healthy, "refused": w.refused,
             "missed_health_checks": w.missed, "late_health_checks": w.late, "load": registry.load(w.address),
             "rtt_ms": round(w.rtt_s * 1000, 2),
             "seen_s_ago": round(now - w.last_seen, 1) if w.last_seen else None, "stage": None}
    if w.info is not None:
        i = w.info
        entry.update(stage=i.stage, worker_id=i.worker_id, layers=[i.layer_start, i.layer_end],
                     device=i.device, sessions=i.sessions, sequences=i.sequences, busy=i.busy,
                     kv_bytes=i.kv_bytes, kv_reserved_bytes=i.kv_reserved_bytes,
                     kv_budget_bytes=i.kv_budget_bytes, protocol_version=i.protocol_version,
                     openvino_version=i.openvino_version, manifest_sha256=i.manifest_sha256)
    return entry


def _health(engine: Engine, registry: Registry) -> dict:
    """The ``/health`` JSON: ready (every stage served, not shutting down, not re-planning), the build (the
    registry's: a re-plan switches it), the load, the workers; a planned fleet's state under ``fleet``
    (replan.Replanner.status: serving, replanning with its progress and reason, or refused)."""
    now = time.monotonic()
    loaded = registry.loaded
    fleet = engine.replan.status() if engine.replan is not None else None
    return {
        "ready": not registry.missing_stages() and not engine.stopping and (fleet is None
                                                                          or fleet["state"] == "serving"),
        "shutting_down": engine.stopping,
        "model": engine.model_name,
        "manifest_sha256": loaded.sha256,
        "num_stages": loaded.manifest.num_stages,
        "protocol_version": PROTOCOL_VERSION,
        "missing_stages": registry.missing_stages(),
        "queued": engine.queued,
        "running": engine.running,
        "prefix_cache": engine.prefix_cache_state(),
        "workers": [_worker_health(registry, w, now) for w in list(registry.workers.values())],
        **({"fleet": fleet} if fleet is not None else {}),
    }


def _state(engine: Engine, registry: Registry) -> dict:
    """What the metrics gauges report: the engine's load and each worker's."""
    cache = engine.prefix_cache_state()
    return {"queued": engine.queued, "running": engine.running, "retained_sessions": cache["sessions"],
            "retained_tokens": cache["tokens"], "workers": [
        {"address": w.address, "stage": w.info.stage, "healthy": int(w.healthy), "sessions": w.info.sessions,
         "sequences": w.info.sequences, "kv_bytes": w.info.kv_bytes, "kv_reserved_bytes": w.info.kv_reserved_bytes,
         "kv_budget_bytes": w.info.kv_budget_bytes, "busy": w.info.busy}
        for w in list(registry.workers.values()) if w.info is not None]}


class _Shutdown:
    """SIGINT (Ctrl-C) and SIGTERM: stop taking requests, give the answers in flight ``grace_s`` to
    finish, end the rest with a "shutting down" error, free their sessions at the stages, then stop the
    HTTP server. A second signal ends the answers at once; a third stops the server without waiting
    for its connections."""

    def __init__(self, engine: Engine, grace_s: float) -> None:
        self.engine, self.grace_s = engine, grace_s
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None
        self.signals = 0
        self.drained = False

    def attach(self, server: uvicorn.Server) -> None:
        """The HTTP server to stop once drained (at once if a signal came while the coordinator started)."""
        self.server = server
        server.should_exit = self.drained

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows; not the main thread
                loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            log.info("%s: shutting down; no new requests, the %d answer(s) in flight get %.0f s to finish "
                     "(Ctrl-C again: end them now)", name, self.engine.running, self.grace_s)
            self.task = asyncio.create_task(self._drain(), name="shutdown")
        elif self.signals == 2:
            log.info("%s again: ending the answers in flight now", name)
            self.engine.cut()
        elif self.server is not None:
            log.info("%s again: stopping without waiting for connections", name)
            self.server.force_exit = True

    async def _drain(self) -> None:
        await self.engine.drain(self.grace_s)
        self.drained = True
        if self.server is not None:
            self.server.should_exit = True

    async def wait(self) -> None:
        """After the server stopped: wait for the drain (sessions freed) if a signal began one."""
        if self.task is not None:
            await self.task


async def _start_local_workers(settings: CoordinatorSettings, loaded, registry: Registry):  # noqa: ANN001, ANN202
    """``--local-workers N``: start one worker per stage here and add them as peers; the LocalWorkers."""
    from .fleet.local import LocalWorkers

    if settings.local_workers != loaded.manifest.num_stages:
        raise ManifestError(f"--local-workers {settings.local_workers}: this build has "
                            f"{loaded.manifest.num_stages} stages; start one worker per stage")
    local = LocalWorkers(settings.model, loaded.manifest.num_stages, settings.worker_threads,
                         settings.inference_precision, security=settings.security)
    await local.start()
    for address in local.addresses:
        registry.add_peer(address)
    return local


PREPARED_READY_S = 10.0  # serve --model SOURCE: how long the API waits for its first health checks (connections
# queue on the listening socket meanwhile, none refused); past it, /health names what is missing


async def _report_ready(registry: Registry, loaded) -> None:  # noqa: ANN001 - LoadedManifest
    if await registry.wait_ready(120):
        log.info("fleet ready: %d stages, %s", loaded.manifest.num_stages, " -> ".join(registry.placement()))
    else:
        log.warning("still missing stage(s) %s after 120 s", registry.missing_stages())


def _http_protocol(settings: CoordinatorSettings) -> type:
    """uvicorn's h11 protocol with the header and body deadlines and the per-client connection cap."""
    return guarded_protocol(ConnectionLimits(settings.header_timeout_s, settings.body_timeout_s,
                                             settings.max_connections_per_client))


async def serve(settings: CoordinatorSettings) -> None:
    """Run the coordinator until SIGINT/SIGTERM (see ``_Shutdown``; SIGUSR1 logs what every task
    awaits). Raises ``ManifestError`` for a bad build folder, ``fleet.planned.SourceError`` for a model source
    that could not be collected for, planned, built or shipped (the message names the worker and the numbers)."""
    dump_tasks_on_signal()
    planned = None  # fleet.planned.PlannedFleet of a SOURCE
    if not (settings.model / "manifest.json").is_file() and (settings.model.is_file() or settings.model.is_dir()):
        from .fleet.planned import prepare_build  # a SOURCE, not a build: plan, build and ship first
        from .api.preparing_page import serving_while  # the page and /health show it meanwhile
        from .fleet.preparing import Preparation

        prep = Preparation(str(settings.model))
        # announced while it prepares too (fleet-chat finds it and waits on its 503 fleet_preparing), under the
        # name the build's manifest will carry (compiler/build.py: a GGUF's stem, an HF folder's name)
        zc = await _announce_api(settings.host, settings.port, _source_model_name(settings)) \
            if settings.announce else None
        try:
            planned, listening = await serving_while(prep, settings, prepare_build(settings, prep))
        except (ValueError, OSError, RuntimeError) as exc:  # TimeoutError is an OSError, ShippingError a RuntimeError
            await _withdraw(zc)
            raise SourceError(f"serve --model {settings.model}: {exc}") from exc
        except BaseException:
            await _withdraw(zc)
            raise
        settings.model = planned.build_dir
    else:
        zc = listening = None
    try:
        await _serve_build(settings, planned, zc, listening)
    finally:
        if listening is not None:
            listening.close()


async def _serve_build(settings: CoordinatorSettings, planned: PlannedFleet | None, zc,  # noqa: ANN001 - _withdraw's
                       listening: socket.socket | None) -> None:
    """``serve``'s part once there is a build (``settings.model``): the engine, the workers and the API, on
    ``listening`` when the preparing page handed its socket over (``preparing_page.serving_while``), else on
    ``settings.host``/``port``; ``planned`` is the ``PlannedFleet`` of a SOURCE (None for a build folder) and
    ``zc`` its announcement while preparing (None: announced here if ``--announce``)."""
    loaded = load_manifest(settings.model)
    tokenizer = ChatTokenizer(settings.model)
    channels = Channels(settings.security)
    registry = Registry(loaded, channels, settings.health_interval_s, settings.missed_health_checks)
    registry.planned = planned is not None
    engine = Engine(settings, loaded, registry, tokenizer)  # first: a bad --draft fails before workers start
    registry.on_lease_gap = LeaseCheck(engine.prefix_cache, settings.rpc_timeout_s)
    if planned is not None:  # a stage that loses its last worker is re-planned over the workers left
        from .fleet.replan import Replanner

        free = engine.prefix_cache.clear if engine.prefix_cache is not None else (lambda: None)
        engine.replan = Replanner(settings, planned, registry, free)
    shutdown = _Shutdown(engine, settings.shutdown_grace_s)
    shutdown.install()
    local = ready_task = None
    try:
        if settings.local_workers:
            local = await _start_local_workers(settings, loaded, registry)
        for peer in settings.peer:
            registry.add_peer(peer)
        await registry.start(discover=settings.discover, report_silence=not settings.local_workers)
        if listening is not None:  # the workers just loaded their stages: the API takes the port once the first
            await registry.wait_ready(PREPARED_READY_S)  # health checks saw them, not saying "missing" meanwhile
        if engine.replan is not None:
            engine.replan.start()
        engine.metrics.watch(lambda: _state(engine, registry))
        app = create_app(engine, lambda: _health(engine, registry))
        # the server stops once drained (every stream ended): this bounds only a client that never reads
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                                access_log=False, timeout_graceful_shutdown=5, http=_http_protocol(settings),
                                timeout_keep_alive=settings.keep_alive_timeout_s)
        server = SignalFreeServer(config)
        shutdown.attach(server)
        if server.should_exit:  # signalled while starting
            return
        ready_task = asyncio.gather(_report_ready(registry, loaded), print_page_urls(server, settings.host))
        if settings.announce and zc is None:
            zc = await _announce_api(settings.host, settings.port, engine.model_name)
        await server.serve(sockets=[listening] if listening is not None else None)
        await shutdown.wait()
    finally:
        if ready_task is not None:
            ready_task.cancel()
            await asyncio.gather(ready_task, return_exceptions=True)  # retrieved: no "never retrieved" at exit
        await _stop(zc, registry, local, channels, engine)


async def _stop(zc, registry: Registry, local, channels: Channels, engine: Engine) -> None:  # noqa: ANN001
    """Withdraw the announcement, stop health checks and pipelines, then the local workers (after the
    drain: the answers in flight were ended first), then the channels and the draft model."""
    try:
        if engine.replan is not None:
            await engine.replan.stop()
        await _withdraw(zc)
        await registry.stop()
    finally:
        try:
            if local is not None:
                await local.stop()
        finally:
            await channels.close()
            await engine.grammar_check.close()
            engine.close()
    log.info("coordinator stopped")


class Serve(CoordinatorSettings):
    """Discover workers, assemble the pipeline and serve the OpenAI-compatible API."""

    def cli_cmd(self) -> None:
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(levelname)s coordinator %(name)s: %(message)s")
        try:
            asyncio.run(serve(CoordinatorSettings(**self.model_dump())))
        except (ManifestError, SourceError) as exc:
            log.error("%s", exc)
            sys.exit(2)
        except KeyboardInterrupt:  # Ctrl-C before the coordinator's own handlers were installed
            log.info("interrupted while starting")
            sys.exit(130)


def _replica_line(w: dict) -> str:
    """One worker of a stage in ``fleet-coordinator status``: address, health, load, KV, versions."""
    mib = 1 << 20
    kv = (f"KV {w['kv_bytes'] / mib:.1f} MiB held, {w['kv_reserved_bytes'] / mib:.0f} of "
          f"{w['kv_budget_bytes'] / mib:.0f} MiB reserved") if "kv_bytes" in w else "no info"
    return (f"  {w['address']:<21} {'healthy' if w['healthy'] else 'DOWN':<8} id {w.get('worker_id', '?'):<12} "
            f"{w.get('device', '?')}  RTT {w['rtt_ms']:.1f} ms, sessions {w.get('sessions', '?')} "
            f"(this coordinator's requests now: {w['load']}), sequences {w.get('sequences', '?')}, "
            f"busy {w.get('busy', '?')}, {kv}, "
            f"OpenVINO {w.get('openvino_version', '?')}, protocol {w.get('protocol_version', '?')}, via {w['source']}"
            + (f", missed {w['missed_health_checks']} health checks" if w["missed_health_checks"] else ""))


def _stage_lines(stage: int, replicas: list[dict]) -> list[str]:
    """A stage's heading (how many of its replicas are healthy) and one line per replica."""
    healthy = sum(w["healthy"] for w in replicas)
    layers = next((f" layers [{w['layers'][0]}, {w['layers'][1]})" for w in replicas if w.get("layers")), "")
    heading = (f"stage {stage}{layers}: {healthy} of {len(replicas)} replica{'s' if len(replicas) != 1 else ''} "
               f"healthy" + ("  <- MISSING" if not healthy else ""))
    return [heading, *(_replica_line(w) for w in sorted(replicas, key=lambda w: w["address"]))]


def render_status(url: str, health: dict) -> str:
    """The fleet as text, from a coordinator's ``/health`` JSON: stages, their replicas, addresses,
    health, load and versions; then the workers that are no part of the pipeline: refused ones (another
    build or protocol) with the reason, and those that never answered."""
    fleet = health.get("fleet") or {}  # serve --model SOURCE: preparing, serving, re-planning or refused
    state = "ready" if health["ready"] else f"NOT READY, missing stage(s) {health['missing_stages']}"
    if not health["ready"] and fleet.get("state") in ("preparing", "replanning", "refused"):
        state = f"NOT READY, {fleet['state']}"
    manifest = health.get("manifest_sha256", "?")[:12]
    lines = [f"fleet at {url}: model {health['model']}, manifest {manifest}, protocol "
             f"{health.get('protocol_version', '?')}, {state}; requests running {health.get('running', '?')}, "
             f"queued {health.get('queued', '?')}"]
    if fleet:
        lines.append(f"planned fleet: {fleet.get('state')} for {fleet.get('phase_s', '?')} s"
                     + (f", {fleet['progress']}" if fleet.get("progress") else "")
                     + (f" ({fleet['reason']})" if fleet.get("reason") else "")
                     + f"; layers {fleet.get('layers') or '?'}, {fleet.get('replans', 0)} re-plan(s)")
    if "workers" not in health:  # a coordinator with API keys shows them only with a key (coordinator/api/access.py)
        return "\n".join([*lines, f"workers not shown: {health.get('workers_hidden', 'not in the answer')} "
                                   "(fleet-coordinator status --api-key KEY, or $FLEET_API_KEY)"])
    refused = [w for w in health["workers"] if w.get("refused")]
    silent = [w for w in health["workers"] if w["stage"] is None and not w.get("refused")]
    members = [w for w in health["workers"] if w["stage"] is not None and not w.get("refused")]
    stages = health.get("num_stages", 1 + max((w["stage"] for w in members), default=-1))
    for stage in range(stages):
        lines += _stage_lines(stage, [w for w in members if w["stage"] == stage])
    if refused:
        lines.append(f"refused (no part of the pipeline): {len(refused)} worker{'s' if len(refused) != 1 else ''}")
        lines += [f"  {w['address']:<21} REFUSED  {w['refused']}" for w in sorted(refused, key=lambda w: w["address"])]
    if silent:
        lines.append(f"not answering yet: {len(silent)} worker{'s' if len(silent) != 1 else ''}")
        lines += [f"  {w['address']:<21} no answer to its health checks yet, via {w['source']}"
                  for w in sorted(silent, key=lambda w: w["address"])]
    return "\n".join(lines)


class Status(BaseModel):
    """Print the fleet a coordinator sees: stages, replicas, addresses, health, load, versions."""

    url: str = Field("", description="coordinator base URL, e.g. http://192.168.1.20:8000 (default: zeroconf)")
    model: str | None = Field(None, description="with several coordinators on the LAN, the one serving this model")
    json_output: bool = Field(False, alias="json", description="print the coordinator's /health JSON instead")
    api_key: str = Field("", description="API key of a coordinator that has keys (default: $FLEET_API_KEY): "
                         "without it /health names no worker")

    def cli_cmd(self) -> None:
        import httpx

        from .chat.client import NoCoordinator, choose_api, discover_apis

        try:
            url = self.url or choose_api(discover_apis(), self.model, "fleet-coordinator status")
        except NoCoordinator as exc:
            print(exc, file=sys.stderr)
            sys.exit(1)
        try:
            key = self.api_key or os.environ.get("FLEET_API_KEY", "")
            r = httpx.get(f"{url.rstrip('/')}/health", timeout=10,
                          headers={"Authorization": f"Bearer {key}"} if key else None)
            health = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"fleet-coordinator status: cannot read {url}/health: {exc}", file=sys.stderr)
            sys.exit(1)
        print(json.dumps(health, indent=2) if self.json_output else render_status(url, health))
        sys.exit(0 if health.get("ready") else 3)


class FleetCoordinator(BaseModel):
    """fleet-coordinator: run the coordinator of a fleet."""

    serve: CliSubCommand[Serve] = Field(description="discover workers, assemble the pipeline, serve the OpenAI API")
    status: CliSubCommand[Status] = Field(description="print the fleet a running coordinator sees")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-coordinator`` console script."""
    try:
        CliApp.run(FleetCoordinator, cli_args=argv if argv is not None else sys.argv[1:])
    except ValidationError as exc:
        print(f"fleet-coordinator: error: {describe_validation_error(exc, skip=('serve',))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
