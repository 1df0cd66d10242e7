"""Stage shipping to an empty worker (issue 30), on real processes and real gRPC on loopback: the demo's 2-stage
build's stage 1 shipped to a ``fleet-worker`` started with neither --shard nor --model (and --secret), loaded, and
its Forward compared with a static ``--shard 1`` worker's, and a coordinator given it by --peer before it was
loaded uses it once it is, answering as over the static worker; a transfer cut midway resumes and sends only the rest;
a wrong hash is refused and nothing is loaded; a restarted worker loads from its cache with nothing sent; a link
that keeps dropping is resumed over new connections until the stage arrives.

Workers run with --no-announce: other tests on this machine must not find them."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from bench import harness
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from fleet_common.security import Security, open_channel
from fleet_common.shipping import CHUNK_BYTES, ShippingError, load_stage, ship_stage
from fleet_common.wire import from_tensor, to_tensor
from tests.conftest import EXACT_WORKER, chat, start_coordinator, wait_ready

pytestmark = pytest.mark.integration

SECRET = "fleet shipping test secret 41d7"
CUT_PIECES = 5  # pieces of CHUNK_BYTES sent before the transfer is cut


def spawn_worker(log: Path, stack: ExitStack, *args: str) -> harness.Proc:
    """``fleet-worker ARGS`` (f32, one thread, --no-announce, a free port), stopped when ``stack`` closes."""
    return harness.spawn([*harness.tool("fleet-worker"), "--port", "0", "--no-announce", *EXACT_WORKER, *args], log,
                         stack)


def serving(proc: harness.Proc, empty: bool = False) -> str:
    """The address ``proc`` serves on once ready (an empty worker's: once ready as empty)."""
    return proc.wait_for(r"worker ready: empty .* serving on ([\d.]+:\d+)" if empty else r"serving on ([\d.]+:\d+)",
                         120).group(1)


async def rpc_error(awaitable) -> grpc.aio.AioRpcError:  # noqa: ANN001
    """The gRPC error ``awaitable`` raises (fails the test when it succeeds)."""
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


async def last_stage_top(address: str, security: Security, sha: str, hidden: np.ndarray) -> tuple:
    """(top ids, top logprobs) of one Forward of ``hidden`` [1, S, H] float32 through the last stage at ``address``."""
    async with open_channel(address, security) as channel:
        stub = pb_grpc.StageStub(channel)
        results = stub.Subscribe(pb.SubscribeRequest(subscriber_id="shipping-test"), timeout=60).__aiter__()
        await results.__anext__()  # the handshake: subscribed
        await stub.OpenSession(pb.OpenSessionRequest(session_id="s1", max_context=64, manifest_sha256=sha), timeout=30)
        await stub.Forward(pb.ForwardRequest(session_id="s1", step_id=1, stage=1, input=to_tensor(hidden),
                                             logits_count=hidden.shape[1], top_k=8, reply_to="shipping-test",
                                             manifest_sha256=sha), timeout=60)
        result = await results.__anext__()
        await stub.CloseSession(pb.CloseSessionRequest(session_id="s1"), timeout=30)
        return from_tensor(result.top_ids).copy(), from_tensor(result.top_logprobs).copy()


async def held(channel: grpc.aio.Channel, build: Path) -> dict[str, tuple[int, bool]]:
    """What the worker holds of stage 1's files: path -> (bytes, complete)."""
    loaded = load_manifest(build)
    status = await pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
        model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, stage=1), timeout=30)
    return {f.path: (f.bytes, f.complete) for f in status.files}


async def cut_transfer(channel: grpc.aio.Channel, build: Path, rel: str) -> None:
    """Send CUT_PIECES pieces of ``rel`` and cut the stream (the sender goes silent, then cancels its call)."""
    loaded = load_manifest(build)
    sent = asyncio.Event()

    async def pieces():  # noqa: ANN202
        with open(build / rel, "rb") as f:
            for i in range(CUT_PIECES):
                yield pb.StageChunk(model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, path=rel,
                                    offset=i * CHUNK_BYTES, data=f.read(CHUNK_BYTES), size=(build / rel).stat().st_size)
        sent.set()
        await asyncio.sleep(3600)  # a link gone silent

    call = pb_grpc.StageStoreStub(channel).PutStage(pieces(), timeout=120)
    await sent.wait()
    for _ in range(100):  # the worker writes each piece as it comes
        if (await held(channel, build))[rel][0] == CUT_PIECES * CHUNK_BYTES:
            break
        await asyncio.sleep(0.1)
    call.cancel()


async def refused_calls(address: str, build: Path, security: Security) -> None:
    """Without the secret, StageStatus and PutStage (a client stream) are UNAUTHENTICATED; bad paths and
    a wrong hash are refused by name, and LoadStage then loads nothing."""
    loaded = load_manifest(build)
    manifest = (build / "manifest.json").read_bytes()
    async with open_channel(address, Security()) as plain:
        store = pb_grpc.StageStoreStub(plain)
        exc = await rpc_error(store.StageStatus(pb.StageStatusRequest(manifest_sha256=loaded.sha256, manifest=manifest,
                                                                      stage=1), timeout=30))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
        exc = await rpc_error(store.PutStage(iter([pb.StageChunk(manifest_sha256=loaded.sha256)]), timeout=30))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
    async with open_channel(address, security) as channel:
        store = pb_grpc.StageStoreStub(channel)
        await store.StageStatus(pb.StageStatusRequest(model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256,
                                                      manifest=manifest, stage=1), timeout=30)
        for bad in (".." + "/manifest.json", "/etc/passwd"):
            exc = await rpc_error(store.PutStage(iter([pb.StageChunk(
                model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, path=bad, data=b"x", size=1)]),
                timeout=30))
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(bad) in exc.details(), exc
        rel = loaded.manifest.stages[1].xml
        body = bytearray((build / rel).read_bytes())
        body[100] ^= 1
        exc = await rpc_error(store.PutStage(iter([pb.StageChunk(
            model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, path=rel, data=bytes(body),
            size=len(body))]), timeout=30))
        assert exc.code() == grpc.StatusCode.DATA_LOSS, exc
        assert rel in exc.details() and hashlib.sha256(body).hexdigest() in exc.details()
        assert loaded.manifest.files[rel] in exc.details()
        assert (await held(channel, build))[rel] == (0, False)  # deleted
        with pytest.raises(ShippingError, match="not in the cache: missing"):
            await load_stage(channel, build, 1)
        info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=30)
        assert info.empty and not info.manifest_sha256


def test_ship_resume_load_and_restart(build_2, tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    security = Security.load(tmp_path / "secret")
    secret = ("--secret", str(tmp_path / "secret"))
    empty_args = ("--stages-dir", str(tmp_path / "stages"), *secret)
    loaded = load_manifest(build_2)
    files = [loaded.manifest.stages[1].xml, loaded.manifest.stages[1].bin]
    total = sum((build_2 / f).stat().st_size for f in files)
    hidden = np.random.default_rng(3).standard_normal((1, 6, loaded.manifest.architecture.hidden_size),
                                                     dtype=np.float32)

    async def first_run() -> None:
        await refused_calls(address, build_2, security)
        async with open_channel(address, security) as channel:
            info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=30)
            assert info.empty and info.memory_available_bytes > 0 and info.ms_per_gb > 0 and info.device == "CPU"
            exc = await rpc_error(pb_grpc.StageStub(channel).OpenSession(pb.OpenSessionRequest(session_id="x"),
                                                                          timeout=30))
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and "serves no stage yet" in exc.details()
            await cut_transfer(channel, build_2, files[1])
            assert (await held(channel, build_2))[files[1]] == (CUT_PIECES * CHUNK_BYTES, False)
            report = await ship_stage(channel, build_2, 1, address=address)
            assert report.held_bytes == CUT_PIECES * CHUNK_BYTES  # resumed where it stopped
            assert report.sent_bytes == total - CUT_PIECES * CHUNK_BYTES  # and sent only the rest
            assert sorted(report.completed) == sorted(files)
            reply = await load_stage(channel, build_2, 1, address=address)
            assert (reply.stage, reply.layer_start, reply.layer_end) == (1, 19, 30) and not reply.already_loaded
            info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=30)
            assert not info.empty and info.stage == 1 and info.manifest_sha256 == loaded.sha256
            again = await load_stage(channel, build_2, 1, address=address)
            assert again.already_loaded
        shipped = await last_stage_top(address, security, loaded.sha256, hidden)
        reference = await last_stage_top(static_address, security, loaded.sha256, hidden)
        np.testing.assert_array_equal(shipped[0], reference[0])  # the same top-8 tokens at every position
        np.testing.assert_array_equal(shipped[1], reference[1])  # f32, one thread: the same logprobs

    async def after_restart(address: str) -> None:
        async with open_channel(address, security) as channel:
            report = await ship_stage(channel, build_2, 1, address=address)
            assert report.sent_bytes == 0 and report.held_bytes == total and not report.completed
            await load_stage(channel, build_2, 1, address=address)
        shipped = await last_stage_top(address, security, loaded.sha256, hidden)
        reference = await last_stage_top(static_address, security, loaded.sha256, hidden)
        np.testing.assert_array_equal(shipped[1], reference[1])

    with ExitStack() as stack:  # the three workers start side by side
        static = spawn_worker(tmp_path / "static1.log", stack, "--shard", "1", "--model", str(build_2), *secret)
        stage0 = spawn_worker(tmp_path / "static0.log", stack, "--shard", "0", "--model", str(build_2), *secret)
        empty = spawn_worker(tmp_path / "empty.log", stack, *empty_args)
        static_address, stage0_address, address = serving(static), serving(stage0), serving(empty, empty=True)
        coordinators = []
        for i, peer in enumerate((address, static_address)):  # the shipped worker, then the static one
            (tmp_path / f"c{i}").mkdir()
            coordinators.append(start_coordinator(build_2, tmp_path / f"c{i}", "--no-discover", "--peer",
                                                  stage0_address, "--peer", peer, *secret))
            stack.callback(coordinators[-1][0].stop)
        assert httpx.get(f"{coordinators[0][1]}/health", timeout=10).status_code != 200  # stage 1: empty
        asyncio.run(first_run())
        answers = []
        for proc, url in coordinators:
            wait_ready(url, 60, proc)  # the shipped worker joined by itself once loaded
            r = chat(url, "Name three colours.", max_tokens=8, ignore_eos=True)
            assert r.status_code == 200, r.text
            answers.append(r.json()["fleet"]["completion_token_ids"])
        assert answers[0] == answers[1] and len(answers[0]) == 8
        assert "is empty" in coordinators[0][0].text()  # the coordinator said why it did not use it before
        empty.stop()
        restarted = spawn_worker(tmp_path / "restarted.log", stack, *empty_args)
        restarted_address = serving(restarted, empty=True)
        assert "(cached)" in restarted.text()  # the speed figure was not measured again
        asyncio.run(after_restart(restarted_address))


def test_a_link_that_keeps_dropping_is_resumed_until_the_stage_arrives(build_2, tmp_path):
    """Stage 1 shipped through a ``fleet-wan`` link that drops every connection after a third of the stage's
    bytes (both directions): ``ship_stage`` resumes it over new connections from what the worker holds, each
    attempt sending the next third, and the report counts every byte once; the stage loads (its files' hashes
    are the manifest's)."""
    from bench.wan.links import WanLink, profile

    loaded = load_manifest(build_2)
    files = [loaded.manifest.stages[1].xml, loaded.manifest.stages[1].bin]
    total = sum((build_2 / f).stat().st_size for f in files)
    drop_after = total // 3 + 1  # three cuts, the fourth connection completes it

    async def ship(address: str) -> tuple:
        async with open_channel(address, Security()) as channel:
            report = await ship_stage(channel, build_2, 1, address=address, resumes=5)
            reply = await load_stage(channel, build_2, 1, address=address)
        return report, reply

    with ExitStack() as stack:
        worker = serving(spawn_worker(tmp_path / "empty.log", stack, "--stages-dir", str(tmp_path / "stages")),
                         empty=True)
        link = WanLink(worker, profile(drop_after_bytes=drop_after)).start()
        stack.callback(link.stop)
        report, reply = asyncio.run(ship(link.address))
    assert 3 <= link.dropped <= 5, link.dropped
    assert report.held_bytes == 0 and report.sent_bytes == total, report
    assert sorted(report.completed) == sorted(files)
    assert (reply.stage, reply.layer_start, reply.layer_end) == (1, 19, 30)
    print(f"{link.dropped} cuts, {link.connections} connections, {report.sent_bytes / 1e6:.0f} MB in "
          f"{report.seconds:.1f} s")


def test_a_new_stage_is_built_from_the_stages_the_worker_holds(build_1, build_2, tmp_path):
    """An empty worker holding stage 1 of the 2-stage build is shipped the 1-stage build's only stage (a
    re-plan from two PCs to one): the tensors of layers 19-30 and the head are copied from the file it holds
    (ReuseStage, fleet_common/segments.py), only the rest is sent, and the stage loads (every file's sha256
    the manifest's)."""
    from fleet_common.segments import file_segments

    old, new = load_manifest(build_2), load_manifest(build_1)
    held = {s.sha256 for s in file_segments(build_2 / old.manifest.stages[1].xml, build_2 / old.manifest.stages[1].bin)}
    segments = file_segments(build_1 / new.manifest.stages[0].xml, build_1 / new.manifest.stages[0].bin)
    common = sum(s.size for s in segments if s.sha256 in held)
    total = sum((build_1 / f).stat().st_size for f in (new.manifest.stages[0].xml, new.manifest.stages[0].bin))
    assert common > 0.4 * total  # the layers both hold: the tensors are the same bytes at other offsets

    async def ship(address: str) -> tuple:
        async with open_channel(address, Security()) as channel:
            first = await ship_stage(channel, build_2, 1, address=address)
            await load_stage(channel, build_2, 1, address=address)
            report = await ship_stage(channel, build_1, 0, address=address)
            reply = await load_stage(channel, build_1, 0, address=address)
        return first, report, reply

    with ExitStack() as stack:
        worker = serving(spawn_worker(tmp_path / "empty.log", stack, "--stages-dir", str(tmp_path / "stages")),
                         empty=True)
        first, report, reply = asyncio.run(ship(worker))
    assert first.reused_bytes == 0
    # every byte once: copied or sent (segments under MIN_REUSE_BYTES between runs to send are sent with them)
    assert report.sent_bytes + report.reused_bytes == total and report.held_bytes == 0, report
    assert 0.97 * common <= report.reused_bytes <= common, (report.reused_bytes, common)
    assert (reply.stage, reply.layer_start, reply.layer_end) == (0, 0, 30) and not reply.already_loaded
    print(f"stage 0 of the 1-stage build: {report.sent_bytes / 1e6:.1f} MB sent, {report.reused_bytes / 1e6:.1f} MB "
          f"copied on the worker, of {total / 1e6:.1f} MB, in {report.seconds:.2f} s")
