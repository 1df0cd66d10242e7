"""An mDNS record is a hint anyone on the LAN can send (issue 45 item 5): the coordinator's registry checks
that it names a fleet worker before anything else. On a LAN of network namespaces (real mDNS over a bridge,
real gRPC), a PC ``stranger`` announces records: one pointing at its own gRPC server that is no fleet worker
(its Info answers with no worker id), one at a public address, one at a privileged port, one with a malformed
TXT record and one of another protocol; a real empty ``fleet-worker`` announces itself on PC ``w``. The
coordinator (``coordinator.registry.Registry``, browsing zeroconf in PC ``coord``) must add the worker, send
the stranger nothing but a bare Info (no owner: no lease; no challenge), add none of the others, and say
once per record why it ignored it."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from coordinator.pipeline import Channels
from coordinator.planned_fleet import browsing
from coordinator.registry import Registry
from fleet_common import PROTOCOL_VERSION, SERVICE_TYPE
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from tests.integration.test_store_hostile import synthetic_build

from .conftest import LanWorker, stop_all

pytestmark = pytest.mark.lan

STRANGER_PORT = 50777
LISTEN_S = 14.0  # the registry browses this long: resolves (3 s a try) and 3 probe rounds of 2 s, 1 s apart
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


def coordinator_pc(build: Path) -> tuple[dict[str, pb.InfoReply | None], set[str]]:
    """In PC ``coord``: a registry browsing zeroconf for ``LISTEN_S`` (as ``serve --model BUILD`` does) beside
    the planner's collection (``browsing``, as ``serve --model SOURCE`` does); (the workers the registry holds
    then: address -> their Info, the addresses the collection would ask Info)."""
    async def run() -> tuple[dict[str, pb.InfoReply | None], set[str]]:
        registry = Registry(load_manifest(build), Channels())
        async with browsing() as heard:
            await registry.start(discover=True)
            await asyncio.sleep(LISTEN_S)
        found = {a: w.info for a, w in registry.workers.items()}
        await registry.stop()
        return found, set(heard)

    return asyncio.run(run())


def test_the_coordinator_checks_an_mdns_record_names_a_fleet_worker_first(lan, tmp_path, caplog):  # noqa: ANN001
    for name in ("coord", "stranger", "w"):
        lan.add_pc(name)
    build, _, _ = synthetic_build(tmp_path / "build", [b"a" * 1000])
    worker = LanWorker(lan, "w", None, -1, tmp_path, "--stages-dir", str(tmp_path / "stages"), "--open-store")
    stranger, stop = Stranger(), threading.Event()
    try:
        address = worker.ready(120)
        announcing = lan.executor("stranger").submit(stranger_pc, lan.pcs["stranger"].address, stranger, stop)
        time.sleep(1.0)
        with caplog.at_level(logging.INFO):
            found, heard = lan.call_in("coord", coordinator_pc, build)
    finally:
        stop.set()
        stop_all([worker])
    announcing.result(30)
    ignored = [f"{r.name}: {r.getMessage()}" for r in caplog.records if "zeroconf: ignoring" in r.getMessage()]
    print("found:", {a: (i.worker_id, i.empty) if i else None for a, i in found.items()})
    print("the stranger was asked:", [(r.owner, r.challenge) for r in stranger.asked])
    print("\n".join(ignored))
    print("the planner's collection heard:", heard)
    assert address in found and found[address] is not None and found[address].empty, found
    assert set(found) == {address}, found  # none of the stranger's records
    assert stranger.asked, "the record naming the stranger's server was never probed"
    assert all(not r.owner and not r.challenge for r in stranger.asked), \
        [(r.owner, r.challenge) for r in stranger.asked]  # a bare Info only: no lease, no challenge
    for name, why in {"notaworker": "none answers Info as a fleet worker", "public": "8.8.8.8 is not a LAN address",
                      "privileged": "port 22", "malformed": "bad fleet TXT record",
                      "otherproto": "names protocol '999'"}.items():
        lines = [m for m in ignored if f"fleet-empty-{name}." in m and "coordinator.registry" in m]
        assert len(lines) == 1 and why in lines[0], (name, lines)
    # the planner's collection asks Info of the worker and of the stranger's well-formed record only (Info then
    # finds it is no worker: collect_capacities), never of a public address, a privileged port or a bad record
    assert heard == {address, f"{lan.pcs['stranger'].address}:{STRANGER_PORT}"}, heard
