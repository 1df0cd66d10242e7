"""Pre-compiled blobs (issue 5, item 2): a worker imports its stage's blob when it was made for this
device, OpenVINO version, CPU and config, and serves without compiling; a stale blob is ignored with a
warning and the IR compiled; the second start of a worker without a blob imports from OpenVINO's model
cache.

The builds are hard-linked copies of the cached 2-stage test build with their own manifest, blobs made
by ``fleet-compiler precompile`` for the test workers' settings (f32, 1 thread). Every worker runs with
--no-announce and every coordinator with --no-discover --peer: other tests on this machine run fleets
at the same time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import openvino as ov
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from tests.conftest import BIN, Fleet, chat, start_worker

pytestmark = pytest.mark.integration

PROMPT = "What is the capital of France?"
TOKENS = 24


def copy_build(src: Path, out: Path) -> Path:
    """``src`` hard-linked into ``out``, except its manifest (copied: precompile rewrites it)."""
    shutil.copytree(src, out, copy_function=os.link)
    (out / "manifest.json").unlink()
    shutil.copy2(src / "manifest.json", out / "manifest.json")
    return out


@pytest.fixture(scope="module")
def blob_build(build_2, tmp_path_factory) -> Path:
    out = copy_build(build_2, tmp_path_factory.mktemp("blobs") / "build")
    subprocess.run([str(BIN / "fleet-compiler"), "precompile", str(out), "--device", "CPU", "--threads", "1",
                    "--inference-precision", "f32"], check=True, capture_output=True, text=True, timeout=300)
    return out


def info(address: str) -> pb.InfoReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)


def fleet_answer(build: Path, log_dir: Path, *worker_args: str) -> tuple[str, list[str], list[pb.InfoReply]]:
    """Start both workers (``worker_args``) and a coordinator naming them; return the greedy answer to
    PROMPT, the workers' logs and their Info replies."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(build, log_dir, peers=True, worker_args=worker_args)
    try:
        r = chat(fleet.url, PROMPT, max_tokens=TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        return (r.json()["choices"][0]["message"]["content"], [proc.text() for proc, _ in fleet.workers],
                [info(address) for _, address in fleet.workers])
    finally:
        fleet.stop()


def test_matching_blob_is_imported_and_serves_as_the_ir_does(blob_build, build_2, tmp_path):
    manifest = load_manifest(blob_build).manifest
    assert sorted(b.stage for b in manifest.blobs) == [0, 1]
    assert load_manifest(blob_build).sha256 == load_manifest(build_2).sha256  # blobs leave the build's identity
    text, logs, infos = fleet_answer(blob_build, tmp_path / "blob", "--no-model-cache")
    for stage, (log, reply) in enumerate(zip(logs, infos)):
        blob = next(b for b in manifest.blobs if b.stage == stage)
        assert f"compiled blob {blob.file} imported in" in log, log
        assert "compiling the IR" not in log and "IR compiled" not in log, log
        assert reply.load_source == "blob" and reply.load_detail == blob.file and 0 < reply.load_s < 30, reply

    ir_text, ir_logs, ir_infos = fleet_answer(blob_build, tmp_path / "ir", "--no-blobs", "--no-model-cache")
    assert [r.load_source for r in ir_infos] == ["ir", "ir"] and all("IR compiled" in log for log in ir_logs)
    assert text == ir_text and "Paris" in text


def test_stale_blob_is_ignored_with_a_warning(blob_build, tmp_path):
    stale = copy_build(blob_build, tmp_path / "stale")
    raw = json.loads((stale / "manifest.json").read_text())
    for blob in raw["blobs"]:
        blob["key"]["openvino_version"] = "2025.0.0-17942-stale"
    (stale / "manifest.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    text, logs, infos = fleet_answer(stale, tmp_path / "logs", "--no-model-cache")
    for stage, (log, reply) in enumerate(zip(logs, infos)):
        blob = raw["blobs"][stage]["file"]
        warning = (f"WARNING worker[{stage}] worker.loader: stage {stage}: blob {blob} is for OpenVINO "
                   f"2025.0.0-17942-stale, this is {ov.get_version()}: compiling the IR")
        assert warning in log, log
        assert "imported in" not in log and "IR compiled in" in log, log
        assert reply.load_source == "ir" and "is for OpenVINO 2025.0.0-17942-stale" in reply.load_detail, reply
    assert "Paris" in text


def test_second_start_imports_from_the_model_cache(blob_build, tmp_path):
    cache = tmp_path / "cache"
    sources = []
    for run in range(2):
        proc, address = start_worker(blob_build, 1, tmp_path, "--no-announce", "--no-blobs", "--cache-dir", str(cache),
                                     name=f"-run{run}")
        try:
            sources.append(info(address).load_source)
        finally:
            proc.stop()
    assert sources == ["ir", "model-cache"]
    assert len(list(cache.glob("*/*.blob"))) == 1


def test_model_cache_stays_under_its_size_bound(build_2, tmp_path):
    """Each stage IR gets a cache folder; past ``cache_max_bytes`` the least recently loaded folders go
    (the one just written stays), so the cache of a machine that ran many builds stays bounded."""
    from worker.loader import load_shard

    loaded, cache = load_manifest(build_2), tmp_path / "cache"
    sources = []
    for stage in (0, 1, 0):
        shard = load_shard(loaded, stage, threads=1, inference_precision="f32", blobs=False, cache_dir=cache,
                           cache_max_bytes=1)
        sources.append(shard.source)
        folders = [f for f in cache.iterdir() if f.is_dir()]
        assert [f.name for f in folders] == [Path(shard.detail).name], folders  # only the one just loaded
        del shard
    assert sources == ["ir", "ir", "ir"]  # stage 0's entry was removed when stage 1 was written
    big = 1 << 40
    for stage in (1, 0):  # under a bound they both fit in: the second load of stage 0 is a cache hit
        sources.append(load_shard(loaded, stage, threads=1, inference_precision="f32", blobs=False,
                                  cache_dir=cache, cache_max_bytes=big).source)
    assert sources[3:] == ["ir", "model-cache"]
    assert len([f for f in cache.iterdir() if f.is_dir()]) == 2
