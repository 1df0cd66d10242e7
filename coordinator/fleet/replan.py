"""Re-planning a planned fleet (issue 30 item 3): when a stage of a ``serve --model SOURCE`` fleet has no worker
left, the coordinator plans again over the workers still answering (the same planner, build cache and shipping
as at its start: coordinator/fleet/planned.py), builds what the new plan needs, ships it, switches the registry
to the new build and serves again.

``Replanner`` owns the fleet's state (``FleetState``): SERVING, REPLANNING (with a progress line and the
reason) or REFUSED (the remaining workers cannot hold the model: the planner's reason, naming the PC and the
bytes; requests are refused with it until a worker comes or comes back). The engine asks ``settle`` when a
placement finds a stage missing: the request waits there (new ones and failed-over ones alike) instead of
failing. The build runs in a thread, so the event loop keeps serving ``/health`` and streams meanwhile.

A worker that joins a serving fleet (empty, answering the registry, not in the plan) is planned in only when
``join_decision`` says so (``worth_replanning``: the model fits now and did not, or decode is faster by
``SPEEDUP`` by the planner's own prediction). Its plan is built and shipped while the fleet serves on
(``_prepare_join``: files only, nothing loaded); only then do new requests wait (``holding``), while the
answers in flight finish (``_drain``: a worker serves one stage, so the old pipeline must be idle before its
workers load the new one) and the same re-plan runs, quick now (built, shipped).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fleet_common.manifest import load_manifest

from ..errors import PipelineUnavailable, stages_phrase
from .planned import (PlannedFleet, answering, build_cache, build_for_plan, plan_source, plan_without_small,
                            ship_lines, ship_plan)

if TYPE_CHECKING:
    from compiler.planner import ModelSource, Plan

    from fleet_common.discovery import Capacity

    from .registry import Registry
    from ..settings import CoordinatorSettings

log = logging.getLogger(__name__)

SPEEDUP = 0.15  # a plan replaces a working one only when its predicted ms per token is this much lower
REFUSED_RETRY_S = 30.0  # a refused fleet tries again this often (at once when the workers answering change)
# the re-plan's Info round: a worker that is only busy (its health checks late) must get to answer, or the fleet
# re-plans around a PC it still has; a dead one on the LAN refuses the connection at once
REPLAN_INFO_TIMEOUT_S = 10.0
REPLAN_ATTEMPTS = 3  # a re-plan whose workers leave while it runs plans again over who is left, this often in all
LOAD_RETRIES = 20  # LoadStage refused while a worker still holds sessions of the old build: tries, a second apart


class FleetState(enum.Enum):
    """Where a planned fleet stands (``/health`` ``fleet.state``)."""

    SERVING = "serving"
    REPLANNING = "replanning"  # a stage has no worker: waiting for it, then planning, building, shipping
    REFUSED = "refused"  # the workers left cannot hold the model (or the re-plan failed): requests get the reason


def worth_replanning(current: Plan | None, new: Plan | None, speedup: float = SPEEDUP) -> str | None:
    """Why ``new`` (the plan over the workers now, None when the model does not fit them) should replace
    ``current`` (the plan served, None when the model did not fit), or None to keep ``current``: the model
    fits now and did not, or ``new``'s predicted ms per token (its slowest stage's, the planner's model) is at
    least ``speedup`` (0.15: 15 %) below ``current``'s."""
    if new is None:
        return None
    if current is None:
        return f"the model fits the fleet now ({new.layers})"
    old_ms, new_ms = current.bottleneck.ms_per_token, new.bottleneck.ms_per_token
    if old_ms is None or new_ms is None:  # relative speeds: the same comparison on the slowest stage's cost
        old_ms, new_ms = current.bottleneck.cost, new.bottleneck.cost
    if new_ms <= (1.0 - speedup) * old_ms:
        return (f"decode {old_ms:.2f} -> {new_ms:.2f} ms per token by the plan "
                f"({(1 - new_ms / old_ms) * 100:.0f} % faster)")
    return None


def join_decision(source: ModelSource, workers: dict[str, Capacity],
                  current: Plan | None) -> tuple[str | None, Plan | None]:
    """A worker joined: (why to re-plan, or None to keep ``current``; the plan over ``workers``, or None when
    the model does not fit them). ``workers``: worker id -> capacity of every empty-started worker answering
    now, the new one included; ``current``: the plan served (None: the model did not fit the fleet before).
    The rule is ``worth_replanning``'s: the model fits now and did not, or decode is >= ``SPEEDUP`` faster."""
    try:
        new = plan_source(source, workers)
    except ValueError:  # PlanRefused (too small), or more workers than layers
        new = None
    return worth_replanning(current, new), new


class Replanner:
    """Keeps a planned fleet serving as its workers leave: detects a stage with no worker, re-plans over the
    workers still answering, builds, ships and switches the registry (module doc)."""

    def __init__(self, settings: CoordinatorSettings, fleet: PlannedFleet, registry: Registry,
                 free_retained: Callable[[], None] = lambda: None) -> None:
        self.settings, self.fleet, self.registry = settings, fleet, registry
        self.free_retained = free_retained  # frees the prefix cache's sessions (before a join's re-plan loads stages)
        self._joins_seen: frozenset = frozenset()  # joined workers already judged by join_decision
        self._odd_seen: set[tuple[str, str]] = set()  # (address, why) of joined workers left out, each said once
        self.state = FleetState.SERVING
        self.reason = ""  # why it re-plans or refuses
        self.progress = ""  # what it is doing now
        self.replans = 0  # re-plans applied
        self.last_replan_s: float | None = None  # the last one's time from the stage missing to serving again
        self._since = time.monotonic()  # when the current phase began
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._changed = asyncio.Event()  # set (and replaced) at every state change
        self._refused_key: frozenset | None = None  # who answered when it refused: a change retries
        self._armed = False  # every stage was served once: from then on a missing one is re-planned
        self._planned_over: dict[str, str] = {}  # worker id -> address of those the re-plan under way plans over

    # -- state -------------------------------------------------------------------------------------
    def _set(self, state: FleetState, progress: str = "", reason: str | None = None) -> None:
        if state is not self.state or reason is not None:
            why = (reason if reason is not None else self.reason) or "every stage served"
            log.log(logging.ERROR if state is FleetState.REFUSED else logging.INFO, "fleet %s: %s%s", state.value,
                    why, f" ({progress})" if progress else "")
        self.state, self.progress, self._since = state, progress, time.monotonic()
        if reason is not None:
            self.reason = reason
        self._changed.set()
        self._changed = asyncio.Event()

    def _step(self, progress: str) -> None:
        """A new phase of the re-plan (building, shipping stage i, ...), for ``/health`` and SSE comments."""
        log.info("re-planning: %s", progress)
        self.progress, self._since = progress, time.monotonic()

    def line(self) -> str:
        """The SSE comment's text while a request waits: ``<progress> (N s); <reason>``."""
        return f"{self.progress} ({time.monotonic() - self._since:.0f} s); {self.reason}"

    def status(self) -> dict:
        """``/health``'s ``fleet`` entry: the state, what it does now, why, the build served, re-plans so far."""
        return {"state": self.state.value, "progress": self.progress, "reason": self.reason,
                "phase_s": round(time.monotonic() - self._since, 1), "layers": self.fleet.plan.layers,
                "workers": sorted(a for a, _ in self.fleet.members.values()), "replans": self.replans,
                "last_replan_s": self.last_replan_s}

    @property
    def holding(self) -> bool:
        """Whether new requests wait (``settle``) rather than being placed: the fleet re-plans."""
        return self.state is FleetState.REPLANNING

    # -- detection ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin watching the registry every health interval (``stop`` ends it)."""
        self._watch = asyncio.ensure_future(self._watching())
        self._watch.add_done_callback(_log_failure)

    async def stop(self) -> None:
        """Stop watching and any re-plan under way."""
        for task in (self._watch, self._task):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._watch, self._task) if t is not None), return_exceptions=True)

    def _answering_key(self) -> frozenset:
        return frozenset((w.address, w.info.worker_id) for w in self.registry.workers.values()
                         if w.info is not None and w.missed == 0)

    def notice(self) -> None:
        """Start a re-plan when a stage has no healthy worker and none runs (a refused fleet: once the workers
        answering changed, or ``REFUSED_RETRY_S`` after it refused); back to SERVING when every stage is served
        again."""
        missing = self.registry.missing_stages()
        if not self._armed or (self._task is not None and not self._task.done()):
            return
        if not missing:
            if self.state is not FleetState.SERVING:
                self._set(FleetState.SERVING, reason="")
            return
        if (self.state is FleetState.REFUSED and self._answering_key() == self._refused_key
                and time.monotonic() - self._since < REFUSED_RETRY_S):
            return
        lost = sorted(w.address for w in self.registry.workers.values()
                      if w.info is not None and not w.info.empty and not w.healthy and w.info.stage in missing)
        self._set(FleetState.REPLANNING, "waiting for the worker to come back",
                  f"{stages_phrase(missing, self.registry.num_stages)} {'has' if len(missing) == 1 else 'have'} "
                  "no worker left"
                  + (f" (last at {', '.join(lost)})" if lost else ""))
        self._task = asyncio.ensure_future(self._run(time.monotonic()))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: say so and refuse, never hang requests
            log.error("re-planning failed", exc_info=task.exception())
            self._refused_key = self._answering_key()
            self._set(FleetState.REFUSED, reason=f"re-planning failed: {task.exception()!r}")

    async def _watching(self) -> None:
        while not await self.registry.wait_ready(60):  # the start: workers joining is no stage lost
            log.warning("re-planning not armed: %s not served yet",
                        stages_phrase(self.registry.missing_stages(), self.registry.num_stages))
        self._armed = True
        while True:
            try:
                self.notice()
                self.consider_joins()
            except Exception:  # a bug or a worker's odd answer: said, and the fleet is watched on (never left unwatched)
                log.exception("watching the fleet: this round failed; watching on")
            await asyncio.sleep(self.settings.health_interval_s)

    def _joined(self) -> dict[str, tuple[str, Capacity]]:
        """Empty workers answering the registry that the plan does not use (a --peer that came late, or one
        heard by mDNS): worker id -> (address, capacity)."""
        from fleet_common.discovery import Capacity, implausible, printable

        joined = {}
        for w in list(self.registry.workers.values()):
            if w.info is None or not w.info.empty or w.missed or w.info.worker_id in self.fleet.members:
                continue
            capacity = Capacity(w.info.memory_available_bytes, w.info.device, w.info.ms_per_gb)
            if (odd := implausible(capacity)) is None:
                joined[w.info.worker_id] = (w.address, capacity)
            elif (w.address, odd) not in self._odd_seen:
                self._odd_seen.add((w.address, odd))
                log.warning("worker %s at %s announces %s: not a measured capacity, not planned over",
                            printable(w.info.worker_id), w.address, odd)
        return joined

    def consider_joins(self) -> None:
        """A serving fleet that gained empty workers re-plans over them when ``join_decision`` says it pays
        (each set of joined workers judged once); the answers in flight finish first (``_drain``)."""
        joined = self._joined()
        if self.state is not FleetState.SERVING or (self._task is not None and not self._task.done()) \
                or not joined or frozenset(joined) == self._joins_seen:
            return
        self._joins_seen = frozenset(joined)
        workers = {w: c for w, (_, c) in (self.fleet.members | joined).items()}
        why, _ = join_decision(self.fleet.source, workers, self.fleet.plan)
        names = ", ".join(sorted(a for a, _ in joined.values()))
        if why is None:
            log.info("worker(s) %s joined: the plan stays (not faster by %.0f %% by the planner)", names, SPEEDUP * 100)
            return
        self.reason = f"worker(s) {names} joined: {why}"
        log.info("%s: preparing the new plan while the fleet serves on the current one", self.reason)
        self._task = asyncio.ensure_future(self._run(None))
        self._task.add_done_callback(self._done)

    async def _prepare_join(self) -> None:
        """A join's re-plan made ready while the fleet serves on (new requests are placed on the current plan):
        plan over the workers answering, build the plan (in a thread) and ship each worker its new stage's files,
        loading nothing. The switch (``_run``) then holds new requests only while the answers in flight finish and
        the stages load; it plans again from the workers answering then (the build cache and the files shipped
        make that quick). A failure here is said, and left to the switch."""
        s, fleet = self.settings, self.fleet
        try:
            addresses = sorted({a for a, _ in fleet.members.values()} | set(self.registry.workers))
            found, _ = await answering(addresses, s.security, s.peer, fleet.source.dims.model_id,
                                       REPLAN_INFO_TIMEOUT_S)
            p, found, _ = plan_without_small(fleet.source, found, "workers answering")
            self._step(f"serving on while building layers {p.layers}")
            build_dir = await asyncio.to_thread(build_for_plan, fleet.source_path, p, build_cache(s))
            targets = [found[st.node.name][0] for st in p.stages]
            await ship_plan(build_dir, targets, s.security, self._ship_progress(targets, "serving on while "),
                            load=False)
        except (ValueError, OSError, RuntimeError) as exc:  # PlanRefused, BuildError, ShippingError
            log.warning("re-planning (%s): preparing the new plan while serving failed (%s); the switch tries "
                        "again", self.reason, exc)

    def _ship_progress(self, addresses: list[str], prefix: str = ""):  # noqa: ANN202 - a ship_plan progress
        """``ship_plan``'s progress callback: each stage's shipping (``prefix`` first) in ``progress``."""
        def progress(stage: int, address: str):  # noqa: ANN202 - fleet_common.shipping.Progress
            self._step(f"{prefix}shipping {stages_phrase([stage], len(addresses))} to {address}")

            def on_bytes(path: str, done: int, total: int) -> None:
                self.progress = (f"{prefix}shipping {stages_phrase([stage], len(addresses))} to {address}: {path} "
                                 f"{done / 1e6:.0f} of {total / 1e6:.0f} MB")
            return on_bytes
        return progress

    async def _drain(self) -> None:
        """Wait (up to ``--replan-wait-s``) until this coordinator holds no session on any worker: new requests
        wait on ``settle`` meanwhile, the prefix cache's sessions are freed."""
        deadline = time.monotonic() + self.settings.replan_wait_s
        while time.monotonic() < deadline:
            self.free_retained()  # the answers finishing meanwhile are retained too
            if not any(self.registry.load(a) for a in list(self.registry.workers)):
                return
            await asyncio.sleep(0.1)

    async def settle(self, timeout_s: float) -> None:
        """Wait while the fleet re-plans, up to ``timeout_s``; returns once it serves every stage. Raises
        ``PipelineUnavailable`` with the reason when it refuses (or the re-plan outlasts the wait). Before the
        fleet first served every stage it returns at once (the caller's placement then fails as before)."""
        self.notice()
        if not self._armed:
            return
        deadline = time.monotonic() + timeout_s
        while not (self.state is FleetState.SERVING and not self.registry.missing_stages()):
            if self.state is FleetState.REFUSED:
                raise PipelineUnavailable(f"the fleet cannot serve the model: {self.reason}")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, min(1.0, deadline - time.monotonic())))
            except TimeoutError:
                self.notice()
            if time.monotonic() >= deadline:
                raise PipelineUnavailable(f"waited {timeout_s:.0f} s for the fleet to re-plan ({self.line()})")

    # -- the re-plan -------------------------------------------------------------------------------
    async def _run(self, missing_since: float | None) -> None:
        """Give the lost worker (``missing_since``) the registry's missed health checks to come back, or (None: a
        worker joined) let the answers in flight finish; then re-plan. A plan that does not fit, a failed build or
        shipping leave the fleet REFUSED with the reason (a join's failure before anything was loaded: SERVING)."""
        t0 = time.monotonic() if missing_since is None else missing_since
        grace = self.registry.missed_limit * self.registry.health_interval_s
        while missing_since is not None and time.monotonic() - missing_since < grace:
            if not self.registry.missing_stages():
                self._set(FleetState.SERVING, reason="")
                return
            await asyncio.sleep(0.2)
        if missing_since is None:
            await self._prepare_join()
            self._set(FleetState.REPLANNING, "letting the answers in flight finish")
            await self._drain()
        try:
            await self._replan_over_who_is_left()
        except (ValueError, OSError, RuntimeError) as exc:  # PlanRefused, BuildError: ValueError; ShippingError
            self._refused_key = self._answering_key()
            if not self.registry.missing_stages():  # a join's re-plan failed before loading anything: serve on
                log.error("re-planning (%s) failed, serving the plan as it was: %s", self.reason, exc)
                self._set(FleetState.SERVING, reason="")
                return
            self._set(FleetState.REFUSED, reason=f"{self.reason}; re-planning over the workers answering: {exc}")
            return
        self.replans += 1
        self.last_replan_s = round(time.monotonic() - t0, 1)
        log.info("re-planned in %.1f s (from the stage missing or the join to serving; %s): %s", self.last_replan_s,
                 self.reason, " -> ".join(self.registry.placement()))
        self._set(FleetState.SERVING, reason="")

    async def _replan_over_who_is_left(self) -> None:
        """``_replan``, and again at once (up to ``REPLAN_ATTEMPTS`` in all) while it fails because a worker it
        planned over stopped answering meanwhile (a second PC lost while the first's re-plan shipped): the
        workers left may hold the model. Raises what the last attempt raised."""
        for attempt in range(1, REPLAN_ATTEMPTS + 1):
            try:
                return await self._replan()
            except (ValueError, OSError, RuntimeError) as exc:
                gone = await self._planned_gone() if attempt < REPLAN_ATTEMPTS else []
                if not gone:
                    raise
                log.warning("re-planning (%s): %s; worker(s) %s planned over stopped answering meanwhile: planning "
                            "again at once over the workers left", self.reason, exc, ", ".join(gone))
                self.reason = f"{self.reason}; then worker(s) {', '.join(gone)} stopped answering"
        return None

    async def _planned_gone(self) -> list[str]:
        """The addresses of the workers the last plan was made over (``_planned_over``) that answer no more."""
        planned = self._planned_over
        if not planned:
            return []
        found, _ = await answering(sorted(planned.values()), self.settings.security, self.settings.peer,
                                   self.fleet.source.dims.model_id, REPLAN_INFO_TIMEOUT_S)
        return sorted(a for w, a in planned.items() if w not in found)

    async def _replan(self) -> None:
        """Collect the workers answering, plan, build (in a thread), ship, switch the registry, wait until
        every stage is served. Raises ``PlanRefused``/``ValueError``, ``BuildError``, ``ShippingError``, ``OSError``."""
        s, fleet = self.settings, self.fleet
        self._planned_over = {}
        self._step("asking the workers for their capacity")
        addresses = sorted({a for a, _ in fleet.members.values()} | set(self.registry.workers))
        found, why = await answering(addresses, s.security, s.peer, fleet.source.dims.model_id, REPLAN_INFO_TIMEOUT_S)
        if not found:
            raise ValueError(f"no empty-started worker answers ({'; '.join(why) or 'none known'})")
        self._step(f"planning over {len(found)} worker(s): {', '.join(sorted(a for a, _ in found.values()))}")
        p, found, left_out = plan_without_small(fleet.source, found, "workers left")  # PlanRefused, naming each
        self._planned_over = {w: a for w, (a, _) in found.items()}
        for line in left_out:
            log.warning("re-planning: left out of the plan: %s", line)
        self._step(f"building layers {p.layers}")
        build_dir = await asyncio.to_thread(build_for_plan, fleet.source_path, p, build_cache(s))  # the loop serves on
        addresses = [found[st.node.name][0] for st in p.stages]
        self.registry.switching = True
        try:
            reports = await self._ship(build_dir, addresses)
        finally:
            self.registry.switching = False
        for line in ship_lines(reports, addresses, build_dir):
            log.info("re-planning: %s", line)
        if build_dir != fleet.build_dir:  # the same plan (a worker back after the grace): nothing to switch
            self._step("switching to the new build")
            await self.registry.use_build(load_manifest(build_dir))
        self.fleet = PlannedFleet(build_dir, p, fleet.source, found, fleet.source_path)
        if not await self.registry.wait_ready(s.rpc_timeout_s + 10):
            raise RuntimeError(f"{stages_phrase(self.registry.missing_stages(), self.registry.num_stages)} of the new "
                               f"build (build key {build_dir.name}) not served after shipping")

    async def _ship(self, build_dir, addresses: list[str]) -> list:  # noqa: ANN001 - Path
        """``ship_plan`` with its progress in ``progress``; a worker still closing the old build's sessions
        (LoadStage FAILED_PRECONDITION) is asked again, a second apart, up to ``LOAD_RETRIES`` times."""
        import grpc

        from fleet_common.shipping import ShippingError

        progress = self._ship_progress(addresses)
        for _ in range(LOAD_RETRIES - 1):
            try:
                return await ship_plan(build_dir, addresses, self.settings.security, progress)
            except ShippingError as exc:
                if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self._step(f"waiting for a worker to close the old build's sessions: {exc}")
                await asyncio.sleep(1.0)
        return await ship_plan(build_dir, addresses, self.settings.security, progress)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("watching the fleet for a stage with no worker stopped", exc_info=task.exception())
