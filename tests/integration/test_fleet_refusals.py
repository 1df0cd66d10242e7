"""``fleet-coordinator serve --model FILE.gguf`` refused before it serves (issue 30 item 6), on real processes
and real gRPC on loopback: empty workers announcing little memory (``fleet-worker --memory-mb``). A worker too
small for any plan, and a model too big for the whole fleet, each end the coordinator with exit code 2 and one
error naming the worker's address and the MiB it has and lacks; nothing is built. Workers run with
--no-announce: other tests on this machine must not find them."""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import harness
from coordinator.fleet.local import free_port
from tests.integration.test_shipping import serving, spawn_worker

pytestmark = pytest.mark.integration


def refused(gguf: Path, tmp_path: Path, memory_mb: tuple[int, ...]) -> tuple[str, list[str]]:
    """(the coordinator's log, the worker addresses) of ``serve --model gguf`` over empty workers offering
    ``memory_mb`` MiB each; asserts that it exited with 2 without building."""
    with ExitStack() as stack:
        addresses = [serving(spawn_worker(tmp_path / f"w{i}.log", stack, "--memory-mb", str(mb), "--stages-dir",
                                          str(tmp_path / f"s{i}")), empty=True) for i, mb in enumerate(memory_mb)]
        proc = harness.spawn([*harness.tool("fleet-coordinator"), "serve", "--model", str(gguf), "--port",
                              str(free_port()), "--no-announce", "--no-discover",
                              *(arg for a in addresses for arg in ("--peer", a)),
                              "--build-cache-dir", str(tmp_path / "builds")], tmp_path / "coordinator.log", stack)
        assert proc.popen.wait(timeout=120) == 2, proc.text()[-3000:]
        log = proc.text()
    assert not (tmp_path / "builds" / "builds").exists() or not any((tmp_path / "builds" / "builds").iterdir())
    return log, addresses


def error_of(log: str) -> str:
    """The coordinator's one ERROR record (its first line and the lines that continue it)."""
    records = re.findall(r"^\S+ \S+ ERROR .*?(?=^\d{4}-\d\d-\d\d |\Z)", log, re.S | re.M)
    assert len(records) == 1, log[-3000:]
    return records[0]


def test_a_worker_too_small_for_any_plan_is_named_with_its_mib(tmp_path, demo_hf):
    log, (small, big) = refused(harness.demo_gguf(demo_hf), tmp_path, (64, 8192))
    error = error_of(log)
    assert "cannot hold even one layer" in error and "(64 MiB)" in error and re.search(r"short [\d,]+ MiB", error)
    # the planner names the worker by its id: the error says where that worker is, and what each one offers
    assert re.search(rf"\S+ at {re.escape(small)} \(64 MiB available", error), error
    assert re.search(rf"\S+ at {re.escape(big)} \(8,192 MiB available", error), error


def test_a_model_too_big_for_the_whole_fleet_is_named_with_the_mib(tmp_path, demo_hf):
    log, addresses = refused(harness.demo_gguf(demo_hf), tmp_path, (600, 600))
    error = error_of(log)
    assert re.search(r"2 node\(s\) hold at most \d+ of 30 layers", error), error
    assert "(600 MiB)" in error and re.search(r"short [\d,]+ MiB", error) and "more node(s) of 600 MiB" in error
    for address in addresses:
        assert re.search(rf"\S+ at {re.escape(address)} \(600 MiB available", error), error
