"""The grammar checker (coordinator/engine/grammar_check.py): real checking processes over the demo's real tokenizer,
each constraint compiled and followed for its first tokens within a time and a memory budget. Through a real
fleet and each API: tests/integration/test_hostile_schemas.py."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time

import psutil
import pytest

from coordinator.engine.constraint import Constraint
from coordinator.errors import InvalidRequest
from coordinator.engine.grammar_check import GrammarChecker
from coordinator.tokenizer import ChatTokenizer
from coordinator.api.tools import parse_tools, tool_schemas

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def all_of(count: int, pattern: str) -> dict:
    """A ~1 KB schema whose one string property is an ``allOf`` of ``count`` patterns, ``pattern`` with each
    letter in turn (``"[{}-z]"``: 22 of them took llguidance 16 s and 375 MB to compile; ``".*[{}].*"``:
    20 took 43 s and 2.3 GB)."""
    return {"type": "object", "properties": {"s": {"type": "string", "allOf": [
        {"pattern": pattern.format(LETTERS[i])} for i in range(count)]}}, "required": ["s"]}


@pytest.fixture(scope="module")
def tokenizer_json(demo_hf) -> str:
    return ChatTokenizer(demo_hf).tokenizer.to_str()


def checking(tokenizer_json: str, time_s: float = 1.0, memory_mb: int = 512):
    """Run ``body(checker)`` (a coroutine function) against a fresh checker; its checking processes end after."""
    def run(body):  # noqa: ANN001, ANN202
        async def main():  # noqa: ANN202
            checker = GrammarChecker(lambda: tokenizer_json, 49152, {2}, time_s, memory_mb)
            try:
                return await body(checker)
            finally:
                await checker.close()
        return asyncio.run(main())
    return run


async def refusal(checker: GrammarChecker, constraint: Constraint) -> tuple[InvalidRequest, float]:
    """The ``InvalidRequest`` ``check`` raises for ``constraint``, and the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as caught:
        await checker.check([constraint])
    return caught.value, time.monotonic() - t0


def test_a_schema_over_the_time_budget_is_refused_naming_its_field_and_the_checker_goes_on(tokenizer_json):
    """22 patterns of [x-z] (16 s of llguidance's compile, in the coordinator's process until now) are refused
    after the 1 s budget, the coordinator's own memory untouched; the next schema is checked by a new process."""
    async def body(checker: GrammarChecker) -> None:
        await checker.check([Constraint.json_schema({"type": "object"})])  # the first process started
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        error, took = await refusal(checker, Constraint.json_schema(all_of(22, "[{}-z]"), "guided_json"))
        print(f"22 patterns: refused in {took:.2f} s: {error.message}")
        assert error.param == "guided_json" and error.message.startswith("guided_json: ")
        assert "more than 1 s of CPU" in error.message and took < 10
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < rss0 + 50
        await checker.check([Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})])
    checking(tokenizer_json)(body)


def test_a_schema_over_the_memory_budget_is_refused(tokenizer_json):
    """18 patterns of .*[x].* take ~500 MB: over a 100 MiB budget the checking process dies, a 400."""
    async def body(checker: GrammarChecker) -> None:
        error, took = await refusal(checker, Constraint.json_schema(all_of(18, ".*[{}].*")))
        print(f"18 patterns under 100 MiB: refused in {took:.2f} s: {error.message}")
        assert error.param == "response_format" and "more than 100 MiB" in error.message
        await checker.check([Constraint.json_schema({"type": "string"})])
    checking(tokenizer_json, time_s=30, memory_mb=100)(body)


def test_grammars_that_break_at_their_first_tokens_are_refused_up_front(tokenizer_json):
    """``^(a{1000}){1000}$`` compiled, then failed its first token in the step loop (a 503, "decode step failed
    unexpectedly"); a schema of 1,000 optional properties failed at its ``{`` (llguidance's 2,000 items in a
    row); a forced ``{"a":`` that allows nothing after. Each is now a 400 before the request runs."""
    async def body(checker: GrammarChecker) -> None:
        error, took = await refusal(checker, Constraint("regex", "^(a{1000}){1000}$", "guided_regex"))
        print(f"^(a{{1000}}){{1000}}$: refused in {took:.2f} s: {error.message}")
        assert error.param == "guided_regex" and error.message.startswith("guided_regex: the regex")
        wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
        error, _ = await refusal(checker, Constraint.json_schema(wide))
        assert "first tokens" in error.message and "max is 2000" in error.message, error.message
        dead_end = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
        error, _ = await refusal(checker, Constraint.json_schema(dead_end))
        assert "no continuation" in error.message
        optional = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}, "b": {"type": "integer"}}}
        await checker.check([Constraint.json_schema(optional)])  # a dead end the output need not take
    checking(tokenizer_json, time_s=30)(body)


@pytest.mark.parametrize("parameters, why", [
    ({"type": "object", "properties": {"x": {"type": "nope"}}}, "nope"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_a_tools_schema_that_does_not_compile_names_the_tool(tokenizer_json, parameters, why):
    """A tool's schema is checked even when the answer is free to call (not decoded under it)."""
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])

    async def body(checker: GrammarChecker) -> None:
        error, _ = await refusal(checker, tool_schemas(tools)[0])
        assert error.param == "tools" and error.message.startswith("tools: the parameters schema of 'f' does not "
                                                                   "compile") and why in error.message
    checking(tokenizer_json)(body)


def test_a_check_abandoned_midway_leaves_no_answer_behind(tokenizer_json):
    """A client gone while its schema compiles: the process is killed (no compile goes on for no one), and the
    next check is not answered with the abandoned one's result."""
    async def body(checker: GrammarChecker) -> None:
        await checker.check([Constraint.json_schema({"type": "object"})])
        task = asyncio.ensure_future(checker.check([Constraint.json_schema(all_of(22, "[{}-z]"))]))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        bad = Constraint("regex", "a(b", "guided_regex")
        error, _ = await refusal(checker, bad)
        assert error.param == "guided_regex" and "unclosed group" in error.message, error.message
        await checker.check([Constraint.json_schema({"type": "integer"})] * 3)
    checking(tokenizer_json, time_s=30)(body)


def checking_processes() -> list[int]:
    """Pids of this process's grammar checking processes."""
    return [p.pid for p in psutil.Process().children() if "coordinator.engine.grammar_check" in " ".join(p.cmdline())]


def test_the_budget_counts_the_checking_processes_cpu_not_a_loaded_pcs_wall_time(tokenizer_json):
    """A checking process that gets no CPU for 1.5 s (stopped: what a loaded PC does to it, the rehearsal of
    2026-12-07 refused an ordinary schema at a load average of 7) still passes a 0.5 s budget: the budget is
    its CPU seconds. One that never runs again (SIGSTOP) is refused after ``WALL_FACTOR`` x the budget."""
    async def body(checker: GrammarChecker) -> None:
        await checker.check([Constraint.json_schema({"type": "object"})])  # the checking processes started
        await asyncio.sleep(1.0)  # the spare one too
        pids = checking_processes()
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(1.5, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids])
        t0 = time.monotonic()
        await checker.check([Constraint.json_schema({"type": "object", "properties": {"b": {"type": "integer"}}})])
        assert time.monotonic() - t0 > 1.4
        for pid in checking_processes():
            os.kill(pid, signal.SIGSTOP)
        error, took = await refusal(checker, Constraint.json_schema({"type": "array"}, "guided_json"))
        assert "more than 0.5 s of CPU" in error.message and 4.5 < took < 10, (took, error.message)
    checking(tokenizer_json, time_s=0.5)(body)
