"""Errors of an empty worker's stage store. Its refusals name no folder of its PC to the caller (issue 45 item 5): each bad
StageStatus / PutStage / ReuseStage / LoadStage a stranger can send, and a manifest damaged on the worker's disk,
is refused over real gRPC by a real ``fleet-worker`` process with details that do not hold its stage folder (as
given or resolved); the worker's own log keeps the whole message, path included. And the shipper counts as
sent only what the worker accepted (pieces it refused unread are not).

Workers run with --no-announce on loopback: other tests on this machine must not find them."""

from __future__ import annotations

import asyncio
import os
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.security import Security, open_channel
from fleet_common.shipping import ShippingError, ship_stage
from tests.integration.test_shipping import rpc_error
from tests.integration.test_store_hostile import chunk, empty_worker, synthetic_build

pytestmark = pytest.mark.integration


def test_refusals_name_no_path_of_the_stage_folder(tmp_path: Path) -> None:
    build, data, sha = synthetic_build(tmp_path / "build", [b"a" * 1000, b"b" * 1000])
    unknown = "ab" * 32  # well-formed, never sent
    folder = tmp_path / "w"  # the worker's --stages-dir
    with ExitStack() as stack:
        proc, address = empty_worker(tmp_path, stack)

        async def run() -> list[tuple[str, grpc.aio.AioRpcError]]:
            async with open_channel(address, Security()) as channel:
                store = pb_grpc.StageStoreStub(channel)
                refused = [
                    ("StageStatus of an unknown build", await rpc_error(store.StageStatus(pb.StageStatusRequest(
                        model_id="tiny", manifest_sha256=unknown, stage=1), timeout=30))),
                    ("PutStage of an unknown build", await rpc_error(store.PutStage(iter([chunk(
                        unknown, "stage_1/openvino_model.bin", 0, b"x" * 10, 10)]), timeout=30))),
                    ("ReuseStage of an unknown build", await rpc_error(store.ReuseStage(pb.ReuseRequest(
                        model_id="tiny", manifest_sha256=unknown, path="stage_1/openvino_model.bin", size=10),
                        timeout=30))),
                    ("LoadStage of an unknown build", await rpc_error(store.LoadStage(pb.LoadStageRequest(
                        model_id="tiny", manifest_sha256=unknown, stage=1), timeout=30))),
                    ("LoadStage of a build without its files", None),
                    ("StageStatus of a manifest damaged on disk", None),
                ]
                await store.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, stage=1,
                                                              manifest=data), timeout=30)
                refused[4] = (refused[4][0], await rpc_error(store.LoadStage(pb.LoadStageRequest(
                    model_id="tiny", manifest_sha256=sha, stage=1), timeout=30)))
                (folder / sha / "manifest.json").write_text("{not json")  # the disk, not the caller, damaged it
                refused[5] = (refused[5][0], await rpc_error(store.StageStatus(pb.StageStatusRequest(
                    model_id="tiny", manifest_sha256=sha, stage=1), timeout=30)))
                return refused

        refused = asyncio.run(run())
    log = (tmp_path / "w.log").read_text()
    roots = {str(folder), str(folder.resolve()), str(tmp_path), str(tmp_path.resolve())}
    for what, exc in refused:
        print(f"{what}: {exc.code().name}: {exc.details()}")
        assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT), (what, exc)
        assert exc.details(), what
        assert not any(root in exc.details() for root in roots), (what, exc.details())
    assert "damaged" in refused[5][1].details() and f"{sha}/manifest.json" in refused[5][1].details()
    assert "not in the cache: missing" in refused[4][1].details(), refused[4][1].details()
    # the worker's own log keeps where: its stage folder, named in the damaged manifest's line
    assert f"{folder}/{sha}/manifest.json is damaged" in log or f"{folder.resolve()}/{sha}/manifest.json" in log, \
        log[-3000:]


def test_pieces_the_worker_refuses_unread_are_not_counted_as_sent(tmp_path: Path) -> None:
    """The build's manifest leaves the worker's cache mid-shipping (as when another coordinator's build made room
    under --stages-max-gb): the next PutStage is refused at its first piece, while the shipper has streamed
    more pieces behind it. The shipper's progress (the coordinator's bars and its /health line) must end at
    the bytes the worker holds, not at the pieces that left."""
    build, _, sha = synthetic_build(tmp_path / "build", [b"a" * 1000, os.urandom(1 << 20) * 4])
    calls: list[tuple[str, int, int]] = []
    manifest = tmp_path / "w" / sha / "manifest.json"
    puts = []

    class SecondPutFindsNoManifest(grpc.aio.StreamUnaryClientInterceptor):
        """Deletes the worker's copy of the manifest as the second PutStage (the .bin's) starts."""

        async def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
            if details.method.endswith(b"/PutStage"):
                puts.append(details.method)
                if len(puts) == 2:
                    manifest.unlink()
            return await continuation(details, request_iterator)

    with ExitStack() as stack:
        _, address = empty_worker(tmp_path, stack)

        async def run() -> tuple[ShippingError, dict[str, int]]:
            async with grpc.aio.insecure_channel(address, interceptors=[SecondPutFindsNoManifest()]) as channel:
                with pytest.raises(ShippingError) as refused:
                    await ship_stage(channel, build, 1, lambda *a: calls.append(a), address=address,
                                     chunk_bytes=64 << 10, resumes=0)
                data = (build / "manifest.json").read_bytes()
                status = await pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
                    model_id="tiny", manifest_sha256=sha, stage=1, manifest=data), timeout=30)
                return refused.value, {f.path: f.bytes for f in status.files}

        refused, held = asyncio.run(run())
    print(f"refused: {refused}\nheld: {held}\nprogress calls: {calls}")
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "no manifest" in str(refused), refused
    for path, bytes_held in held.items():
        shown = [done for p, done, _ in calls if p == path]
        assert shown, (path, calls)
        assert shown[-1] == bytes_held, f"the last progress shows {shown[-1]:,} bytes of {path}, the worker holds " \
                                        f"{bytes_held:,}"
