"""``fleet-coordinator serve``: discover workers, assemble the pipeline, serve the OpenAI API."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time

import uvicorn
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import CliApp, CliSubCommand

from fleet_common import API_SERVICE_TYPE, PROTOCOL_VERSION
from fleet_common.cli import describe_validation_error, dump_tasks_on_signal
from fleet_common.manifest import ManifestError, load_manifest

from .api import create_app
from .engine import Engine
from .pipeline import Channels
from .registry import Registry
from .settings import CoordinatorSettings
from .tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


async def _announce_api(host: str, port: int, model_id: str):  # noqa: ANN202
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    loopback = host in ("127.0.0.1", "localhost")
    ip = "127.0.0.1" if loopback else socket.gethostbyname(socket.gethostname())
    zc = AsyncZeroconf(interfaces=["127.0.0.1"] if loopback else InterfaceChoice.All, ip_version=IPVersion.V4Only)
    info = AsyncServiceInfo(API_SERVICE_TYPE, f"fleet-{socket.gethostname()}-{port}.{API_SERVICE_TYPE}",
                            addresses=[socket.inet_aton(ip)], port=port, properties={"model": model_id[:120]},
                            server=f"{socket.gethostname()}.local.")
    await zc.async_register_service(info, allow_name_change=True)
    return zc, info


async def serve(settings: CoordinatorSettings) -> None:
    """Run the coordinator until interrupted (SIGUSR1 logs what every task awaits). Raises
    ``ManifestError`` for a bad build folder."""
    dump_tasks_on_signal()
    loaded = load_manifest(settings.model)
    tokenizer = ChatTokenizer(settings.model)
    channels = Channels(settings.security)
    registry = Registry(loaded, channels, settings.health_interval_s, settings.missed_health_checks)
    engine = Engine(settings, loaded, registry, tokenizer)  # first: a bad --draft fails before workers start
    local = None
    if settings.local_workers:
        from .local import LocalWorkers

        if settings.local_workers != loaded.manifest.num_stages:
            raise ManifestError(f"--local-workers {settings.local_workers}: this build has "
                                f"{loaded.manifest.num_stages} stages; start one worker per stage")
        local = LocalWorkers(settings.model, loaded.manifest.num_stages, settings.worker_threads,
                             settings.inference_precision, security=settings.security)
        await local.start()
        for address in local.addresses:
            registry.add_peer(address)
    for peer in settings.peer:
        registry.add_peer(peer)
    await registry.start(discover=settings.discover)

    def health() -> dict:
        now = time.monotonic()

        def worker(w) -> dict:  # noqa: ANN001 - registry.WorkerState
            entry = {"address": w.address, "source": w.source, "healthy": w.healthy, "refused": w.refused,
                     "missed_health_checks": w.missed, "load": registry.load(w.address),
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

        return {
            "ready": not registry.missing_stages(),
            "model": engine.model_name,
            "manifest_sha256": loaded.sha256,
            "num_stages": loaded.manifest.num_stages,
            "protocol_version": PROTOCOL_VERSION,
            "missing_stages": registry.missing_stages(),
            "queued": engine._queued,
            "running": engine.running,
            "workers": [worker(w) for w in list(registry.workers.values())],
        }

    def state() -> dict:
        return {"queued": engine._queued, "running": engine.running, "workers": [
            {"address": w.address, "stage": w.info.stage, "healthy": int(w.healthy), "sessions": w.info.sessions,
             "sequences": w.info.sequences, "kv_bytes": w.info.kv_bytes, "kv_reserved_bytes": w.info.kv_reserved_bytes,
             "kv_budget_bytes": w.info.kv_budget_bytes, "busy": w.info.busy}
            for w in list(registry.workers.values()) if w.info is not None]}

    engine.metrics.watch(state)
    app = create_app(engine, health)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            access_log=False)
    server = uvicorn.Server(config)
    zc = None
    try:
        async def report_ready() -> None:
            if await registry.wait_ready(120):
                log.info("fleet ready: %d stages, %s", loaded.manifest.num_stages, " -> ".join(registry.placement()))
            else:
                log.warning("still missing stage(s) %s after 120 s", registry.missing_stages())

        ready_task = asyncio.create_task(report_ready())
        if settings.announce:
            zc = await _announce_api(settings.host, settings.port, engine.model_name)
        await server.serve()
        ready_task.cancel()
    finally:
        try:
            if local is not None:
                await local.stop()
        finally:
            if zc is not None:
                await zc[0].async_unregister_service(zc[1])
                await zc[0].async_close()
            await registry.stop()
            await channels.close()
            engine.close()


class Serve(CoordinatorSettings):
    """Discover workers, assemble the pipeline and serve the OpenAI-compatible API."""

    def cli_cmd(self) -> None:
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(levelname)s coordinator %(name)s: %(message)s")
        try:
            asyncio.run(serve(CoordinatorSettings(**self.model_dump())))
        except ManifestError as exc:
            log.error("%s", exc)
            sys.exit(2)


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
    state = "ready" if health["ready"] else f"NOT READY, missing stage(s) {health['missing_stages']}"
    lines = [f"fleet at {url}: model {health['model']}, manifest {health['manifest_sha256'][:12]}, protocol "
             f"{health.get('protocol_version', '?')}, {state}; requests running {health.get('running', '?')}, "
             f"queued {health.get('queued', '?')}"]
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
    json_output: bool = Field(False, alias="json", description="print the coordinator's /health JSON instead")

    def cli_cmd(self) -> None:
        import httpx

        from .chat import discover_api

        url = self.url or discover_api()
        if not url:
            print("fleet-coordinator status: no coordinator found with zeroconf; pass --url http://HOST:PORT",
                  file=sys.stderr)
            sys.exit(1)
        try:
            r = httpx.get(f"{url.rstrip('/')}/health", timeout=10)
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
