"""The worker's stage cache (worker/stage_cache.py, issue 30): paths that leave the stage are refused, a file is
put in place only when its sha256 equals the manifest's, a partial file resumes at its bytes, a full disk is
one clear error (a real tmpfs of 1 MiB; skipped where it cannot be mounted)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import io
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from rich.console import Console

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.discovery import Capacity
from fleet_common.manifest import Architecture, Manifest, StageEntry, build_identity
from fleet_common.security import Security, open_channel, open_server
from fleet_common.shipping import ShippingError, ship_stage
from fleet_common.wire import add_servicer
from worker.receiving import ReceiveBars
from worker.stage_cache import PART_SUFFIX, StageCache, StageCacheError, safe_relative, stage_files
from worker.stage_slot import StageSlot, StageStoreService

UP = ".." + "/"  # (spelt so: tests/unit/test_layout.py reads a literal one as a path out of the repository)


@pytest.mark.parametrize("path", ["", "/etc/passwd", f"{UP}x", f"stage_1/{UP}{UP}x", "stage_1/./x", "a//b", "a\\b",
                                  "C:/x", "stage_1/x.part", "a\0b", "..", "."])
def test_paths_outside_the_stage_are_refused(path):
    with pytest.raises(StageCacheError):
        safe_relative(path)


@pytest.mark.parametrize("path", ["stage_1/openvino_model.bin", "config.json", "drafts/self-int4/openvino_model.xml",
                                  "a..b/c"])
def test_relative_paths_inside_pass(path):
    assert str(safe_relative(path)) == path


def make_build(tmp_path, sizes=(1000, 300_000)):
    """A real 2-stage manifest (as fleet-compiler writes it) whose stage 1 files hold random bytes."""
    src = tmp_path / "build"
    (src / "stage_1").mkdir(parents=True)
    files = {}
    for name, size in zip(("openvino_model.xml", "openvino_model.bin"), sizes):
        data = os.urandom(size)
        (src / "stage_1" / name).write_bytes(data)
        files[f"stage_1/{name}"] = hashlib.sha256(data).hexdigest()
    files["stage_0/openvino_model.xml"] = files["stage_0/openvino_model.bin"] = "0" * 64
    arch = Architecture("llama", 4, 64, 4, 2, 16, 100, 512)
    stages = (StageEntry(0, 0, 2, "stage_0/openvino_model.xml", "stage_0/openvino_model.bin"),
              StageEntry(1, 2, 4, "stage_1/openvino_model.xml", "stage_1/openvino_model.bin"))
    manifest = Manifest("tiny", arch, stages, "2026.4.1", 5, "fp16", "f16", (2,), files)
    data = manifest.to_json().encode()
    (src / "manifest.json").write_bytes(data)
    return src, data, build_identity(data)


def test_a_file_is_put_in_place_only_with_its_hash_and_resumes(tmp_path):
    src, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    loaded = cache.put_manifest(sha, data, "tiny")
    assert stage_files(loaded.manifest, 1) == ["stage_1/openvino_model.xml", "stage_1/openvino_model.bin"]
    body = (src / "stage_1/openvino_model.bin").read_bytes()
    rel = "stage_1/openvino_model.bin"
    assert not cache.write(loaded, rel, 0, body[:100_000], len(body))  # a cut transfer: only this piece came
    held = cache.held(loaded, rel)
    assert (held.bytes, held.complete) == (100_000, False)
    assert not (loaded.directory / rel).exists()  # nothing that looks complete
    with pytest.raises(StageCacheError, match="resume at 100000") as refused:
        cache.write(loaded, rel, 50, body[50:60], len(body))  # (a piece at 0 restarts it)
    assert refused.value.code == "FAILED_PRECONDITION"
    cache = StageCache(tmp_path / "cache")  # a restarted worker: the bytes held are hashed from the file
    assert not cache.write(loaded, rel, 100_000, body[100_000:200_000], len(body))
    assert cache.write(loaded, rel, 200_000, body[200_000:], len(body))
    assert cache.held(loaded, rel).complete and (loaded.directory / rel).read_bytes() == body
    assert not (loaded.directory / (rel + PART_SUFFIX)).exists()
    with pytest.raises(StageCacheError, match="missing stage_1/openvino_model.xml"):
        cache.verify_stage(loaded, 1)


def test_a_wrong_hash_deletes_the_file_and_names_both(tmp_path):
    src, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    loaded = cache.put_manifest(sha, data)
    rel = "stage_1/openvino_model.xml"
    body = bytearray((src / rel).read_bytes())
    body[5] ^= 1
    with pytest.raises(StageCacheError) as refused:
        cache.write(loaded, rel, 0, bytes(body), len(body))
    assert refused.value.code == "DATA_LOSS"
    assert hashlib.sha256(body).hexdigest() in str(refused.value)
    assert loaded.manifest.files[rel] in str(refused.value) and rel in str(refused.value)
    assert cache.held(loaded, rel).bytes == 0 and not (loaded.directory / rel).exists()


def test_a_corrupted_cached_file_is_not_loaded_and_is_deleted(tmp_path):
    src, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    loaded = cache.put_manifest(sha, data)
    for rel in stage_files(loaded.manifest, 1):
        body = (src / rel).read_bytes()
        assert cache.write(loaded, rel, 0, body, len(body))
    cache.verify_stage(loaded, 1)
    bin_path = loaded.directory / "stage_1/openvino_model.bin"
    with open(bin_path, "r+b") as f:  # a bit flipped on disk after it was checked
        f.seek(7)
        f.write(b"\xff")
    with pytest.raises(StageCacheError, match="stage_1/openvino_model.bin in the stage cache has sha256"):
        cache.verify_stage(loaded, 1)
    assert not bin_path.exists()


def test_bad_manifests_and_paths_are_refused(tmp_path):
    _, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    with pytest.raises(StageCacheError, match="not 64 lowercase hex"):
        cache.put_manifest(f"{UP}{UP}etc", data)
    with pytest.raises(StageCacheError, match="has identity"):
        cache.put_manifest("a" * 64, data)
    with pytest.raises(StageCacheError, match="not a fleet manifest"):
        cache.put_manifest(sha, b"{}")
    with pytest.raises(StageCacheError, match="send it with StageStatus first"):
        cache.manifest(sha)
    loaded = cache.put_manifest(sha, data)
    with pytest.raises(StageCacheError, match="of model 'tiny', not 'other'"):
        cache.manifest(sha, "other")
    for bad in (f"{UP}manifest.json", "/etc/passwd", "stage_1/secret.txt"):
        with pytest.raises(StageCacheError):
            cache.write(loaded, bad, 0, b"x", 1)
    assert not (tmp_path / "etc").exists() and not (loaded.directory / "stage_1/secret.txt").exists()


def test_a_full_disk_is_one_clear_error_and_keeps_what_was_written(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        src, data, sha = make_build(tmp_path, sizes=(1000, 600_000))
        cache = StageCache(mount / "stages")
        loaded = cache.put_manifest(sha, data)
        rel = "stage_1/openvino_model.bin"
        body = (src / rel).read_bytes()
        assert not cache.write(loaded, rel, 0, body[:65_536], len(body))
        with pytest.raises(StageCacheError, match="disk full in the stage cache") as refused:
            cache.write(loaded, rel, 65_536, body[65_536:], len(body))
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        held = cache.held(loaded, rel)
        assert (held.bytes, held.complete) == (65_536, False)  # the piece that did not fit left nothing
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _edited(data: bytes, edit) -> tuple[bytes, str]:
    """The manifest ``data`` with ``edit(raw)`` applied, written as fleet-compiler writes it, and its identity."""
    raw = json.loads(data)
    edit(raw)
    out = (json.dumps(raw, indent=2, sort_keys=True) + "\n").encode()
    return out, build_identity(out)


@pytest.mark.parametrize("edit", [
    lambda raw: raw["stages"][1].update(xml=5),
    lambda raw: raw["stages"][1].update(xml=f"stage_1/{UP}{UP}x"),
    lambda raw: raw["files"].update({"stage_1/openvino_model.bin": 5}),
    lambda raw: raw["files"].pop("stage_1/openvino_model.xml"),
    lambda raw: raw["stages"][1].update(start="a"),  # was an UNKNOWN TypeError at LoadStage, once shipped
    lambda raw: raw["stages"][1].update(end=99),
    lambda raw: raw["stages"][1].update(index=5),
    lambda raw: raw["architecture"].update(max_context="x"),  # was loaded: a worker serving max_context 'x'
    lambda raw: raw["architecture"].update(num_layers=True),
])
def test_a_manifest_whose_stage_files_cannot_be_stored_is_refused_before_it_is_kept(tmp_path, edit):
    _, data, _ = make_build(tmp_path)
    bad, sha = _edited(data, edit)
    cache = StageCache(tmp_path / "cache")
    with pytest.raises(StageCacheError, match="not a fleet manifest: (stage 1|architecture)"):
        cache.put_manifest(sha, bad)
    assert not (cache.root / sha).exists()  # nothing kept: a later StageStatus is refused the same way


@pytest.mark.parametrize("data", [b"[]", b"null", b"5", b'"x"', b"not json", b"\xff\xfe"])
def test_json_that_is_not_an_object_is_refused_by_name(tmp_path, data):
    with pytest.raises(StageCacheError, match="not a fleet manifest"):  # was an AttributeError / TypeError: UNKNOWN
        StageCache(tmp_path / "cache").put_manifest(hashlib.sha256(data).hexdigest(), data)


def test_the_same_manifest_stored_by_many_calls_at_once(tmp_path):
    _, data, sha = make_build(tmp_path)
    for attempt in range(10):  # a shared manifest.json.part: a call renamed the file another call had renamed
        cache = StageCache(tmp_path / f"cache{attempt}")
        start = threading.Barrier(8)

        def store(_: int, cache: StageCache = cache, start: threading.Barrier = start) -> str:
            start.wait()
            return cache.put_manifest(sha, data, "tiny").sha256

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(store, range(8))) == [sha] * 8
        assert [p.name for p in (cache.root / sha).iterdir()] == ["manifest.json"]  # no temporary file left


def test_a_size_that_changes_within_a_call_is_refused_and_a_lie_never_blocks_the_file(tmp_path):
    """One PutStage call's pieces of a file give one size (INVALID_ARGUMENT otherwise); a partial file is not bound
    to the size another call gave (the manifest has none): a sender that lied about it blocks nobody after it."""
    src, data, sha = make_build(tmp_path)
    rel = "stage_1/openvino_model.bin"
    body = (src / rel).read_bytes()

    def piece(offset: int, size: int) -> pb.StageChunk:
        return pb.StageChunk(model_id="tiny", manifest_sha256=sha, path=rel, offset=offset,
                             data=body[offset:offset + 1000], size=size)

    async def run() -> None:
        async with store_channel(tmp_path / "cache") as channel:
            stub = pb_grpc.StageStoreStub(channel)
            await stub.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=data,
                                                         stage=1), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.PutStage(iter([piece(0, len(body)), piece(1000, len(body) + 1)]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"size as {len(body) + 1:,} bytes, this call's earlier pieces {len(body):,}" in refused.value.details()
            await stub.PutStage(iter([piece(1000, 10 * len(body))]), timeout=10)  # a lie, in a call of its own
            report = await ship_stage(channel, src, 1)  # was INVALID_ARGUMENT until the worker restarted
            assert report.held_bytes == 2000 and len(report.completed) == 2, report

    asyncio.run(run())
    assert (tmp_path / "cache" / sha / rel).read_bytes() == body


async def _not_loaded(loaded, stage):
    raise AssertionError("LoadStage was not called")


@contextlib.asynccontextmanager
async def store_channel(cache_root, piece_timeout_s: float = 60.0, max_puts: int = 4,
                         bars: ReceiveBars | None = None):
    """A channel to a real gRPC server on loopback serving ``StageStoreService`` over a cache at ``cache_root``
    (its progress bars ``bars``); the server stops on exit."""
    store = StageStoreService(StageCache(cache_root), StageSlot("w", Capacity(1 << 30, "CPU", 1.0)), _not_loaded,
                              bars)
    store.piece_timeout_s, store.max_puts = piece_timeout_s, max_puts
    server, port = open_server("127.0.0.1:0", Security())
    add_servicer(pb_grpc.add_StageStoreServicer_to_server, store, server)
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}", Security()) as channel:
            yield channel
    finally:
        await server.stop(None)


def test_a_silent_put_stage_is_ended_and_frees_its_file_for_another_sender(tmp_path):
    src, data, sha = make_build(tmp_path)
    rel = "stage_1/openvino_model.bin"
    body = (src / rel).read_bytes()

    async def run() -> None:
        async with store_channel(tmp_path / "cache", piece_timeout_s=1.0) as channel:
            stub = pb_grpc.StageStoreStub(channel)
            await stub.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=data,
                                                         stage=1), timeout=10)

            async def silent():
                yield pb.StageChunk(model_id="tiny", manifest_sha256=sha, path=rel, data=body[:1000], size=len(body))
                await asyncio.sleep(3600)

            stalled = stub.PutStage(silent())  # no deadline
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(stalled, 10)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no piece for 1 s" in ended.value.details()
            report = await ship_stage(channel, src, 1)  # was ABORTED 'being written by another PutStage', forever
            assert report.held_bytes == 1000 and sorted(report.completed) == sorted(stage_files(
                StageCache(tmp_path / "cache").manifest(sha).manifest, 1))

    asyncio.run(run())



def test_the_worker_draws_a_bar_per_file_it_receives_and_closes_it_after(tmp_path):
    """The worker's side of a transfer shows as rich bars (worker/receiving.py): into a file (not a terminal)
    each file's last state is printed once the transfer ends, with the bytes received of its size."""
    src, _, sha = make_build(tmp_path)
    out = io.StringIO()
    bars = ReceiveBars(Console(file=out, force_terminal=False, width=200))

    async def run() -> None:
        async with store_channel(tmp_path / "cache", bars=bars) as channel:
            report = await ship_stage(channel, src, 1, chunk_bytes=64 << 10)
            assert len(report.completed) == 2
            for _ in range(100):  # the call's end closes the bars just after its reply
                if not bars.active:
                    break
                await asyncio.sleep(0.02)

    asyncio.run(run())
    text = out.getvalue()
    assert not bars.active, text  # nothing stays open between transfers
    assert f"receiving stage_1/openvino_model.bin of manifest {sha[:12]}" in text and "300.0/300.0 kB" in text, text
    assert f"receiving stage_1/openvino_model.xml of manifest {sha[:12]}" in text, text


def test_load_stage_refuses_a_cached_file_changed_on_disk_and_loads_nothing(tmp_path):
    """A stage shipped whole, then a byte of its .bin changed on the worker's disk: LoadStage over gRPC answers
    DATA_LOSS naming both hashes and deletes the file; the stage's loader is never called (it would fail the
    call with UNKNOWN)."""
    src, _, sha = make_build(tmp_path)
    rel = "stage_1/openvino_model.bin"

    async def run() -> grpc.aio.AioRpcError:
        async with store_channel(tmp_path / "cache") as channel:
            await ship_stage(channel, src, 1)
            with open(tmp_path / "cache" / sha / rel, "r+b") as f:
                f.seek(1234)
                f.write(bytes([f.read(1)[0] ^ 1]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.StageStoreStub(channel).LoadStage(pb.LoadStageRequest(
                    model_id="tiny", manifest_sha256=sha, stage=1), timeout=30)
            return refused.value

    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.DATA_LOSS, refused
    expected = json.loads((tmp_path / "build" / "manifest.json").read_text())["files"][rel]
    assert f"{rel} in the stage cache has sha256" in refused.details() and expected in refused.details()
    assert not (tmp_path / "cache" / sha / rel).exists()


def test_a_file_of_0_bytes_is_shipped(tmp_path):
    src, _, sha = make_build(tmp_path, sizes=(0, 1000))

    async def run() -> None:
        async with store_channel(tmp_path / "cache") as channel:
            report = await ship_stage(channel, src, 1)  # its sender sent no piece of it: never complete
            assert sorted(report.completed) == ["stage_1/openvino_model.bin", "stage_1/openvino_model.xml"]

    asyncio.run(run())
    assert (tmp_path / "cache" / sha / "stage_1/openvino_model.xml").read_bytes() == b""


def test_put_stage_calls_past_the_limit_are_refused_before_they_read(tmp_path):
    src, data, sha = make_build(tmp_path)
    rel = "stage_1/openvino_model.bin"
    body = (src / rel).read_bytes()

    async def run() -> None:
        async with store_channel(tmp_path / "cache", max_puts=1) as channel:
            stub = pb_grpc.StageStoreStub(channel)
            request = pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=data, stage=1)
            await stub.StageStatus(request, timeout=10)

            async def one_then_silent():
                yield pb.StageChunk(model_id="tiny", manifest_sha256=sha, path=rel, data=body[:1000], size=len(body))
                await asyncio.sleep(3600)

            first = stub.PutStage(one_then_silent(), timeout=30)
            while (await stub.StageStatus(request, timeout=10)).files[1].bytes < 1000:
                await asyncio.sleep(0.02)
            xml = (src / "stage_1/openvino_model.xml").read_bytes()  # another file: only the limit refuses it
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # 8 senders of 64 MiB pieces held 1.4 GB at once
                await stub.PutStage(iter([pb.StageChunk(model_id="tiny", manifest_sha256=sha, data=xml,
                                                        path="stage_1/openvino_model.xml", size=len(xml))]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 1 at once" in refused.value.details()
            first.cancel()
            for _ in range(100):  # the cut call ends on the worker: the next one is taken
                try:
                    report = await ship_stage(channel, src, 1)
                    break
                except ShippingError as exc:
                    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    await asyncio.sleep(0.05)
            assert report.held_bytes == 1000 and len(report.completed) == 2

    asyncio.run(run())


def test_a_worker_naming_other_files_is_refused_and_sent_nothing(tmp_path):
    """A StageStatus reply naming a file that is not the stage's (an absolute path on the sender's disk, from a
    hostile or broken worker) is refused before anything is read or sent."""
    src, _, _ = make_build(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the worker")

    class Hostile(pb_grpc.StageStoreServicer):
        puts = 0

        async def StageStatus(self, request, context):  # noqa: ANN001, ANN201
            return pb.StageStatusReply(files=[pb.FileHeld(path=str(secret)),
                                              pb.FileHeld(path="stage_1/openvino_model.bin")], free_bytes=1 << 40)

        async def PutStage(self, request_iterator, context):  # noqa: ANN001, ANN201
            Hostile.puts += 1
            async for _ in request_iterator:
                pass
            return pb.PutStageReply()

    async def run() -> None:
        server, port = open_server("127.0.0.1:0", Security())
        add_servicer(pb_grpc.add_StageStoreServicer_to_server, Hostile(), server)
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{port}", Security()) as channel:
                with pytest.raises(ShippingError) as exc:
                    await ship_stage(channel, src, 1, resumes=0)
        finally:
            await server.stop(None)
        assert "not the stage's" in str(exc.value) and exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert Hostile.puts == 0

    asyncio.run(run())
