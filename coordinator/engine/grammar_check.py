"""Every schema and grammar a request names is tried in a separate process, within a time and memory budget,
before the coordinator compiles it.

llguidance's compile time and memory are not bounded by its own limits (``LLParserLimits``) for every input:
a string property that is an ``allOf`` of ~20 ``pattern``s (``[a-z]``, ``[b-z]``, ...) makes its check of
the patterns' intersection exponential (on 2 cores: 18 patterns 0.5 s, 22 patterns 16 s and 375 MB; of
``.*[a].*``, ``.*[b].*``, ...: 20 patterns 43 s and 2.3 GB), and ``^(a{1000}){1000}$`` compiles and then fails
at its first token ("too many expressions constructed"). So a ``GrammarChecker`` hands each request's
constraints to one of a few long-lived checking processes (``python -m coordinator.engine.grammar_check``, the
tokenizer loaded once): it compiles them and follows their first tokens (``dry_run``) under an address-space
limit; past the time budget (the process's CPU seconds: a loaded PC is not a slow grammar) it is killed (and
replaced at the next check). Either way the request gets a 400 naming its field, the coordinator's event loop
and memory untouched. What passed is remembered (the same
tools come with every turn of a chat), so the coordinator's own compile (``Grammars.matcher``, on a thread)
only ever meets a grammar known to compile in budget.

Protocol, one JSON line each way over the process's stdin and stdout: first the setup (``tokenizer``,
``vocab_size``, ``eos_ids``, ``memory_mb``) answered by ``{"ready": true}``, then per check a list of
constraints (``kind``, ``text``, ``field``, ``label``) answered by ``{}`` or ``{"error": message, "field": field}``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from .constraint import Constraint, compile_matcher
from ..errors import InvalidRequest, Overloaded

log = logging.getLogger(__name__)

DRY_RUN_STEPS = 4
"""Tokens ``dry_run`` follows past the first mask: the grammar's forced tokens (which every output begins
with), else the first allowed token."""

CHECKERS = 2  # checking processes at most (each ~35 MB resident with a 49,152-token vocabulary)
PASSED_KEPT = 256  # constraints remembered as passed (their digests)
MAX_MESSAGE = 1000  # characters of llguidance's error kept in a refusal
POLL_S = 0.05  # how often a check's CPU time is read
WALL_FACTOR = 10.0  # a check may take this many times its CPU budget in wall time (a loaded PC) and no more
START_TIMEOUT_S = 60.0  # a checking process's start (Python, llguidance, the tokenizer: ~1 s; a 256k vocabulary more)


def dry_run(tokenizer, constraint: Constraint, steps: int = DRY_RUN_STEPS) -> None:  # noqa: ANN001 - LLTokenizer
    """Compile ``constraint`` (``constraint.compile_matcher``) and follow ``steps`` tokens of an output
    under it. Raises ``InvalidRequest`` naming its field when it does not compile, allows no output, or
    breaks on one of those tokens (a lexer over its limits: ``^(a{1000}){1000}$``; a dead end after the
    tokens it forces)."""
    matcher = compile_matcher(tokenizer, constraint)
    eos = set(tokenizer.eos_tokens)
    for _ in range(steps):
        if matcher.is_stopped():
            return
        forced = matcher.compute_ff_tokens()
        if forced:
            token = forced[0]
        else:
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)  # [ceil(V / 32)]
            allowed = [t for t in np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[:64]
                       if int(t) not in eos]
            if not allowed:
                return
            token = int(allowed[0])
        if matcher.consume_token(token):
            matcher.compute_bitmask()
        if matcher.is_error():
            reason = matcher.get_error().split("<state>")[0].strip()
            raise InvalidRequest(f"{constraint.field}: {constraint.what} allows no continuation of the output's "
                                 f"first tokens ({reason})", param=constraint.field)


def _digest(constraint: Constraint) -> bytes:
    return hashlib.blake2b(f"{constraint.kind}\0{constraint.text}".encode(), digest_size=16).digest()


class _Checker:
    """One checking process and its pipes; ``dead`` once killed (a check over budget, or abandoned)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.dead = False
        self._usage = psutil.Process(proc.pid)  # its CPU counters, read while a check runs

    async def ask(self, message: object, cpu_s: float) -> dict | None:
        """Send ``message`` and wait for the answer while the process has used less than ``cpu_s`` CPU seconds
        on it (its user + system time, all threads; polled every ``POLL_S``) and less than ``WALL_FACTOR`` x
        ``cpu_s`` wall seconds (a process that stalls uses no CPU); None when the process died. Raises
        ``TimeoutError`` past either budget. Kills the process when the wait ends otherwise (over a budget,
        the request cancelled): an answer left unread would be taken for the next question's.

        CPU time, not wall time, so that a loaded PC (other requests, other processes) does not refuse a
        schema that compiles in budget on it when it is idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WALL_FACTOR * cpu_s
        reading: asyncio.Task | None = None
        try:
            start = self.cpu_s()
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            async with asyncio.timeout_at(deadline):
                await self.proc.stdin.drain()
            reading = asyncio.ensure_future(self.proc.stdout.readline())
            while not (await asyncio.wait({reading}, timeout=POLL_S))[0]:
                if self.cpu_s() - start > cpu_s or loop.time() > deadline:
                    raise TimeoutError
            line = reading.result()
        except BaseException:
            if reading is not None:
                reading.cancel()
            self.kill()
            raise
        if not line:
            self.kill()
        return json.loads(line) if line else None

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used (psutil; 0.0 once it is gone)."""
        try:
            times = self._usage.cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system

    def kill(self) -> None:
        """End the process (SIGKILL; asyncio reaps it)."""
        self.dead = True
        if self.proc.returncode is None:
            self.proc.kill()


class GrammarChecker:
    """Tries constraints in checking processes within ``time_s`` CPU seconds (``WALL_FACTOR`` times that in wall
    time) and ``memory_mb`` MiB each (the coordinator's ``--grammar-check-s`` and ``--grammar-check-mb``).

    ``tokenizer_json()``: the build's tokenizer.json text (asked for once, off the event loop);
    ``vocab_size``: the model's logits width; ``eos_ids``: the tokens that end a sequence;
    ``wait_s``: the longest a check waits for a free checking process (then ``Overloaded``)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int],
                 time_s: float, memory_mb: int, wait_s: float = 60.0) -> None:
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self.time_s, self.memory_mb, self.wait_s = time_s, memory_mb, wait_s
        self._setup: bytes | None = None
        self._free: asyncio.Queue[_Checker | None] | None = None  # made in the event loop, on first use
        self._passed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._running: set[_Checker] = set()
        self._replacing: set[asyncio.Task] = set()  # starts of checkers that replace killed ones

    async def check(self, constraints: Sequence[Constraint]) -> None:
        """Return once every constraint of ``constraints`` compiled and followed its first tokens in a
        checking process within the budgets. Raises ``InvalidRequest`` naming the field of the first that
        does not compile, breaks (``dry_run``) or goes over a budget; ``Overloaded`` when no checking process
        is free within ``wait_s``."""
        todo = list({_digest(c): c for c in constraints if _digest(c) not in self._passed}.values())
        if not todo:
            return
        if self._free is None:  # one checker started here, the others beside it: a spare is warm when one is killed
            self._free = asyncio.LifoQueue()  # a running checker before a slot to start one in
            self._free.put_nowait(None)
            for _ in range(CHECKERS - 1):
                self._start_replacement()
        try:
            checker = await asyncio.wait_for(self._free.get(), self.wait_s)
        except TimeoutError:
            raise Overloaded(f"{todo[0].field}: no grammar checker was free for {self.wait_s:.0f} s; retry "
                             f"shortly") from None
        try:
            if checker is None:
                checker = await self._start()
            await self._ask(checker, todo)
        finally:
            if checker is not None and checker.dead:  # replaced at once: the next check need not wait for it
                self._running.discard(checker)
                self._start_replacement()
            else:
                self._free.put_nowait(checker)
        for constraint in todo:
            self._passed[_digest(constraint)] = None
            if len(self._passed) > PASSED_KEPT:
                self._passed.popitem(last=False)

    async def _ask(self, checker: _Checker, todo: list[Constraint]) -> None:
        """Ask ``checker`` about ``todo``. Raises ``InvalidRequest`` as ``check`` says."""
        t0 = time.perf_counter()
        try:
            answer = await checker.ask([dataclasses.asdict(c) for c in todo], self.time_s)
        except TimeoutError:
            answer = {"over": f"more than {self.time_s:g} s of CPU"}
        if answer is None:  # it died: over its address space (Rust aborts), or a crash (a stack overflow)
            answer = {"over": f"more than {self.memory_mb} MiB"}
        took = time.perf_counter() - t0
        if "over" in answer:
            checker.kill()
            log.warning("grammar check of %s: over budget (%s) after %.2f s",
                        ", ".join(sorted({c.field for c in todo})), answer["over"], took)
            raise InvalidRequest(f"{todo[0].field}: the schema or grammar takes {answer['over']} to compile, "
                                 f"over fleet's budget (the coordinator's --grammar-check-s and "
                                 f"--grammar-check-mb); simplify it (fewer patterns in an allOf, smaller "
                                 f"repetition counts)", param=todo[0].field)
        if "error" in answer:
            raise InvalidRequest(answer["error"], param=answer.get("field"))
        log.debug("grammar check of %d constraint(s): %.3f s", len(todo), took)

    async def _start(self) -> _Checker:
        """A new checking process, its tokenizer loaded."""
        if self._setup is None:  # a tokenizer.json is 2-33 MB: read and encoded off the event loop
            self._setup = await asyncio.to_thread(lambda: json.dumps({
                "tokenizer": self._json(), "vocab_size": self.vocab_size, "eos_ids": self.eos_ids,
                "memory_mb": self.memory_mb}).encode() + b"\n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.engine.grammar_check", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 20)
        checker = _Checker(proc)
        self._running.add(checker)
        try:
            proc.stdin.write(self._setup)
            async with asyncio.timeout(START_TIMEOUT_S):
                await proc.stdin.drain()
                ready = await proc.stdout.readline()
        except BaseException:
            checker.kill()
            self._running.discard(checker)
            raise
        if not ready:
            checker.kill()
            self._running.discard(checker)
            raise RuntimeError(f"the grammar checking process exited at its start (status {proc.returncode})")
        return checker

    def _start_replacement(self) -> None:
        task = asyncio.ensure_future(self._replace())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self) -> None:
        """Start a checking process into the free ones (a slot to start one in, if that fails)."""
        checker = None
        try:
            checker = await self._start()
        except Exception:
            log.exception("grammar check: could not start a checking process")
        finally:
            self._free.put_nowait(checker)

    async def close(self) -> None:
        """End every checking process (and wait for them)."""
        for task in self._replacing:
            task.cancel()
        running, self._running = list(self._running), set()
        for checker in running:
            checker.kill()
        await asyncio.gather(*(c.proc.wait() for c in running), *self._replacing, return_exceptions=True)


def _limit_memory(memory_mb: int) -> None:
    """Cap this process's address space at what it maps now plus ``memory_mb`` MiB: past it llguidance's
    allocations fail and the process aborts, which its coordinator takes for over budget."""
    with open("/proc/self/status") as status:
        vm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = (vm_kb << 10) + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    """The checking process: the setup line, then one answer per line of constraints (module docstring)."""
    import llguidance

    answers = os.fdopen(os.dup(1), "w")  # the protocol's; anything else printed goes to stderr
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline())
    eos = setup["eos_ids"]
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"],
                                       eos_token=eos[0] if len(eos) == 1 else eos)
    del setup["tokenizer"]
    _limit_memory(setup["memory_mb"])
    answers.write('{"ready": true}\n')
    answers.flush()
    for line in sys.stdin:
        try:
            for item in json.loads(line):
                dry_run(tokenizer, Constraint(**item))
            answer: dict = {}
        except InvalidRequest as exc:
            answer = {"error": exc.message[:MAX_MESSAGE], "field": exc.param}
        except MemoryError:
            answer = {"over": f"more than {setup['memory_mb']} MiB"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
