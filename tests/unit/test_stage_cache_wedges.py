"""A worker's stage cache must never wedge a file (worker/stage_cache.py, worker/stage_slot.py; issue 30, the empty
fleet's hardening), on a real gRPC server on loopback: a partial file of every byte left by a worker stopped before
its rename is checked and put in place (or sent again), a partial file longer than the file is restarted, a
damaged cached manifest is replaced by the one sent, manifests are bounded."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.shipping import ship_stage
from tests.unit.test_stage_cache import make_build, store_channel
from worker.stage_cache import PART_SUFFIX, StageCache, StageCacheError

FILES = ("stage_1/openvino_model.xml", "stage_1/openvino_model.bin")


def test_every_byte_written_but_not_renamed_is_checked_and_put_in_place(tmp_path):
    """A worker killed after a file's last byte but before its rename: shipping again puts both files in place
    (it sent 0 bytes and reported success, and LoadStage said 'missing ... ship it first', for ever)."""
    src, _, sha = make_build(tmp_path)

    async def run() -> None:
        async with store_channel(tmp_path / "cache") as channel:
            await ship_stage(channel, src, 1)
        for rel in FILES:
            final = tmp_path / "cache" / sha / rel
            final.rename(final.with_name(final.name + PART_SUFFIX))
        async with store_channel(tmp_path / "cache") as channel:  # the worker restarted
            report = await ship_stage(channel, src, 1)
            assert sorted(report.completed) == sorted(FILES) and report.sent_bytes == 0, report

    asyncio.run(run())
    for rel in FILES:
        assert (tmp_path / "cache" / sha / rel).read_bytes() == (src / rel).read_bytes()
        assert not (tmp_path / "cache" / sha / (rel + PART_SUFFIX)).exists()


def test_load_stage_puts_in_place_a_partial_file_that_hashes_right(tmp_path):
    src, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    loaded = cache.put_manifest(sha, data)
    for rel in FILES:
        (loaded.directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (loaded.directory / (rel + PART_SUFFIX)).write_bytes((src / rel).read_bytes())
    cache.verify_stage(loaded, 1)  # was FAILED_PRECONDITION 'missing ... (ship it first)'
    assert all((loaded.directory / rel).is_file() for rel in FILES)


@pytest.mark.parametrize("held", ["every byte, all wrong", "1 byte too many", "100,000 bytes too many"])
def test_a_partial_file_that_cannot_be_resumed_is_sent_again(tmp_path, held):
    """A ``.part`` of the file's size whose bytes are wrong, or one longer than the file: shipping again puts the
    file in place, the partial file gone."""
    src, _, sha = make_build(tmp_path)
    rel = FILES[1]
    body = (src / rel).read_bytes()
    part = tmp_path / "cache" / sha / (rel + PART_SUFFIX)
    part_bytes = {"every byte, all wrong": bytes(len(body)), "1 byte too many": body + bytes(1),
                  "100,000 bytes too many": body + bytes(100_000)}[held]

    async def run() -> None:
        async with store_channel(tmp_path / "cache") as channel:
            await pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
                model_id="tiny", manifest_sha256=sha, stage=1, manifest=(src / "manifest.json").read_bytes()),
                timeout=10)
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(part_bytes)
            report = await ship_stage(channel, src, 1)
            assert sorted(report.completed) == sorted(FILES), report

    asyncio.run(run())
    assert (tmp_path / "cache" / sha / rel).read_bytes() == body and not part.exists()


def test_a_piece_at_offset_0_restarts_the_partial_file(tmp_path):
    src, data, sha = make_build(tmp_path)
    cache = StageCache(tmp_path / "cache")
    loaded = cache.put_manifest(sha, data)
    rel = FILES[1]
    body = (src / rel).read_bytes()
    assert not cache.write(loaded, rel, 0, bytes(5000), len(body))  # wrong bytes, a cut transfer
    assert not cache.write(loaded, rel, 0, body[:1000], len(body))  # restarted: was 'resume at 5000' for ever
    assert cache.held(loaded, rel).bytes == 1000
    assert cache.write(loaded, rel, 1000, body[1000:], len(body))
    assert (loaded.directory / rel).read_bytes() == body
    with pytest.raises(StageCacheError, match="complete in the cache already"):
        cache.write(loaded, rel, 0, body[:10], len(body))


def test_a_damaged_cached_manifest_is_named_and_replaced_by_the_one_sent(tmp_path):
    src, _, sha = make_build(tmp_path)
    cached = tmp_path / "cache" / sha / "manifest.json"

    async def run() -> None:
        async with store_channel(tmp_path / "cache") as channel:
            await ship_stage(channel, src, 1)
            cached.write_bytes(cached.read_bytes()[:300])  # a truncated copy (a disk error)
            with pytest.raises(StageCacheError, match=f"the stage cache's {cached} is damaged") as damaged:
                StageCache(tmp_path / "cache").manifest(sha)
            assert damaged.value.code == "FAILED_PRECONDITION"
            report = await ship_stage(channel, src, 1)  # was INVALID_ARGUMENT for ever (the damaged copy was kept)
            assert report.held_bytes == sum((src / rel).stat().st_size for rel in FILES), report

    asyncio.run(run())
    assert StageCache(tmp_path / "cache").manifest(sha).sha256 == sha


@pytest.mark.parametrize(("manifest", "says"), [(b" " * ((1 << 20) + 1), "at most 1,048,576"),
                                                (b"[" * 200_000 + b"]" * 200_000, "nests too deep")])
def test_a_manifest_too_big_or_nested_too_deep_is_refused_clearly(tmp_path, manifest, says):
    async def run() -> grpc.aio.AioRpcError:
        async with store_channel(tmp_path / "cache") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
                    model_id="tiny", manifest_sha256="a" * 64, stage=1, manifest=manifest), timeout=30)
            return refused.value

    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and says in refused.details(), refused


def test_a_worker_busy_with_another_sender_is_asked_again_not_given_up_on(tmp_path):
    """RESOURCE_EXHAUSTED for the worker's busy PutStage slots is retried as a cut transfer is (1 s, doubling)."""
    src, data, sha = make_build(tmp_path)
    rel = FILES[1]
    body = (src / rel).read_bytes()

    async def run() -> None:
        async with store_channel(tmp_path / "cache", max_puts=1) as channel:
            stub = pb_grpc.StageStoreStub(channel)
            request = pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=data, stage=1)
            await stub.StageStatus(request, timeout=10)

            async def one_then_silent():
                yield pb.StageChunk(model_id="tiny", manifest_sha256=sha, path=rel, data=body[:1000], size=len(body))
                await asyncio.sleep(3600)

            other = stub.PutStage(one_then_silent(), timeout=30)  # another sender holds the one slot
            while (await stub.StageStatus(request, timeout=10)).files[1].bytes < 1000:
                await asyncio.sleep(0.02)
            asyncio.get_running_loop().call_later(0.5, other.cancel)
            report = await ship_stage(channel, src, 1)  # was ShippingError RESOURCE_EXHAUSTED at once
            assert sorted(report.completed) == sorted(FILES), report

    asyncio.run(run())


def test_a_cut_link_is_resumed_and_a_refusal_is_not():
    """What ``ship_stage`` resumes: a cut link (UNAVAILABLE, a deadline, ABORTED), a worker whose transfer slots
    are busy, and gRPC core's own INTERNAL of a connection that died under a stream's write (the rehearsal's
    fleet-wan cut gave 'INTERNAL: Internal error from Core' once in two runs); never the worker's refusals."""
    from fleet_common.shipping import BUSY, CORE_CUT, ShippingError, resumable

    def error(code: grpc.StatusCode, text: str) -> ShippingError:
        return ShippingError(f"worker 127.0.0.1:1: PutStage of stage_1/openvino_model.bin: {code.name}: {text}", code)

    for code, text in ((grpc.StatusCode.UNAVAILABLE, "Stream removed"), (grpc.StatusCode.DEADLINE_EXCEEDED, ""),
                       (grpc.StatusCode.ABORTED, "being written by another PutStage"),
                       (grpc.StatusCode.RESOURCE_EXHAUSTED, f"4 transfers at once: {BUSY}"),
                       (grpc.StatusCode.INTERNAL, CORE_CUT)):
        assert resumable(error(code, text)), (code, text)
    for code, text in ((grpc.StatusCode.RESOURCE_EXHAUSTED, "no space left: 12 MB free, 80 MB needed"),
                       (grpc.StatusCode.DATA_LOSS, "sha256 differs from the manifest's"),
                       (grpc.StatusCode.INTERNAL, "the stage failed to compile"),
                       (grpc.StatusCode.INVALID_ARGUMENT, "bad path")):
        assert not resumable(error(code, text)), (code, text)
