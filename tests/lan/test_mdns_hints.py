"""An mDNS record is a hint anyone on the LAN can send (issue 45 item 5): the coordinator's registry checks
that it names a fleet worker before anything else. On a LAN of network namespaces (real mDNS over a bridge,
real gRPC), a PC ``stranger`` announces records: one pointing at its own gRPC server that is no fleet worker
(its Info answers with no worker id), one at a public address, one at a privileged port, one with a malformed
TXT record and one of another protocol; a real empty ``fleet-worker`` announces itself on PC ``w``. The
coordinator (``coordinator.fleet.registry.Registry``, browsing zeroconf in PC ``coord``) must add the worker, send
the stranger nothing but a bare Info (no owner: no lease; no challenge), add none of the others, and say
once per record why it ignored it."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from coordinator.engine.pipeline import Channels
from coordinator.fleet.planned import browsing
from coordinator.fleet.registry import Registry
from fleet_common import PROTOCOL_VERSION, SERVICE_TYPE
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from tests.integration.test_store_hostile import synthetic_build

from .conftest import LanWorker, stop_all

pytestmark = pytest.mark.lan

STRANGER_PORT = 50777
LISTEN_S = 14.0  # a browse: resolves (3 s a try) and 3 probe rounds of 2 s, 1 s apart
EMPTY_TXT = {"state": "empty", "proto": str(PROTOCOL_VERSION), "id": "x", "mem": str(8 << 30), "device": "CPU",
             "msgb": "5.0"}


class Stranger(pb_grpc.StageServicer):
    """A gRPC server on the LAN that is no fleet worker: its Info answers nothing a worker does; it keeps
    each InfoRequest it gets."""

    def __init__(self) -> None:
        self.asked: list[pb.InfoRequest] = []

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:  # noqa: N802
        self.asked.append(request)
        return pb.InfoReply()


def stranger_pc(address: str, stranger: Stranger, stop: threading.Event) -> None:
    """In PC ``stranger``: its gRPC server, and the five records announced, until ``stop``."""
    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_StageServicer_to_server(stranger, server)
        server.add_insecure_port(f"0.0.0.0:{STRANGER_PORT}")
        await server.start()
        zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        records = {"fleet-empty-notaworker": (address, STRANGER_PORT, EMPTY_TXT),
                   "fleet-empty-public": ("8.8.8.8", 50051, EMPTY_TXT),
                   "fleet-empty-privileged": (address, 22, EMPTY_TXT),
                   "fleet-empty-malformed": (address, STRANGER_PORT + 1, {**EMPTY_TXT, "mem": "lots"}),
                   "fleet-empty-otherproto": (address, STRANGER_PORT + 2, {**EMPTY_TXT, "proto": "999"})}
        infos = [AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", addresses=[socket.inet_aton(host)],
                                  port=port, properties=txt, server=f"{name}.local.")
                 for name, (host, port, txt) in records.items()]
        for info in infos:
            await zc.async_register_service(info)
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for info in infos:
            await zc.async_unregister_service(info)
        await zc.async_close()
        await server.stop(0)

    asyncio.run(run())


def coordinator_pc(build: str, worker: str) -> None:
    """Run as a process in PC ``coord`` (``python -c``; its log on stderr): a registry browsing zeroconf (as
    ``serve --model BUILD`` does) until it holds ``worker`` and has ignored 5 records, at most ``LISTEN_S`` x 3;
    then the planner's collection (``browsing``, as ``serve --model SOURCE`` does) for ``LISTEN_S`` (one after
    the other: two zeroconf instances of one PC share the unicast answers). Prints one JSON line: the workers
    the registry held (address -> [worker id, empty] or None), the addresses the collection would ask Info."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    async def run() -> dict:
        registry = Registry(load_manifest(Path(build)), Channels())
        await registry.start(discover=True)
        deadline = time.monotonic() + 3 * LISTEN_S
        while time.monotonic() < deadline and not (worker in registry.workers and len(getattr(registry, "_ignored", ())) >= 5):
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # a stranger's record probed late would be held by now
        found = {a: [w.info.worker_id, w.info.empty] if w.info else None for a, w in registry.workers.items()}
        await registry.stop()
        async with browsing() as heard:
            await asyncio.sleep(LISTEN_S)
        return {"found": found, "heard": sorted(heard)}

    print(json.dumps(asyncio.run(run())), flush=True)


def test_the_coordinator_checks_an_mdns_record_names_a_fleet_worker_first(lan, tmp_path):  # noqa: ANN001
    for name in ("coord", "stranger", "w"):
        lan.add_pc(name)
    build, _, _ = synthetic_build(tmp_path / "build", [b"a" * 1000])
    worker = LanWorker(lan, "w", None, -1, tmp_path, "--stages-dir", str(tmp_path / "stages"), "--open-store")
    stranger, stop = Stranger(), threading.Event()
    try:
        address = worker.ready(120)
        announcing = lan.executor("stranger").submit(stranger_pc, lan.pcs["stranger"].address, stranger, stop)
        time.sleep(1.0)
        script = f"from tests.lan.test_mdns_hints import coordinator_pc; coordinator_pc({str(build)!r}, {address!r})"
        coord = subprocess.run(lan.pcs["coord"].cmd(sys.executable, "-c", script), capture_output=True, text=True,
                               timeout=6 * LISTEN_S, cwd=Path(__file__).parents[2])
    finally:
        stop.set()
        stop_all([worker])
    announcing.result(30)
    assert coord.returncode == 0, coord.stderr[-3000:]
    result = json.loads(coord.stdout.strip().splitlines()[-1])
    found, heard = result["found"], set(result["heard"])
    ignored = [line for line in coord.stderr.splitlines() if "zeroconf: ignoring" in line]
    print("found:", found)
    print("the stranger was asked:", [(r.owner, r.challenge) for r in stranger.asked])
    print("\n".join(ignored))
    print("the planner's collection heard:", heard)
    assert address in found and found[address] is not None and found[address][1], found
    assert set(found) == {address}, found  # none of the stranger's records
    assert stranger.asked, "the record naming the stranger's server was never probed"
    assert all(not r.owner and not r.challenge for r in stranger.asked), \
        [(r.owner, r.challenge) for r in stranger.asked]  # a bare Info only: no lease, no challenge
    for name, why in {"notaworker": "none answers Info as a fleet worker", "public": "8.8.8.8 is not a LAN address",
                      "privileged": "port 22", "malformed": "bad fleet TXT record",
                      "otherproto": "names protocol '999'"}.items():
        lines = [m for m in ignored if f"fleet-empty-{name}." in m and m.startswith("coordinator.fleet.registry")]
        assert len(lines) == 1 and why in lines[0], (name, lines)
    # the planner's collection asks Info of the worker and of the stranger's well-formed record only (Info then
    # finds it is no worker: collect_capacities), never of a public address, a privileged port or a bad record
    assert heard == {address, f"{lan.pcs['stranger'].address}:{STRANGER_PORT}"}, heard
