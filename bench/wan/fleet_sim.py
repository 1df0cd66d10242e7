"""The discrete-event simulator under ``bench/wan/fleet_model.py``: a :class:`Fleet` (per-stage compute, links,
hop overheads, draft, speculation, users, the benchmark's window) decoded by :func:`simulate` on processors
that time-share (:class:`Machine`). Every term and where its number comes from is in ``bench/wan/fleet_model.py``'s
docstring; that module calibrates the fleet against measured sweeps and predicts paper-scale fleets."""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MESSAGE_OVERHEAD_BYTES = 300  # protobuf fields (session and step ids, route, manifest hash, ...) + framing
# fleet-wan's event loop sets no timer for a message due less than this after it arrived (measured with
# ``fleet_calibrate.py link-timers``, 1 Gbit/s: at 0 ms a 1,500-byte message (12 us) crosses with none and a
# 2,000-byte one (16 us) with one; at 10 ms 3,200 bytes (25.6 us) with none, 3,600 (28.8 us) with one, half the time)
LINK_TIMER_EPS_MS = {False: 0.014, True: 0.027}  # keyed by "the link has a delay"


@dataclass(frozen=True)
class Fleet:
    """What the model needs to know. Times in milliseconds, sizes in bytes, rates in Mbit/s.

    ``stage_ms[i](seq)``: stage i's compute for one chunk of ``seq`` tokens of one row;
    ``stage_core[i]``: the PC (or, with ``shared_cores``, the core) that runs stage i.
    """

    stage_ms: tuple[Callable[[float], float], ...]
    stage_core: tuple[int, ...]
    hidden_size: int
    delay_ms: float = 0.0  # one-way, per link
    rate_mbit: float = 0.0  # per link direction; 0 = unlimited
    hop_ms: float = 0.0  # software overhead per hop (calibrated)
    hop_work_ms: float = 0.0  # shared_cores: the part of hop_ms that is CPU work on any core (the rest waits)
    hop_cpu_ms: float = 0.0  # CPU a hop costs the receiving stage's core (gRPC, protobuf, Python)
    coordinator_ms: float = 0.0  # per step at the coordinator (sampling, scheduling)
    users: int = 1
    groups: int = 0  # batch groups (0 = one per stage); users beyond them share steps
    batch_cost: Callable[[int], float] = lambda rows: 1.0 + 0.15 * (rows - 1)
    k: float = 0.0  # drafts per verify step (mean); 0 = no speculation
    draft_core: int | None = None  # the PC/core the draft model shares (None: its own PC; any core if shared)
    acceptance: float = 0.0
    draft_ms: Callable[[float], float] | None = None  # one draft forward of seq tokens (its prompt, catch-up, drafts)
    draft_ms_per_token: float = 0.0  # > 0: a verify step's draft costs this per drafted token instead (measured)
    tokens_per_step: float | None = None  # emitted per verify step, measured; else from acceptance and k
    verify_share: float = 1.0  # share of decode steps that carry drafts (the rest decode one token plainly)
    result_candidates: int = 1  # candidates per position the last stage returns (vocab = full logits)
    prompt_tokens: tuple[int, ...] = (32,)  # prompt length of user u: prompt_tokens[u % len]
    prefill_chunk: int = 64
    shared_cores: int = 0  # > 0: every stage, the coordinator and the proxies time-share this many cores
    link_timers: bool = False  # links are fleet-wan proxies (their timers round waits up to whole ms)
    bench_tokens: int = 0  # > 0: time users x (bench_tokens - 1) tokens as bench/wan/sweep.py does

    @property
    def emitted_per_step(self) -> float:
        """Tokens a verify step emits."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        if not self.k:
            return 1.0
        a, k = self.acceptance, self.k
        return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Machine:
    """Processors (PCs or cores) that time-share: while n jobs run on one, each progresses at 1/n of its
    speed (a lone job at full speed), the OS's fair time slicing; plus timers for pure delays."""

    def __init__(self, processors: int) -> None:
        self.now = 0.0
        self._jobs: list[list[list]] = [[] for _ in range(processors)]  # per processor: [ms left, callback]
        self.pinned = [0] * processors  # threads pinned to each (unpinned work avoids them on ties)
        self._timers: list[_Event] = []
        self._count = itertools.count()

    def later(self, ms: float, then: Callable[[], None]) -> None:
        """Call ``then`` after ``ms`` of pure delay (no processor busy)."""
        heapq.heappush(self._timers, _Event(self.now + max(0.0, ms), next(self._count), then))

    def work(self, processor: int | None, ms: float, then: Callable[[], None]) -> None:
        """``ms`` of CPU work on ``processor`` (None: the one running the fewest jobs now), then ``then``."""
        if ms <= 0:
            self.later(0.0, then)
            return
        if processor is None:
            processor = min(range(len(self._jobs)), key=lambda p: (len(self._jobs[p]), self.pinned[p], p))
        self._jobs[processor].append([ms, then])

    def run(self) -> None:
        """Run every job and timer until none is left."""
        while True:
            t = self._timers[0].time if self._timers else math.inf
            for jobs in self._jobs:
                if jobs:
                    t = min(t, self.now + min(j[0] for j in jobs) * len(jobs))
            if t == math.inf:
                return
            finished = []
            for jobs in self._jobs:
                if jobs:
                    share = (t - self.now) / len(jobs)
                    for j in jobs:
                        j[0] -= share
                    finished += [j[1] for j in jobs if j[0] <= 1e-9]
                    jobs[:] = [j for j in jobs if j[0] > 1e-9]
            self.now = t
            for then in finished:
                then()
            while self._timers and self._timers[0].time <= self.now + 1e-12:
                heapq.heappop(self._timers).action()


class _Thread:
    """One thread's jobs, first come first served (a worker's inference thread, the draft thread), on
    ``processor`` (None: whichever is least busy when each job starts)."""

    def __init__(self, machine: Machine, processor: int | None) -> None:
        self.machine, self.processor = machine, processor
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._busy = False
        if processor is not None:
            machine.pinned[processor] += 1

    def run(self, ms: float, then: Callable[[], None]) -> None:
        """Queue ``ms`` of work on this thread, then ``then`` once it has run."""
        self._queue.append((ms, then))
        self._next()

    def _next(self) -> None:
        if self._busy or not self._queue:
            return
        ms, then = self._queue.popleft()
        self._busy = True

        def done() -> None:
            self._busy = False
            then()
            self._next()

        self.machine.work(self.processor, ms, done)


class _Link:
    """One link direction: messages serialise one after another (``free_at``), then travel."""

    def __init__(self) -> None:
        self.free_at = 0.0


def timer_release(wait_ms: float, delay_ms: float) -> float:
    """When fleet-wan writes a message due ``wait_ms`` after it arrived (``delay_ms`` of it the link's
    delay): asyncio sleeps, and the epoll selector rounds the timeout up to whole milliseconds."""
    eps = LINK_TIMER_EPS_MS[delay_ms > 0]
    if wait_ms <= eps:
        return wait_ms
    return eps + math.ceil(wait_ms - eps - 1e-9)




class _Run:
    """One :func:`simulate`: the fleet's processors, threads and links, and every batch group's progress."""

    def __init__(self, fleet: Fleet, steps_per_user: int) -> None:
        self.fleet, self.steps_per_user = fleet, steps_per_user
        n = self.n = len(fleet.stage_ms)
        self.shared = fleet.shared_cores > 0
        machine = self.machine = Machine(fleet.shared_cores if self.shared else max(fleet.stage_core) + 2)
        if self.shared:  # each worker its own inference thread on its pinned core; the draft thread floats
            self.stage_threads = [_Thread(machine, fleet.stage_core[i]) for i in range(n)]
            self.draft = _Thread(machine, fleet.draft_core)
        else:  # one PC runs one chunk at a time: stages placed on one PC (and its draft) share a queue
            pcs = {c: _Thread(machine, c) for c in sorted(set(fleet.stage_core))}
            self.stage_threads = [pcs[c] for c in fleet.stage_core]
            self.draft = pcs[fleet.draft_core] if fleet.draft_core is not None else _Thread(machine, max(pcs) + 1)
        self.up = [_Link() for _ in range(n)]  # link into stage i
        self.down = _Link()  # the last stage's link back to the coordinator
        groups = fleet.groups or n
        self.rows = max(1, math.ceil(fleet.users / groups))
        self.n_groups = min(groups, fleet.users)
        self.spec = fleet.k > 0
        self.draft_wall = [0.0, 0.0]  # ms waited for drafts, tokens drafted
        self.draft_ms = fleet.draft_ms or (lambda seq: 0.0)
        self.target = fleet.bench_tokens - 1 if fleet.bench_tokens else math.inf
        g = self.n_groups
        self.emitted, self.steps, self.credit = [0.0] * g, [0] * g, [0.0] * g  # credit: verify steps owed
        self.missed = [0] * g  # tokens decoded plainly since the group's draft last ran (it feeds them first)
        self.first_at, self.done_at = [0.0] * g, [0.0] * g

    def cross(self, link: _Link, payload: int, then: Callable[[], None]) -> None:
        """A message of ``payload`` bytes over ``link`` (serialised behind the ones before it), then ``then``."""
        fleet, machine = self.fleet, self.machine
        serial = (payload + MESSAGE_OVERHEAD_BYTES) * 8 / (fleet.rate_mbit * 1e3) if fleet.rate_mbit else 0.0
        start = max(machine.now, link.free_at)
        link.free_at = start + serial
        wait = start - machine.now + serial + fleet.delay_ms
        if fleet.link_timers:
            wait = timer_release(wait, fleet.delay_ms)
        if self.shared:
            work = min(fleet.hop_work_ms, fleet.hop_ms)
            machine.later(wait + fleet.hop_ms - work, lambda: machine.work(None, work, then))
        else:
            machine.later(wait + fleet.hop_ms, then)

    def stage(self, i: int, seq: float, then: Callable[[], None]) -> None:
        """Stage ``i`` computes a chunk of ``seq`` tokens for every row of a group, then ``then``."""
        fleet = self.fleet
        compute = fleet.stage_ms[i](seq) * fleet.batch_cost(self.rows)
        if self.shared:
            self.machine.work(fleet.stage_core[i], fleet.hop_cpu_ms, lambda: self.stage_threads[i].run(compute, then))
        else:
            self.stage_threads[i].run(compute + fleet.hop_cpu_ms, then)

    def chain(self, seq: float, logits: float, then: Callable[[], None]) -> None:
        """One chunk of every row of a group through all stages, and its result back."""
        fleet, rows = self.fleet, self.rows

        def into(i: int) -> None:
            self.stage(i, seq, lambda: out_of(i))

        def out_of(i: int) -> None:
            if i + 1 < self.n:
                self.cross(self.up[i + 1], round(rows * seq * fleet.hidden_size * 4), lambda: into(i + 1))
            elif self.shared:
                self.cross(self.down, round(rows * logits * fleet.result_candidates * 8),
                           lambda: self.machine.work(None, fleet.coordinator_ms, then))
            else:
                self.cross(self.down, round(rows * logits * fleet.result_candidates * 8),
                           lambda: self.machine.later(fleet.coordinator_ms, then))

        self.cross(self.up[0], round(rows * seq * 8), lambda: into(0))

    def step(self, g: int) -> None:
        """Group ``g``'s next decode step (a verify step with drafts when its share is due), or its end."""
        fleet, machine = self.fleet, self.machine
        if self.emitted[g] >= self.target - 1e-9 or (not fleet.bench_tokens and self.steps[g] == self.steps_per_user):
            self.done_at[g] = machine.now
            return
        verify = False
        if self.spec:
            self.credit[g] += fleet.verify_share
            verify = self.credit[g] >= 1 - 1e-9
            self.credit[g] -= 1 if verify else 0
        seq = 1 + fleet.k if verify else 1.0
        tokens = fleet.emitted_per_step if verify else 1.0

        def finished() -> None:
            self.missed[g] = 0 if verify else self.missed[g] + 1
            self.emitted[g] += tokens
            self.steps[g] += 1
            self.step(g)

        def run_chunk() -> None:
            self.chain(seq, seq, finished)

        if not verify:
            run_chunk()
            return
        asked = machine.now  # every row of the group drafts, on the one draft thread

        def drafted() -> None:
            self.draft_wall[0] += machine.now - asked
            self.draft_wall[1] += self.rows * fleet.k
            run_chunk()

        # per row: the newest token plus the ones decoded plainly in one forward, then K - 1 one-token forwards
        self.draft.run(self.rows * (fleet.k * fleet.draft_ms_per_token if fleet.draft_ms_per_token
                                    else self.draft_ms(1 + self.missed[g]) + max(0.0, fleet.k - 1) * self.draft_ms(1)),
                       drafted)

    def start(self, g: int) -> None:
        """A request: OpenSession round trip, its prompt through the stages while the draft model
        prefills it too (the first token waits for both), then a Merge round trip into its group."""
        fleet = self.fleet
        prompt = fleet.prompt_tokens[g % len(fleet.prompt_tokens)]
        chunks = [min(fleet.prefill_chunk, prompt - s) for s in range(0, prompt, fleet.prefill_chunk)]
        pending = [2 if self.spec else 1]

        def prefilled() -> None:
            pending[0] -= 1
            if pending[0]:
                return
            self.first_at[g] = self.machine.now
            self.cross(self.up[0], 0, lambda: self.cross(self.down, 0, lambda: self.step(g)))

        def prefill(c: int) -> None:
            if c < len(chunks):
                self.chain(chunks[c], 1 if c + 1 == len(chunks) else 0, lambda: prefill(c + 1))
            else:
                prefilled()

        def opened() -> None:
            if self.spec:  # the draft model prefills the prompt too
                self.draft.run(self.rows * self.draft_ms(prompt), prefilled)
            prefill(0)

        self.cross(self.up[0], 0, lambda: self.cross(self.down, 0, opened))

    def result(self) -> dict:
        """The finished run's numbers (see :func:`simulate`)."""
        fleet, n = self.fleet, self.n
        if fleet.bench_tokens:
            decoded = self.n_groups * self.rows * (fleet.bench_tokens - 1)
            elapsed = max(self.done_at) - min(self.first_at)
            ttft = statistics.median(self.first_at) + fleet.coordinator_ms
        else:
            decoded = self.rows * sum(self.emitted)
            elapsed = max(self.done_at)
            chunks = math.ceil(fleet.prompt_tokens[0] / fleet.prefill_chunk)
            chunk = min(fleet.prompt_tokens[0], fleet.prefill_chunk)
            per_chunk = (sum(f(chunk) for f in fleet.stage_ms) + (n + 1) * (fleet.delay_ms + fleet.hop_ms)
                         + (chunk * fleet.hidden_size * 4 * 8 / (fleet.rate_mbit * 1e3) if fleet.rate_mbit else 0.0)
                         * (n - 1))
            ttft = chunks * per_chunk + fleet.coordinator_ms
        tok_s = decoded / elapsed * 1000
        return {"tok_s": tok_s, "per_user_tok_s": tok_s / fleet.users, "ttft_ms": ttft,
                "draft_wall_ms_per_token": self.draft_wall[0] / self.draft_wall[1] if self.draft_wall[1] else None}


def simulate(fleet: Fleet, steps_per_user: int = 200) -> dict:
    """Decode tok/s (aggregate and per user), the modelled TTFT (ms) and the draft's wall time per
    drafted token (queueing included). Steady state over ``steps_per_user`` steps of every group, or,
    with ``fleet.bench_tokens``, the benchmark's window (see ``bench/wan/fleet_model.py``'s docstring)."""
    run = _Run(fleet, steps_per_user)
    for g in range(run.n_groups):
        run.machine.later(0.0, (lambda g=g: run.start(g)) if fleet.bench_tokens else (lambda g=g: run.step(g)))
    run.machine.run()
    return run.result()
