"""Worker membership: zeroconf discovery + static peers, health checks, and pipeline assembly.

Several workers may serve one stage (replicas). Each new session gets the pipeline of the least
loaded worker per stage (sessions this coordinator has open there), so sessions spread across
replicas; pipelines are kept while their workers are healthy, and every pipeline that uses a worker
is closed the moment that worker fails a health check (its sessions then fail over, see
``Engine``). Placement is per session, never per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from fleet_common import PROTOCOL_VERSION, SERVICE_TYPE
from fleet_common import fleet_pb2 as pb
from fleet_common.discovery import decode_txt
from fleet_common.manifest import LoadedManifest

from .errors import PipelineUnavailable, StageFailure, stage_lost
from .pipeline import Channels, Pipeline

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """What the coordinator knows of one worker address."""

    address: str
    source: str  # "mdns" or "peer"
    info: pb.InfoReply | None = None
    healthy: bool = False
    refused: str | None = None  # why it may not join (wrong build / protocol)
    missed: int = 0
    last_seen: float = 0.0
    rtt_s: float = 0.0  # health-check round trip, moving average (seconds): link latency + Info's cost


class Registry:
    """Tracks workers and hands out pipelines (stage i -> one healthy worker, the least loaded)."""

    def __init__(self, loaded: LoadedManifest, channels: Channels, health_interval_s: float = 1.0,
                 missed_limit: int = 3) -> None:
        self.loaded = loaded
        self.num_stages = loaded.manifest.num_stages
        self.channels = channels
        self.health_interval_s = health_interval_s
        self.missed_limit = missed_limit
        self.workers: dict[str, WorkerState] = {}
        self._static: set[str] = set()
        self._pipelines: dict[tuple[str, ...], Pipeline] = {}
        self._assemble_lock = asyncio.Lock()
        self._zc = None
        self._browser = None
        self._tasks: set[asyncio.Task] = set()

    # -- membership ----------------------------------------------------------------------------
    def add_peer(self, address: str, source: str = "peer") -> None:
        """Consider ``address`` (host:port); it joins once its Info RPC matches this build."""
        if source == "peer":
            self._static.add(address)
        if address not in self.workers:
            self.workers[address] = WorkerState(address, source)
            log.info("worker candidate %s (%s)", address, source)
        self._spawn(self._check(address))

    async def _check(self, address: str) -> None:
        state = self.workers.get(address)
        if state is None:
            return
        sent = time.perf_counter()
        try:  # a slow but healthy link gets a longer deadline (its measured round trip, with margin)
            info = await self.channels.stub(address).Info(
                pb.InfoRequest(), timeout=max(1.0, self.health_interval_s, 5 * state.rtt_s))
        except grpc.aio.AioRpcError as exc:
            state.missed += 1
            if state.healthy:
                log.warning("worker %s (stage %s) failed a health check: %s", address,
                            state.info.stage if state.info else "?", exc.code().name)
            state.healthy = False
            # the channel stays: it reconnects to a restarted worker within 2 s (wire.GRPC_OPTIONS), and
            # closing it would cancel calls that another task already runs over a fresh connection
            if state.missed >= self.missed_limit and address not in self._static:
                log.warning("worker %s dropped after %d missed health checks", address, state.missed)
                self.workers.pop(address, None)
                await self.channels.drop(address)
            if state.info is not None:  # only a worker with info can be in a pipeline
                await self._invalidate_if_uses(address, stage_lost(
                    state.info.stage, address, f"health check: {exc.code().name}: {exc.details()}"))
            return
        if state.info is not None and state.info.worker_id != info.worker_id and state.healthy:
            log.warning("worker %s restarted (was %s, now %s): its sessions are gone", address,
                        state.info.worker_id, info.worker_id)
            await self._invalidate_if_uses(address, stage_lost(
                info.stage, address, f"worker id {state.info.worker_id} -> {info.worker_id}",
                how="restarted and lost this request's state"))
        rtt = time.perf_counter() - sent
        state.rtt_s = rtt if not state.rtt_s else 0.7 * state.rtt_s + 0.3 * rtt
        state.info, state.missed, state.last_seen = info, 0, time.monotonic()
        refused = None
        if info.protocol_version != PROTOCOL_VERSION:
            refused = (f"refusing worker {address}: protocol version {info.protocol_version}, "
                       f"coordinator speaks {PROTOCOL_VERSION}")
        elif info.manifest_sha256 != self.loaded.sha256:
            refused = (f"refusing worker {address} (stage {info.stage}, model {info.model_id!r}): its manifest "
                       f"{info.manifest_sha256[:12]} differs from the coordinator's {self.loaded.sha256[:12]} "
                       f"({self.loaded.manifest.model_id!r})")
        elif info.stage >= self.num_stages:
            refused = f"refusing worker {address}: stage {info.stage} outside 0..{self.num_stages - 1}"
        if refused != state.refused:
            if refused:
                log.error("%s", refused)
            state.refused = refused
        was_healthy = state.healthy
        state.healthy = refused is None
        if state.healthy and not was_healthy:
            log.info("worker %s joined: stage %d layers [%d, %d) on %s (id %s)", address, info.stage,
                     info.layer_start, info.layer_end, info.device, info.worker_id)
            host = address.rsplit(":", 1)[0]
            for ghost in [w for w in self.workers.values() if w is not state and not w.healthy and w.info is not None
                          and w.info.stage == info.stage and w.address.rsplit(":", 1)[0] == host
                          and w.address not in self._static]:
                log.info("worker %s replaces %s (stage %d on the same host, not answering)", address, ghost.address,
                         info.stage)  # a restarted worker on a new port: no ghost entry left behind
                self.workers.pop(ghost.address, None)
            await self._drop_pipelines(lambda p: not p.healthy)
        elif not state.healthy and was_healthy:
            await self._invalidate_if_uses(address, state.refused or f"worker {address} refused")

    async def _invalidate_if_uses(self, address: str, reason: StageFailure | str) -> None:
        await self._drop_pipelines(lambda p: address in p.addresses, reason)

    async def _drop_pipelines(self, which, reason: StageFailure | str = "pipeline closed") -> None:  # noqa: ANN001
        """Close (and forget) every pipeline for which ``which(pipeline)`` is true. Health checks run
        this concurrently: each closes only the pipelines it took out itself."""
        for key, pipeline in list(self._pipelines.items()):
            if self._pipelines.get(key) is pipeline and which(pipeline):
                del self._pipelines[key]
                await pipeline.close(reason)

    async def recheck(self, addresses: list[str]) -> None:
        """Health-check ``addresses`` now (after a failed step): a dead or refusing worker is marked
        unhealthy and every pipeline that uses it closed, before the next placement."""
        await asyncio.gather(*(self._check(a) for a in addresses if a in self.workers and self.workers[a].healthy),
                             return_exceptions=True)

    def load(self, address: str) -> int:
        """Sessions this coordinator has open on ``address`` (over all its pipelines)."""
        return sum(len(p.sessions) for p in self._pipelines.values() if p.healthy and address in p.addresses)

    def missing_stages(self) -> list[int]:
        have = {s.info.stage for s in self.workers.values() if s.healthy and s.info is not None}
        return [i for i in range(self.num_stages) if i not in have]

    def replicas(self, stage: int) -> list[WorkerState]:
        """The healthy workers serving ``stage``."""
        return [s for s in self.workers.values() if s.healthy and s.info is not None and s.info.stage == stage]

    def placement(self) -> list[str]:
        """One healthy worker per stage, the least loaded (sessions this coordinator has open there,
        then sessions the worker reports, then address); raises ``PipelineUnavailable`` naming gaps."""
        missing = self.missing_stages()
        if missing:
            raise PipelineUnavailable(self.missing_message(missing))
        return [min(self.replicas(stage), key=lambda s: (self.load(s.address), s.info.sessions, s.address)).address
                for stage in range(self.num_stages)]

    def missing_message(self, missing: list[int]) -> str:
        """What a user should do about ``missing`` stages, in one sentence."""
        stages = f"stage {missing[0]}" if len(missing) == 1 else "stages " + ", ".join(map(str, missing))
        commands = " and ".join(f"`fleet-worker --shard {s} --model <build>`" for s in missing)
        last_seen = [f"{w.address}" for w in self.workers.values()
                     if w.info is not None and w.info.stage in missing and not w.refused]
        seen = f" (last seen at {', '.join(sorted(last_seen))})" if last_seen else ""
        return (f"no healthy worker serves {stages} of {self.num_stages}{seen}: start {commands} on a PC of "
                "the fleet (or pass its host:port with --peer), then send the request again")

    async def pipeline(self) -> Pipeline:
        """A pipeline for a new session: the current placement's, assembled on first use. Raises
        ``PipelineUnavailable`` when a stage has no healthy worker, ``StageFailure`` when the last
        stage does not accept the result stream."""
        async with self._assemble_lock:
            await self._drop_pipelines(lambda p: not p.healthy)
            addresses = tuple(self.placement())
            pipeline = self._pipelines.get(addresses)
            if pipeline is None:
                pipeline = await Pipeline.connect(list(addresses), self.channels, self.loaded.sha256)
                pipeline.link_rtt_s = lambda: sum(self.workers[a].rtt_s for a in addresses if a in self.workers)
                self._pipelines[addresses] = pipeline
                log.info("pipeline assembled: %s", " -> ".join(addresses))
            return pipeline

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every stage has a healthy worker; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.missing_stages():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    # -- background ----------------------------------------------------------------------------
    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("registry task failed", exc_info=task.exception())

    async def start(self, discover: bool) -> None:
        """Begin health checks (and zeroconf browsing when ``discover``)."""
        self._spawn(self._health_loop())
        if discover:
            from zeroconf import IPVersion, ServiceStateChange
            from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

            self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

            async def resolve(name: str) -> None:
                info = AsyncServiceInfo(SERVICE_TYPE, name)
                if not await info.async_request(self._zc.zeroconf, 3000):
                    log.debug("could not resolve %s", name)
                    return
                for host in info.parsed_addresses(IPVersion.V4Only):
                    try:
                        ad = decode_txt(info.properties, host, info.port)
                    except ValueError as exc:
                        log.warning("%s", exc)
                        return
                    self.add_peer(ad.address, "mdns")
                    return

            def on_change(zeroconf, service_type, name, state_change) -> None:  # noqa: ANN001
                if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
                    self._spawn(resolve(name))

            self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(a) for a in list(self.workers)), return_exceptions=True)
            await asyncio.sleep(self.health_interval_s)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._drop_pipelines(lambda p: True)
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            await self._zc.async_close()
