"""A hostile client of an empty worker's stage store (issue 45 item 3), over real gRPC against a real
``fleet-worker`` process (no --shard/--model): each attack a LAN probe found, then an honest shipper
(fleet_common.shipping, as the coordinator ships) that must still get its stage through. The builds are small
synthetic ones whose ``.xml`` lists Const data ranges (so that a new stage is built from the stages the worker
holds: ReuseStage); nothing is loaded. Also: an empty worker bound beyond loopback without --secret refuses to
start (--open-store opens it on purpose), and a host answering a new worker id at each Info does not keep a
coordinator's mDNS collection from settling.

Workers run with --no-announce on loopback: other tests on this machine must not find them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from bench import harness
from coordinator.fleet.planned import collect_capacities
from fleet_common import PROTOCOL_VERSION
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import Architecture, Manifest, StageEntry, build_identity
from fleet_common.security import Security, open_channel, open_server
from fleet_common.shipping import ShippingError, ship_stage
from fleet_common.wire import add_servicer
from tests.integration.test_shipping import rpc_error, serving, spawn_worker

pytestmark = pytest.mark.integration

CHUNK = 200_000  # bytes of one Const of the synthetic IRs


def synthetic_build(root: Path, consts: list[bytes]) -> tuple[Path, bytes, str]:
    """A 2-stage build whose stage 1 is an IR of ``consts`` (its ``.xml`` names each one's bytes in the ``.bin``);
    returns (folder, manifest bytes, manifest sha256)."""
    (root / "stage_1").mkdir(parents=True)
    layers, offset = [], 0
    for i, data in enumerate(consts):
        layers.append(f'<layer id="{i}" name="c{i}" type="Const"><data offset="{offset}" size="{len(data)}"/></layer>')
        offset += len(data)
    xml = f'<?xml version="1.0"?><net name="t" version="11"><layers>{"".join(layers)}</layers></net>'.encode()
    (root / "stage_1" / "openvino_model.xml").write_bytes(xml)
    (root / "stage_1" / "openvino_model.bin").write_bytes(b"".join(consts))
    files = {f"stage_1/{n}": hashlib.sha256((root / "stage_1" / n).read_bytes()).hexdigest()
             for n in ("openvino_model.xml", "openvino_model.bin")}
    files["stage_0/openvino_model.xml"] = files["stage_0/openvino_model.bin"] = "0" * 64
    return _manifest(root, files, "stage_1/openvino_model.xml")


def _manifest(root: Path, files: dict[str, str], xml: str) -> tuple[Path, bytes, str]:
    arch = Architecture("llama", 4, 64, 4, 2, 16, 100, 512)
    stages = (StageEntry(0, 0, 2, "stage_0/openvino_model.xml", "stage_0/openvino_model.bin"),
              StageEntry(1, 2, 4, xml, "stage_1/openvino_model.bin"))
    data = Manifest("tiny", arch, stages, "2026.4.1", PROTOCOL_VERSION, "fp16", "f16", (2,), files).to_json().encode()
    (root / "manifest.json").write_bytes(data)
    return root, data, build_identity(data)


def empty_worker(tmp_path: Path, stack: ExitStack, name: str = "w", *args: str) -> tuple[harness.Proc, str]:
    """A real empty ``fleet-worker`` on loopback with its stage cache in ``tmp_path/<name>``; (proc, address)."""
    proc = spawn_worker(tmp_path / f"{name}.log", stack, "--stages-dir", str(tmp_path / name), *args)
    return proc, serving(proc, empty=True)


async def ship(address: str, build: Path):  # noqa: ANN201 - a ShipReport
    """Stage 1 of ``build`` shipped to ``address`` as the coordinator ships it (resumed and retried as it is)."""
    async with open_channel(address, Security()) as channel:
        return await ship_stage(channel, build, 1, address=address)


def chunk(sha: str, path: str, offset: int, data: bytes, size: int) -> pb.StageChunk:
    return pb.StageChunk(model_id="tiny", manifest_sha256=sha, path=path, offset=offset, data=data, size=size)


def test_a_file_name_over_255_bytes_is_refused_and_poisons_nothing(tmp_path):
    """Today a stored manifest naming a 300-byte file made every later ReuseStage fail (ENAMETOOLONG listing
    the cache), also after a restart."""
    shared = [os.urandom(CHUNK) for _ in range(4)]
    first = synthetic_build(tmp_path / "a", shared)
    second = synthetic_build(tmp_path / "b", shared[:3] + [os.urandom(CHUNK)])  # 3 of its 4 Consts held already
    long_name = "stage_1/" + "x" * 300 + ".xml"
    files = json.loads(first[1])["files"] | {long_name: "1" * 64}
    (tmp_path / "rogue").mkdir()
    _, rogue_manifest, rogue_sha = _manifest(tmp_path / "rogue", files, long_name)
    with ExitStack() as stack:
        proc, address = empty_worker(tmp_path, stack)
        asyncio.run(ship(address, first[0]))

        async def rogue() -> grpc.aio.AioRpcError:
            async with open_channel(address, Security()) as channel:
                return await rpc_error(pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
                    model_id="tiny", manifest_sha256=rogue_sha, manifest=rogue_manifest, stage=1), timeout=30))

        refused = asyncio.run(rogue())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "too long" in refused.details(), refused
        assert not (tmp_path / "w" / rogue_sha).exists()
        report = asyncio.run(ship(address, second[0]))
        print(f"after the rogue manifest: {report.reused_bytes:,} bytes reused, {report.sent_bytes:,} sent")
        assert report.reused_bytes == 3 * CHUNK and len(report.completed) == 2, report
        proc.stop()
        _, address = empty_worker(tmp_path, stack, "w")
        report = asyncio.run(ship(address, second[0]))
        assert report.sent_bytes == 0 and report.held_bytes > 0, report


def test_a_piece_lying_about_its_size_blocks_nothing(tmp_path):
    """Today one piece giving a wrong size bound the file to it until a restart: the honest shipper was refused
    (INVALID_ARGUMENT); and the piece's wrong bytes failed the first shipping with DATA_LOSS."""
    build, manifest, sha = synthetic_build(tmp_path / "a", [os.urandom(CHUNK) for _ in range(3)])
    rel = "stage_1/openvino_model.bin"
    size = (build / rel).stat().st_size
    with ExitStack() as stack:
        _, address = empty_worker(tmp_path, stack)

        async def lie() -> None:
            async with open_channel(address, Security()) as channel:
                store = pb_grpc.StageStoreStub(channel)
                await store.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=manifest,
                                                              stage=1), timeout=30)
                await store.PutStage(iter([chunk(sha, rel, 0, b"junk" * 1000, size + 5000)]), timeout=30)

        asyncio.run(lie())
        report = asyncio.run(ship(address, build))
    assert sorted(report.completed) == ["stage_1/openvino_model.bin", "stage_1/openvino_model.xml"], report
    assert (tmp_path / "w" / sha / rel).read_bytes() == (build / rel).read_bytes()


def test_silent_put_stage_calls_cannot_hold_the_slots(tmp_path):
    """Today four silent PutStage calls (here one half-open on the .bin, three that sent nothing) held every slot
    for 60 s, renewably, and the shipper gave up after 15 s of retries."""
    build, manifest, sha = synthetic_build(tmp_path / "a", [os.urandom(CHUNK) for _ in range(3)])
    rel = "stage_1/openvino_model.bin"
    size = (build / rel).stat().st_size
    with ExitStack() as stack:
        _, address = empty_worker(tmp_path, stack)

        async def run() -> tuple:
            async with open_channel(address, Security()) as channel:
                store = pb_grpc.StageStoreStub(channel)
                await store.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=manifest,
                                                              stage=1), timeout=30)

                async def silent(first: list[pb.StageChunk]):  # noqa: ANN202
                    for piece in first:
                        yield piece
                    await asyncio.sleep(3600)

                calls = [store.PutStage(silent([chunk(sha, rel, 0, (build / rel).read_bytes()[:1000], size)]))]
                while (await store.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, stage=1),
                                               timeout=30)).files[1].bytes < 1000:
                    await asyncio.sleep(0.05)
                calls += [store.PutStage(silent([])) for _ in range(3)]
                await asyncio.sleep(0.5)
                t0 = time.monotonic()
                try:
                    report = await ship_stage(channel, build, 1, address=address)
                finally:
                    for call in calls:
                        call.cancel()
                return report, time.monotonic() - t0

        report, seconds = asyncio.run(run())
    print(f"shipped past 4 silent PutStage calls in {seconds:.1f} s")
    assert len(report.completed) == 2 and report.held_bytes == 1000, report


def test_the_stage_cache_stays_under_stages_max_gb(tmp_path):
    """Today there was no quota: every build shipped stayed. Here the cache holds one build of the two shipped, the
    least recently used deleted; a file larger than the quota is refused by name before a byte is written."""
    first = synthetic_build(tmp_path / "a", [os.urandom(CHUNK) for _ in range(5)])
    second = synthetic_build(tmp_path / "b", [os.urandom(CHUNK) for _ in range(5)])
    quota = 1_500_000  # bytes: one build (1.0 MB) fits, two do not
    with ExitStack() as stack:
        _, address = empty_worker(tmp_path, stack, "w", "--stages-max-gb", f"{quota / 2**30:.12f}")
        asyncio.run(ship(address, first[0]))
        asyncio.run(ship(address, second[0]))
        held = sorted(p.name for p in (tmp_path / "w").iterdir() if len(p.name) == 64)
        assert held == [second[2]], held
        total = sum(f.stat().st_size for f in (tmp_path / "w").rglob("*") if f.is_file() and len(f.parts) > 0
                    and any(len(p) == 64 for p in f.parts))
        print(f"stage cache: {total:,} bytes held under a quota of {quota:,}")
        assert total <= quota

        async def too_big() -> grpc.aio.AioRpcError:
            async with open_channel(address, Security()) as channel:
                return await rpc_error(pb_grpc.StageStoreStub(channel).PutStage(iter([chunk(
                    first[2], "stage_1/openvino_model.bin", 0, b"x" * 1000, 10 * quota)]), timeout=30))

        asyncio.run(ship(address, first[0]))  # back in: the second one goes
        refused = asyncio.run(too_big())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--stages-max-gb" in refused.details()


def test_partial_files_and_junk_folders_are_cleaned(tmp_path):
    """Today a partial file no transfer finishes and a build folder without a manifest stayed for ever."""
    build, manifest, sha = synthetic_build(tmp_path / "a", [os.urandom(CHUNK) for _ in range(3)])
    rel = "stage_1/openvino_model.bin"
    junk = tmp_path / "w" / ("ab" * 32)
    with ExitStack() as stack:
        proc, address = empty_worker(tmp_path, stack)

        async def leave_partial() -> None:
            async with open_channel(address, Security()) as channel:
                store = pb_grpc.StageStoreStub(channel)
                await store.StageStatus(pb.StageStatusRequest(model_id="tiny", manifest_sha256=sha, manifest=manifest,
                                                              stage=1), timeout=30)
                await store.PutStage(iter([chunk(sha, rel, 0, (build / rel).read_bytes()[:1000], 600_000)]),
                                     timeout=30)

        asyncio.run(leave_partial())
        proc.stop()
        part = tmp_path / "w" / sha / (rel + ".part")
        assert part.is_file()
        (junk / "stage_1").mkdir(parents=True)
        (junk / "stage_1" / "openvino_model.bin.part").write_bytes(b"x" * 5000)
        old = time.time() - 2 * 86400
        for path in (part, junk, junk / "stage_1" / "openvino_model.bin.part"):
            os.utime(path, (old, old))
        proc, address = empty_worker(tmp_path, stack)
        assert not part.exists() and not junk.exists(), proc.text()[-2000:]
        assert (tmp_path / "w" / sha / "manifest.json").is_file()  # the build itself stays
        report = asyncio.run(ship(address, build))
        assert report.held_bytes == 0 and len(report.completed) == 2, report


class FlappingWorker(pb_grpc.StageServicer):
    """A host answering Info as an empty worker with a new worker id each time."""

    def __init__(self) -> None:
        self.calls = 0

    async def Info(self, request, context):  # noqa: ANN001, ANN201
        self.calls += 1
        return pb.InfoReply(worker_id=f"{self.calls:012x}", protocol_version=PROTOCOL_VERSION, empty=True,
                            device="CPU", memory_available_bytes=8 << 30, ms_per_gb=50.0)


def test_a_host_answering_a_new_worker_id_at_each_info_does_not_stop_the_collection(tmp_path):
    """Today the collection by mDNS (no --expect-workers) waited for no new worker id for 5 s, which such a host
    never gave: start-up never settled. Here it settles on the real empty worker."""
    with ExitStack() as stack:
        _, address = empty_worker(tmp_path, stack)

        async def run() -> tuple:
            server, port = open_server("127.0.0.1:0", Security())
            add_servicer(pb_grpc.add_StageServicer_to_server, FlappingWorker(), server)
            await server.start()
            try:
                t0 = time.monotonic()
                found = await collect_capacities([], Security(), 0, 30.0, {address, f"127.0.0.1:{port}"}, settle_s=2.0)
                return found, time.monotonic() - t0
            finally:
                await server.stop(None)

        found, seconds = asyncio.run(run())
    print(f"collection settled in {seconds:.1f} s")
    assert [a for a, _ in found.values()] == [address], found


def test_an_empty_worker_beyond_loopback_needs_a_key_or_open_store(tmp_path):
    """Today ``fleet-worker --host 0.0.0.0`` (empty, no --secret) served a stage store anyone could write to. Now it
    refuses to start, naming --secret and --open-store; with --open-store it starts and warns; with --secret a
    caller without the key writes nothing."""
    worker = [*harness.tool("fleet-worker"), "--port", "0", "--no-announce", "--threads", "1", "--host", "0.0.0.0"]
    with ExitStack() as stack:
        refused = harness.spawn([*worker, "--stages-dir", str(tmp_path / "s0")], tmp_path / "w0.log", stack)
        assert refused.popen.wait(timeout=60) == 2, refused.text()
        text = refused.text()
        assert "--secret FILE" in text and "--open-store" in text and "token_urlsafe" in text, text
        opened = harness.spawn([*worker, "--stages-dir", str(tmp_path / "s1"), "--open-store"], tmp_path / "w1.log",
                               stack)
        opened.wait_for(r"worker ready: empty", 120)
        assert "--open-store: any host that reaches port" in opened.text()
        (tmp_path / "key").write_text("store test key 5e1a")
        keyed = harness.spawn([*worker, "--stages-dir", str(tmp_path / "s2"), "--secret", str(tmp_path / "key")],
                              tmp_path / "w2.log", stack)
        port = keyed.wait_for(r"worker ready: empty .* serving on [\d.]+:(\d+)", 120).group(1)
        build, _, _ = synthetic_build(tmp_path / "a", [os.urandom(1000)])
        with pytest.raises(ShippingError) as stranger:
            asyncio.run(ship(f"127.0.0.1:{port}", build))
        assert stranger.value.code == grpc.StatusCode.UNAUTHENTICATED, stranger.value

        async def with_key():  # noqa: ANN202
            security = Security.load(tmp_path / "key")
            async with open_channel(f"127.0.0.1:{port}", security) as channel:
                return await ship_stage(channel, build, 1)

        assert len(asyncio.run(with_key()).completed) == 2
    assert not any((tmp_path / "s2").glob("*/stage_1/*.bin.part"))


def test_a_coordinator_holding_the_key_ships_and_serves_over_empty_workers_beyond_loopback(tmp_path, demo_hf):
    """The new default as the README's empty fleet runs it: two empty workers on 0.0.0.0 with the fleet's key, a
    coordinator holding it collects them, plans, builds the demo's GGUF, ships each its stage and answers; a
    caller without the key is refused by both workers before it writes anything."""
    from tests.conftest import chat, start_coordinator, wait_ready

    gguf = harness.demo_gguf(demo_hf)
    key = tmp_path / "fleet.key"
    key.write_text("fleet store test key 93b0")
    with ExitStack() as stack:
        ports = [spawn_worker(tmp_path / f"w{i}.log", stack, "--host", "0.0.0.0", "--secret", str(key), "--cache-dir",
                              str(tmp_path / f"c{i}"), "--stages-dir", str(tmp_path / f"s{i}")).wait_for(
                                  r"worker ready: empty .* serving on [\d.]+:(\d+)", 120).group(1) for i in range(2)]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        stranger = synthetic_build(tmp_path / "a", [os.urandom(1000)])[0]
        for address in addresses:
            with pytest.raises(ShippingError) as refused:
                asyncio.run(ship(address, stranger))
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED, refused.value
        (tmp_path / "coord").mkdir()
        t0 = time.monotonic()
        proc, url = start_coordinator(gguf, tmp_path / "coord", "--no-discover", "--secret", str(key),
                                      *(arg for a in addresses for arg in ("--peer", a)),
                                      "--build-cache-dir", str(tmp_path / "builds"))
        stack.callback(proc.stop)
        wait_ready(url, 240, proc)
        print(f"empty workers with the key: built, shipped and serving {time.monotonic() - t0:.1f} s after the "
              "coordinator started")
        answer = chat(url, "Name three colours of the rainbow.", max_tokens=12)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text
        assert "stage 0: sent" in proc.text() and "stage 1: sent" in proc.text(), proc.text()[-3000:]
