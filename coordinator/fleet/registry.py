"""Worker membership: zeroconf discovery + static peers, health checks, and pipeline assembly.

Several workers may serve one stage (replicas). Each new session gets the pipeline of the least
loaded worker per stage (sessions this coordinator has open there), so sessions spread across
replicas; pipelines are kept while their workers are healthy. A slow worker is told from a gone one
(issue 45): a refused or reset connection (any failed health check but a late one) is gone at once; a
health check that misses its deadline only makes the worker suspect (a laptop swapping, a GC pause, a
throttled CPU), and it is confirmed gone after ``missed_limit`` late checks in a row. Every pipeline
that uses a worker is closed the moment it is gone (its sessions then fail over, see ``Engine``); a
suspect's pipelines run on, each step waiting for its own deadline (``Pipeline.step``), and past it
for the verdict. Placement is per session, never per step, and passes a suspect by when another
worker serves its stage.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fleet_common import PROTOCOL_VERSION, SERVICE_TYPE
from fleet_common import fleet_pb2 as pb
from fleet_common.discovery import implausible_endpoint, printable, record_problem
from fleet_common.manifest import LoadedManifest

from ..errors import PipelineUnavailable, StageFailure, stage_lost, stages_phrase
from ..engine.pipeline import Channels, Pipeline

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # one announced address's Info answer (a PC with several: which one routes)
LOST_PROBE_S = 5.0  # a worker found by mDNS and dropped after missed health checks is asked this often again
LOST_FORGET_S = 600.0  # ... for this long (a cable back in, a link back up: it rejoins by itself)
NOTHING_HEARD_S = 5.0  # no worker heard by zeroconf this long after the start: say so, and which interfaces
RESOLVE_ATTEMPTS = 5  # tries to resolve an announced name (3 s each) before saying it was not resolved
PROBE_ROUNDS, PROBE_GAP_S = 3, 1.0  # an announced worker's bare Info asked this often, this far apart, before it is ignored
IGNORED_LOG_S = 60.0  # an ignored mDNS record is logged once per name this often at most (a LAN may repeat it)
_DNS_A, _DNS_SRV, _DNS_IN = 1, 33, 1  # DNS record types and class (RFC 1035, RFC 2782)


@dataclass
class WorkerState:
    """What the coordinator knows of one worker address."""

    address: str
    source: str  # "mdns" or "peer"
    info: pb.InfoReply | None = None
    healthy: bool = False
    refused: str | None = None  # why it may not join (wrong build / protocol)
    missed: int = 0  # health checks failed in a row
    late: int = 0  # health checks that missed their deadline (suspicion, not loss), counted for /health
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
        self._heard: dict[str, list[str]] = {}  # zeroconf service names resolved -> the addresses added for them
        self._lost: dict[str, tuple[int, float, float]] = {}  # mDNS address -> (stage, dropped at, next probe)
        self._ignored: dict[str, float] = {}  # zeroconf name -> when its record was last logged as ignored
        self.switching = False  # a re-plan (replan.py) loads another build's stages: refusals are expected
        self.planned = False  # serve --model SOURCE: empty workers are planned in, lost stages re-planned (replan.py)
        # called (address, seconds) when a worker answers after a longer gap than missed checks allow
        self.on_lease_gap: Callable[[str, float], None] | None = None

    # -- membership ----------------------------------------------------------------------------
    def add_peer(self, address: str, source: str = "peer") -> None:
        """Consider ``address`` (host:port); it joins once its Info RPC matches this build."""
        if source == "peer":
            self._static.add(address)
        if address not in self.workers:
            self.workers[address] = WorkerState(address, source)
            log.info("worker candidate %s (%s)", address, source)
        self._spawn(self._check(address))

    def refusal(self, address: str, info: pb.InfoReply, proven: bool = True) -> str | None:
        """Why the worker at ``address`` answering ``info`` cannot serve this coordinator's build, or None;
        ``proven`` False: its answer did not prove it holds the fleet's --secret (``Security.proven``)."""
        refused = None
        if not proven:
            refused = (f"refusing worker {address}: it does not hold this fleet's --secret (its Info answer proves "
                       "no key): no request goes through it")
        elif info.protocol_version != PROTOCOL_VERSION:
            refused = (f"refusing worker {address}: protocol version {info.protocol_version}, "
                       f"coordinator speaks {PROTOCOL_VERSION}")
        elif info.empty:  # an empty worker (issue 30): joins once a stage of this build is shipped to it and loaded
            capacity = (f"{info.memory_available_bytes / 2**30:.1f} GiB available, {printable(info.device)}, "
                        f"{info.ms_per_gb:.1f} ms per GB")
            refused = (f"worker {address} is empty ({capacity}): the re-planner plans it in when the model fits only "
                       "with it or decode gets faster (a stage is shipped to it then)" if self.planned else
                       f"worker {address} is empty ({capacity}): not used until a stage of this build is shipped to it "
                       "and loaded (fleet_common/shipping.py; serve --model SOURCE ships)")
        elif info.manifest_sha256 != self.loaded.sha256:
            refused = (f"refusing worker {address} (stage {info.stage}, model {info.model_id!r}): its manifest "
                       f"{info.manifest_sha256[:12]} differs from the coordinator's {self.loaded.sha256[:12]} "
                       f"({self.loaded.manifest.model_id!r})")
        elif info.stage >= self.num_stages:
            refused = f"refusing worker {address}: stage {info.stage} outside 0..{self.num_stages - 1}"
        return refused

    async def _check(self, address: str) -> None:
        state = self.workers.get(address)
        if state is None:
            return
        sent, challenge = time.perf_counter(), self.channels.security.challenge()
        try:  # a slow but healthy link gets a longer deadline (its measured round trip, with margin)
            ask = pb.InfoRequest(owner=self.channels.owner, challenge=challenge)
            info = await self.channels.stub(address).Info(
                ask, timeout=max(1.0, self.health_interval_s, 5 * state.rtt_s))
        except grpc.aio.AioRpcError as exc:
            state.missed += 1
            if self._suspected(state, exc):
                return
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
                if state.source == "mdns" and state.info is not None:  # no new announcement comes when a link is back
                    now = time.monotonic()
                    self._lost[address] = (state.info.stage, now, now + LOST_PROBE_S)
            if state.info is not None:  # only a worker with info can be in a pipeline
                await self._invalidate_if_uses(address, stage_lost(
                    state.info.stage, address, f"health check: {exc.code().name}: {exc.details()}"))
            return
        if state.info is not None and state.info.worker_id != info.worker_id and state.healthy:
            log.warning("worker %s restarted (was %s, now %s): its sessions are gone", address,
                        printable(state.info.worker_id), printable(info.worker_id))
            await self._invalidate_if_uses(address, stage_lost(
                info.stage, address, f"worker id {printable(state.info.worker_id)} -> {printable(info.worker_id)}",
                how="restarted and lost this request's state"))
        alias = next((w for w in self.workers.values() if w is not state and w.healthy and w.info is not None
                      and w.info.worker_id == info.worker_id), None)
        if alias is not None and address not in self._static:  # one worker, two of its addresses announced
            log.info("worker %s is %s (worker id %s): one entry kept", address, alias.address,
                     printable(info.worker_id))
            self.workers.pop(address, None)
            await self.channels.drop(address)
            return
        rtt = time.perf_counter() - sent
        state.rtt_s = rtt if not state.rtt_s else 0.7 * state.rtt_s + 0.3 * rtt
        gap = time.monotonic() - state.last_seen if state.last_seen else 0.0
        state.info, state.missed, state.last_seen = info, 0, time.monotonic()
        if gap > self.missed_limit * self.health_interval_s + 1.0 and self.on_lease_gap is not None:
            self.on_lease_gap(address, gap)  # this coordinator stood still: the worker may have freed its sessions
        refused = self.refusal(address, info, self.channels.security.proven(challenge, info.worker_id, info.proof))
        if refused != state.refused:
            if refused:  # a worker of another fleet on the LAN is no error; a --peer named by hand is
                level = logging.ERROR if state.source == "peer" else logging.WARNING
                level = logging.INFO if info.empty and self.planned else level  # planned in (replan.py)
                log.log(logging.INFO if self.switching else level, "%s%s", refused,
                        " (a re-plan is switching the workers to another build)" if self.switching else "")
            state.refused = refused
        was_healthy = state.healthy
        state.healthy = refused is None
        if state.healthy and not was_healthy:
            log.info("worker %s joined: stage %d layers [%d, %d) on %s (id %s)", address, info.stage,
                     info.layer_start, info.layer_end, printable(info.device), printable(info.worker_id))
            host = address.rsplit(":", 1)[0]
            for ghost in [w for w in self.workers.values() if w is not state and not w.healthy and w.info is not None
                          and w.info.stage == info.stage and w.address.rsplit(":", 1)[0] == host
                          and w.address not in self._static]:
                log.info("worker %s replaces %s (stage %d on the same host, not answering)", address, ghost.address,
                         info.stage)  # a restarted worker on a new port: no ghost entry left behind
                self.workers.pop(ghost.address, None)
            for lost in [a for a, (stage, _, _) in self._lost.items() if stage == info.stage
                         and a.rsplit(":", 1)[0] == host]:
                del self._lost[lost]  # its replacement is here: stop asking the old address
            await self._drop_pipelines(lambda p: not p.healthy)
        elif not state.healthy and was_healthy:
            await self._invalidate_if_uses(address, state.refused or f"worker {address} refused")

    def _suspected(self, state: WorkerState, exc: grpc.aio.AioRpcError) -> bool:
        """Whether ``state``'s failed health check (``exc``) only makes it suspect: a healthy worker answered
        late (DEADLINE_EXCEEDED), fewer than ``missed_limit`` times in a row. It stays healthy, its
        pipelines run on; anything else (refused, reset, a wrong answer) or the last late check allowed is
        a loss, which the caller handles."""
        if not (state.healthy and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and state.missed < self.missed_limit):
            return False
        state.late += 1
        log.warning("worker %s (stage %s) is late for a health check (%d in a row, gone at %d): kept as slow, "
                    "its steps wait for their own deadlines", state.address,
                    state.info.stage if state.info else "?", state.missed, self.missed_limit)
        return True

    async def _invalidate_if_uses(self, address: str, reason: StageFailure | str) -> None:
        await self._drop_pipelines(lambda p: address in p.addresses, reason)

    async def _drop_pipelines(self, which, reason: StageFailure | str = "pipeline closed") -> None:  # noqa: ANN001
        """Close (and forget) every pipeline for which ``which(pipeline)`` is true. Health checks run
        this concurrently: each closes only the pipelines it took out itself."""
        for key, pipeline in list(self._pipelines.items()):
            if self._pipelines.get(key) is pipeline and which(pipeline):
                del self._pipelines[key]
                await pipeline.close(reason)

    async def use_build(self, loaded: LoadedManifest) -> None:
        """Serve ``loaded``, another build of the same model (a re-plan: coordinator/fleet/replan.py): every pipeline
        of the old build is closed and each worker is checked against the new manifest now (those shipped and
        loaded a stage of it join; the others are refused as of another build)."""
        self.loaded, self.num_stages = loaded, loaded.manifest.num_stages
        await self._drop_pipelines(lambda p: True, "the fleet was re-planned onto another build")
        for state in self.workers.values():
            state.healthy = False
        await asyncio.gather(*(self._check(a) for a in list(self.workers)), return_exceptions=True)

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
        """One healthy worker per stage: one not suspect (late for its last health check) first, then the
        least loaded (sessions this coordinator has open there, then sessions the worker reports, then
        address); raises ``PipelineUnavailable`` naming gaps."""
        missing = self.missing_stages()
        if missing:
            raise PipelineUnavailable(self.missing_message(missing))
        return [min(self.replicas(stage), key=lambda s: (s.missed > 0, self.load(s.address), s.info.sessions,
                                                        s.address)).address
                for stage in range(self.num_stages)]

    def missing_message(self, missing: list[int]) -> str:
        """What a user should do about ``missing`` stages, in one sentence."""
        stages = stages_phrase(missing, self.num_stages)
        last_seen = [f"{w.address}" for w in self.workers.values()
                     if w.info is not None and w.info.stage in missing and not w.refused]
        seen = f" (last seen at {', '.join(sorted(last_seen))})" if last_seen else ""
        if self.planned:  # serve --model SOURCE: the stage comes back by a re-plan, not by a --shard worker
            return (f"no healthy worker serves {stages}{seen}: the coordinator re-plans over the workers answering "
                    "(start an empty `fleet-worker` on a PC if too few are left), then send the request again")
        commands = " and ".join(f"`fleet-worker --shard {s} --model <build>`" for s in missing)
        return (f"no healthy worker serves {stages}{seen}: start {commands} on a PC of "
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
                pipeline.vocab_size = self.loaded.manifest.architecture.vocab_size
                # late for a health check, or found gone (this pipeline is being closed: its steps fail then)
                pipeline.suspect = lambda: any(a not in self.workers or self.workers[a].missed for a in addresses)
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

    async def start(self, discover: bool, report_silence: bool = True) -> None:
        """Begin health checks (and zeroconf browsing when ``discover``; ``report_silence``: warn when no
        worker is heard for a while, which says multicast does not pass, unless the fleet runs its own
        local workers, which are never announced)."""
        self._spawn(self._health_loop())
        if discover:
            from zeroconf import IPVersion, ServiceStateChange
            from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

            self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

            def on_change(zeroconf, service_type, name, state_change) -> None:  # noqa: ANN001
                if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
                    self._spawn(self._resolve(name))
                elif state_change is ServiceStateChange.Removed:  # withdrawn (stopped): no need to ask it again
                    for address in self._heard.pop(name, []):
                        self._lost.pop(address, None)

            self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
            log.info("browsing zeroconf for workers (%s, mDNS on UDP 5353) on %s", SERVICE_TYPE, _interfaces())
            if report_silence:
                self._spawn(self._report_silence())

    async def _report_silence(self) -> None:
        await asyncio.sleep(NOTHING_HEARD_S)
        if not self._heard:
            log.warning("zeroconf: no worker heard in %.0f s on %s; if workers run, multicast (mDNS, UDP 5353) does "
                        "not pass between them and this PC (a firewall, VPN or Wi-Fi client isolation): name them with "
                        "--peer host:port", NOTHING_HEARD_S, _interfaces())

    async def _resolve(self, name: str) -> None:
        """Add the worker(s) behind a zeroconf service ``name``: of the addresses announced, the ones that
        answer (a PC with several networks announces some this coordinator cannot reach); every worker
        announcing that same name (cloned PCs) is added, and the collision logged."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE_TYPE, name)
        for attempt in range(RESOLVE_ATTEMPTS):  # the browser reports a name once: a lost answer is asked again
            if await info.async_request(self._zc.zeroconf, 3000):
                break
            if name in self._heard or attempt == RESOLVE_ATTEMPTS - 1:
                log.warning("zeroconf: %s announced but not resolved (no SRV/TXT/address answer in %d tries of 3 s)",
                            name, attempt + 1)
                return
        if (problem := record_problem(info.properties, info.port)) is not None:  # a hint anyone on the LAN can send
            self._ignore(name, problem)
            return
        added = self._heard.setdefault(name, [])
        endpoints = [f"{h}:{info.port}" for h in info.parsed_addresses(IPVersion.V4Only)]
        cache = self._zc.zeroconf.cache
        for srv in cache.async_all_by_details(name, _DNS_SRV, _DNS_IN):  # one per worker when clones share the name
            for a in cache.async_all_by_details(srv.server, _DNS_A, _DNS_IN):
                if f"{socket.inet_ntoa(a.address)}:{srv.port}" not in endpoints:
                    endpoints.append(f"{socket.inet_ntoa(a.address)}:{srv.port}")
        bad = {e: why for e in endpoints if (why := implausible_endpoint(*_split(e)))}
        endpoints = [e for e in endpoints if e not in bad]
        if not endpoints:
            self._ignore(name, "it announces no address a LAN worker has" + "".join(
                f"; {e}: {why}" for e, why in bad.items()) + " (the coordinator dials IPv4 LAN addresses only)")
            return
        found = await self._answering(endpoints)  # a bare Info first (no lease, no challenge): a fleet worker's?
        for _ in range(PROBE_ROUNDS - 1):
            if found:
                break
            await asyncio.sleep(PROBE_GAP_S)
            found = await self._answering(endpoints)
        if not found:
            self._ignore(name, f"it announced {', '.join(endpoints)} and none answers Info as a fleet worker of "
                               f"protocol {PROTOCOL_VERSION} within {PROBE_TIMEOUT_S:g} s ({PROBE_ROUNDS} tries; a "
                               "worker must announce an address this coordinator routes to: fleet-worker "
                               "--advertise-addr)")
            return
        if len(found) > 1:
            log.warning("%d workers announce the same name %s (cloned PCs?): %s; each is used", len(found), name,
                        ", ".join(f"{a} (id {w})" for w, a in found.items()))
        elif len(endpoints) > 1:
            log.info("worker %s announced %s: reachable at %s", name, ", ".join(endpoints), next(iter(found.values())))
        if added and (new := [a for a in found.values() if a not in added]):  # answers of clones, one at a time
            log.warning("zeroconf name %s now answers at %s, before at %s: two workers announce one name (cloned "
                        "PCs?) or one moved; each is used", name, ", ".join(new), ", ".join(added))
        for address in found.values():
            if address not in added:
                added.append(address)
            self.add_peer(address, "mdns")

    def _ignore(self, name: str, why: str) -> None:
        """Log that the mDNS record ``name`` is ignored and ``why``: once per ``IGNORED_LOG_S`` per name."""
        now = time.monotonic()
        if now - self._ignored.get(name, -IGNORED_LOG_S) >= IGNORED_LOG_S:
            self._ignored[name] = now
            log.warning("zeroconf: ignoring %s: %s", printable(name, 200), why)

    async def _answering(self, endpoints: list[str]) -> dict[str, str]:
        """Worker id -> its first address (in ``endpoints`` order) that answers a bare Info RPC (no owner: no
        lease renewed; no challenge) within ``PROBE_TIMEOUT_S`` as a fleet worker does: a worker id and this
        coordinator's protocol version."""
        async def probe(address: str) -> str | None:
            try:
                reply = await self.channels.stub(address).Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                reply = None
            if reply is not None and reply.worker_id and reply.protocol_version == PROTOCOL_VERSION:
                return reply.worker_id
            if address not in self.workers:
                await self.channels.drop(address)
            return None

        found: dict[str, str] = {}
        for address, worker_id in zip(endpoints, await asyncio.gather(*(probe(e) for e in endpoints))):
            if worker_id is not None:
                found.setdefault(worker_id, address)
        return found

    async def _probe_lost(self, address: str) -> None:
        """Ask a dropped mDNS worker again; it rejoins when it answers (its announcement is not repeated)."""
        try:
            await self.channels.stub(address).Info(pb.InfoRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            await self.channels.drop(address)
            return
        if self._lost.pop(address, None) is not None and address not in self.workers:
            log.info("worker %s answers again: rejoining", address)
            self.add_peer(address, "mdns")

    async def _health_loop(self) -> None:
        while True:
            now = time.monotonic()
            for address, (stage, dropped, due) in list(self._lost.items()):
                if now - dropped > LOST_FORGET_S:
                    del self._lost[address]
                    log.info("worker %s (stage %d) forgotten: not answering for %.0f s", address, stage, now - dropped)
                elif now >= due:
                    self._lost[address] = (stage, dropped, now + LOST_PROBE_S)
                    self._spawn(self._probe_lost(address))
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


def _split(endpoint: str) -> tuple[str, int]:
    """``"10.0.0.5:50051"`` -> ``("10.0.0.5", 50051)``."""
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def _interfaces() -> str:
    """This PC's IPv4 interfaces (name and address), as zeroconf browses them: "eth0 10.0.0.5, lo 127.0.0.1"."""
    import psutil

    return ", ".join(f"{name} {a.address}" for name, addrs in sorted(psutil.net_if_addrs().items())
                     for a in addrs if a.family == socket.AF_INET) or "no IPv4 interface"
