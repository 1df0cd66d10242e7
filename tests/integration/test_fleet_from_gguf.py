"""``fleet-coordinator serve --model FILE.gguf`` over empty workers (issue 30): the demo's Q4_1 GGUF is planned
from its metadata's dimensions, built with its blocks kept (as ``fleet-compiler build FILE.gguf``), shipped and
served; its greedy answer (token ids, f32 workers) equals a static fleet's of the same build (``--shard i
--model BUILD`` workers), whose workers are named and not counted as empty. A restarted coordinator over workers
serving its stages ships nothing; one of another build ships over them. Without --peer, empty workers announced
on loopback are found by mDNS. Workers otherwise run with --no-announce: other tests on this machine must not
find them."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import harness
from coordinator.fleet.planned import collect_capacities
from fleet_common.manifest import load_manifest
from fleet_common.security import Security
from tests.conftest import Fleet, greedy_with_gaps, start_coordinator, wait_ready
from tests.integration.test_shipping import serving, spawn_worker

pytestmark = pytest.mark.integration

PROMPT = "Name three colours of the rainbow."
TOKENS = 24


def planned_fleet(source: Path, tmp_path: Path, stack: ExitStack, caches: str = "c", run: str = "") -> tuple:
    """Two empty workers (model caches ``tmp_path/<caches>I``, stage caches ``tmp_path/s<caches>I``) and a
    coordinator serving ``source`` over them by --peer with the build cache ``tmp_path/builds``; returns
    (coordinator proc, its URL, the worker addresses)."""
    addresses = [serving(spawn_worker(tmp_path / f"w{run}{i}.log", stack, "--cache-dir", str(tmp_path / f"{caches}{i}"),
                                      "--stages-dir", str(tmp_path / f"s{caches}{i}")), empty=True) for i in range(2)]
    (tmp_path / f"coord{run}").mkdir()
    proc, url = start_coordinator(source, tmp_path / f"coord{run}", "--no-discover",
                                  *(arg for a in addresses for arg in ("--peer", a)),
                                  "--build-cache-dir", str(tmp_path / "builds"))
    stack.callback(proc.stop)
    wait_ready(url, 240, proc)
    return proc, url, addresses


def the_build(tmp_path: Path) -> Path:
    """The one build the coordinator made under ``tmp_path/builds``."""
    builds = [d for d in (tmp_path / "builds" / "builds").iterdir() if (d / "manifest.json").is_file()]
    assert len(builds) == 1, builds
    return builds[0]


def test_gguf_source_over_empty_workers_answers_as_a_static_fleet_of_its_plan(tmp_path, demo_hf):
    gguf = harness.demo_gguf(demo_hf)
    with ExitStack() as stack:
        proc, url, _ = planned_fleet(gguf, tmp_path, stack)
        planned = greedy_with_gaps(url, PROMPT, TOKENS)
        log = proc.text()
    build = the_build(tmp_path)
    manifest = load_manifest(build).manifest
    assert manifest.num_stages == 2 and {s.weights for s in manifest.stages} == {"gguf"}, manifest.stages
    assert manifest.model_id == gguf.stem
    assert "stage 0: sent" in log and "stage 1: sent" in log and "int8 weights" in log  # planned as int8 bytes
    (tmp_path / "static").mkdir()
    with Fleet(build, tmp_path / "static", peers=True) as static_fleet:
        static = greedy_with_gaps(static_fleet.url, PROMPT, TOKENS)
        with pytest.raises(TimeoutError) as refused:  # a static --shard worker is named, not counted
            asyncio.run(collect_capacities(static_fleet.peers, Security(), expect=1, timeout_s=1))
    assert refused.value.args[0].count("a static worker (--shard/--model)") == 2, refused.value
    assert planned["ids"] == static["ids"], (planned["tokens"], static["tokens"])
    print("planned ranges:", [(s.start, s.end) for s in manifest.stages], "answer:", "".join(planned["tokens"]))


def test_restarted_coordinator_serves_the_stages_workers_hold_and_reships_another_build(tmp_path, demo_hf):
    """A second coordinator over the same workers, which serve the first's stages, ships and loads nothing and
    answers the same ids; a third with another source (the demo's HF folder: another build) ships over them."""
    gguf = harness.demo_gguf(demo_hf)
    with ExitStack() as stack:
        first, url, addresses = planned_fleet(gguf, tmp_path, stack)
        before = greedy_with_gaps(url, PROMPT, TOKENS)
        first.stop()
        peers = [arg for a in addresses for arg in ("--peer", a)]
        (tmp_path / "again").mkdir()
        again, url = start_coordinator(gguf, tmp_path / "again", "--no-discover", *peers,
                                       "--build-cache-dir", str(tmp_path / "builds"), "--workers-timeout-s", "10")
        stack.callback(again.stop)
        wait_ready(url, 60, again)
        assert again.text().count("serves it already") == 2 and ": sent" not in again.text(), again.text()[-3000:]
        assert greedy_with_gaps(url, PROMPT, TOKENS)["ids"] == before["ids"]
        again.stop()
        (tmp_path / "other").mkdir()
        other, url = start_coordinator(demo_hf, tmp_path / "other", "--no-discover", *peers,
                                       "--build-cache-dir", str(tmp_path / "builds"), "--workers-timeout-s", "10")
        stack.callback(other.stop)
        wait_ready(url, 240, other)
        assert other.text().count(": sent") == 2 and "shipping over it" in other.text(), other.text()[-3000:]
        assert len(greedy_with_gaps(url, PROMPT, TOKENS)["ids"]) == TOKENS


def test_empty_workers_found_by_mdns_without_peers(tmp_path, demo_hf):
    """No --peer: the coordinator browses zeroconf on loopback, takes the announced empty workers once no new one
    turned up for SETTLE_S, plans over both, ships and serves (the registry finds them by mDNS as stages); a
    coordinator of another model by mDNS then takes neither (they serve another fleet) and fails naming them."""
    from tests.conftest import EXACT_WORKER

    gguf = harness.demo_gguf(demo_hf)
    with ExitStack() as stack:
        announced = [[*harness.tool("fleet-worker"), "--port", "0", *EXACT_WORKER,
                      "--cache-dir", str(tmp_path / f"c{i}"),
                      "--stages-dir", str(tmp_path / f"s{i}")] for i in range(2)]  # announced on loopback
        addresses = [serving(harness.spawn(cmd, tmp_path / f"w{i}.log", stack), empty=True)
                     for i, cmd in enumerate(announced)]
        (tmp_path / "coord").mkdir()
        proc, url = start_coordinator(gguf, tmp_path / "coord", "--build-cache-dir", str(tmp_path / "builds"),
                                      "--workers-timeout-s", "60")
        stack.callback(proc.stop)
        wait_ready(url, 240, proc)
        text = proc.text()
        assert "browsing zeroconf for empty workers" in text and text.count(": sent") == 2, text[-3000:]
        for address in addresses:
            assert f"at {address}" in text, (address, text[-3000:])  # heard by zeroconf
        assert "(mdns)" in text  # and served as stages found by mDNS
        assert len(greedy_with_gaps(url, PROMPT, TOKENS)["ids"]) == TOKENS
        # another model's coordinator by mDNS leaves these workers (another fleet's) alone and says why
        other = harness.spawn([*harness.tool("fleet-coordinator"), "serve", "--model", str(demo_hf), "--port", "0",
                               "--no-announce", "--build-cache-dir", str(tmp_path / "builds"),
                               "--expect-workers", "2", "--workers-timeout-s", "8"], tmp_path / "other.log", stack)
        assert other.popen.wait(timeout=120) == 2, other.text()[-3000:]
        for address in addresses:
            assert f"{address}: serves stage" in other.text(), other.text()[-3000:]
        assert "found by mDNS, it is not taken" in other.text()
        assert ": sent" not in other.text()
    assert load_manifest(the_build(tmp_path)).manifest.num_stages == 2
