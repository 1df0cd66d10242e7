"""coordinator/fleet/planned.py: empty workers' capacities become planner nodes and a plan; a too-small
fleet is refused naming the worker; the build key follows source, ranges and weights."""

from __future__ import annotations

import pytest

from compiler.planner import ModelDims, PlanRefused
from coordinator.fleet.planned import build_key, nodes_from_capacities, plan_fleet
from fleet_common.discovery import Capacity
from tests.unit.test_planner import CONFIG

DIMS = ModelDims.from_config(CONFIG, "m")


def test_capacities_plan_the_faster_worker_more_layers():
    caps = {"pc-a": Capacity(8 * 2**30, "CPU", 10.0), "pc-b": Capacity(8 * 2**30, "CPU", 20.0)}
    nodes = nodes_from_capacities(caps, DIMS)
    assert [n.name for n in nodes] == ["pc-a", "pc-b"]
    assert nodes[0].ms_per_layer == pytest.approx(10.0 * DIMS.layer_params * 2 / 1e9)
    p = plan_fleet(DIMS, caps)
    a, b = p.stages
    assert a.end - a.start > b.end - b.start


def test_too_small_worker_is_refused_by_name():
    caps = {"pc-a": Capacity(8 * 2**30, "CPU", 10.0), "pc-tiny": Capacity(2**20, "CPU", 10.0)}
    with pytest.raises(PlanRefused) as exc:
        plan_fleet(DIMS, caps)
    assert exc.value.node == "pc-tiny" and exc.value.shortfall_bytes > 0


def test_build_key():
    assert build_key("ab", "0-14,15-29", "fp16") == build_key("ab", "0-14,15-29", "fp16")
    assert build_key("ab", "0-14,15-29", "fp16") != build_key("ab", "0-13,14-29", "fp16")
    assert build_key("ab", "0-14,15-29", "fp16") != build_key("ab", "0-14,15-29", "int8")


def test_collect_times_out_naming_what_was_not_found():
    import asyncio
    import socket

    from coordinator.fleet.planned import collect_capacities
    from fleet_common.security import Security

    with socket.socket() as s:  # a free port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError) as exc:
        asyncio.run(collect_capacities([address], Security(), expect=1, timeout_s=0.5))
    assert "expected 1 empty workers, 0 answered" in str(exc.value) and address in str(exc.value)


def test_build_key_follows_kv_precision_devices_and_compiler_code():
    from compiler.code_key import compiler_key

    key = build_key("ab", "0:14,14:30", "fp16", "f16", ("CPU", "CPU"), code="c1")
    assert key == build_key("ab", "0:14,14:30", "fp16", "f16", ("CPU", "CPU"), code="c1")
    assert key != build_key("ab", "0:14,14:30", "fp16", "f32", ("CPU", "CPU"), code="c1")
    assert key != build_key("ab", "0:14,14:30", "fp16", "f16", ("CPU", "GPU"), code="c1")
    assert key != build_key("ab", "0:14,14:30", "fp16", "f16", ("CPU", "CPU"), code="c2")
    assert build_key("ab", "0:14,14:30", "gguf") == build_key("ab", "0:14,14:30", "gguf", code=compiler_key())


def test_source_hash_is_kept_by_path_size_and_mtime(tmp_path):
    import hashlib
    import json
    import os

    from coordinator.fleet.planned import SOURCE_HASHES, source_sha256

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first = source_sha256(src, tmp_path / "cache")
    assert first == source_sha256(src) == hashlib.sha256(b"m.gguf\0" + src.read_bytes()).hexdigest()
    assert json.loads((tmp_path / "cache" / SOURCE_HASHES).read_text())[str(src.resolve())]["sha256"] == first
    stamp = src.stat().st_mtime_ns
    src.write_bytes(b"GGUF" + bytes(reversed(range(256))) * 64)  # same size; mtime put back: taken as unchanged
    os.utime(src, ns=(stamp, stamp))
    assert source_sha256(src, tmp_path / "cache") == first  # the kept hash: the bytes were not read again
    os.utime(src, ns=(stamp + 1000, stamp + 1000))
    assert source_sha256(src, tmp_path / "cache") == source_sha256(src) != first
    (tmp_path / "cache" / SOURCE_HASHES).write_text("{not json")
    assert source_sha256(src, tmp_path / "cache") == source_sha256(src)  # an unreadable cache: hashed over


def test_collect_without_expect_waits_for_one_heard_address_at_least():
    import asyncio
    import socket

    from coordinator.fleet.planned import collect_capacities
    from fleet_common.security import Security

    with socket.socket() as s:  # a free port nothing listens on, as if zeroconf had heard it
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError) as exc:
        asyncio.run(collect_capacities([], Security(), expect=0, timeout_s=0.5, heard={address}, settle_s=0.1))
    assert "expected at least 1 empty workers, 0 answered" in str(exc.value) and address in str(exc.value)


def test_speeds_within_the_tolerance_are_planned_as_equal_and_split_evenly():
    from coordinator.fleet.planned import planning_speeds

    assert planning_speeds({"a": 10.0, "b": 11.5, "c": 30.0, "d": 35.0, "e": 100.0}) == {
        "a": 10.75, "b": 10.75, "c": 32.5, "d": 32.5, "e": 100.0}
    assert planning_speeds({"a": 10.0, "b": 12.1}) == {"a": 10.0, "b": 12.1}  # 21% apart: as measured
    near = plan_fleet(DIMS, {"pc-a": Capacity(8 * 2**30, "CPU", 10.0), "pc-b": Capacity(8 * 2**30, "CPU", 11.9)})
    same = plan_fleet(DIMS, {"pc-a": Capacity(8 * 2**30, "CPU", 11.0), "pc-b": Capacity(8 * 2**30, "CPU", 11.0)})
    assert near.layers == same.layers


def test_an_empty_worker_keeps_its_id_and_holds_its_stage_cache(tmp_path):
    import os
    import subprocess
    import sys

    from worker.identity import StagesDirInUse, claim

    worker_id, fd = claim(tmp_path / "stages")
    assert len(worker_id) == 12 and int(worker_id, 16) >= 0
    other = subprocess.run([sys.executable, "-c", "import sys; from worker.identity import claim; claim(sys.argv[1])",
                            str(tmp_path / "stages")], capture_output=True, text=True, cwd=os.getcwd())
    assert other.returncode != 0 and "in use by another fleet-worker" in other.stderr, other.stderr
    assert f"pid {os.getpid()}" in other.stderr
    os.close(fd)
    again, fd = claim(tmp_path / "stages")  # the lock is free again; the id is the one written at the first start
    os.close(fd)
    assert again == worker_id
    (tmp_path / "stages" / "worker-id").write_text("garbage\n")
    new, fd = claim(tmp_path / "stages")
    os.close(fd)
    assert new != worker_id and len(new) == 12
    with pytest.raises(StagesDirInUse):  # flock is per open file: a second claim in one process is refused too
        _, fd = claim(tmp_path / "stages")
        claim(tmp_path / "stages")
