"""Workers the coordinator must not plan over, on real gRPC on loopback (worker/stage_slot.py's ``StageSlot``
answering Info as an empty worker does, with the capacity given): an implausible speed or memory (one odd answer
must not stop re-planning for good: issue 30, the empty fleet's hardening), a worker too small to take a layer
left out of a re-plan, two PCs with one worker id (a cloned disk)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from coordinator.fleet.planned import answering, planning_speeds
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.discovery import Capacity
from fleet_common.security import Security, open_server
from fleet_common.wire import add_servicer
from worker.stage_slot import StageSlot

GIB = 1 << 30


@contextlib.asynccontextmanager
async def slots(*workers: tuple[str, Capacity]):
    """The addresses of real gRPC servers on loopback, one ``StageSlot`` (an empty worker) per (id, capacity)."""
    servers, addresses = [], []
    for worker_id, capacity in workers:
        server, port = open_server("127.0.0.1:0", Security())
        add_servicer(pb_grpc.add_StageServicer_to_server, StageSlot(worker_id, capacity), server)
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    try:
        yield addresses
    finally:
        await asyncio.gather(*(s.stop(None) for s in servers))


def test_implausible_capacities_are_not_counted_and_are_named():
    async def run():
        async with slots(("good", Capacity(8 * GIB, "CPU", 30.0)), ("fast", Capacity(8 * GIB, "CPU", 1.7e308)),
                         ("tiny", Capacity(8 * GIB, "CPU", 1e-300)), ("huge", Capacity(1 << 62, "CPU", 30.0))) as addrs:
            return addrs, await answering(addrs, Security(), addrs, None)

    addresses, (found, why) = asyncio.run(run())
    assert list(found) == ["good"] and found["good"][0] == addresses[0]
    assert len(why) == 3, why
    for address, worker, what in zip(addresses[1:], ("fast", "tiny", "huge"), ("1.7e+308", "1e-300", "bytes of memory"),
                                     strict=True):
        line = next(w for w in why if w.startswith(f"{address} (worker {worker})"))
        assert what in line and "not counted" in line, line


def test_every_worker_gets_a_planning_speed_whatever_its_figure():
    speeds = planning_speeds({"a": 30.0, "b": 31.0, "c": 1.7e308})  # 1.7e308 * 1.2 overflows to inf
    assert speeds == {"a": 30.5, "b": 30.5, "c": 1.7e308}


def test_a_worker_too_small_for_one_layer_is_left_out_of_a_replan_and_named():
    from compiler.planner import ModelDims, ModelSource
    from coordinator.fleet.planned import plan_without_small
    from tests.unit.test_planner import CONFIG

    source = ModelSource(ModelDims.from_config(CONFIG, "m"), "fp16", "f16")

    async def run():
        async with slots(("big", Capacity(8 * GIB, "CPU", 30.0)), ("small", Capacity(64 << 20, "CPU", 30.0))) as addrs:
            return addrs, (await answering(addrs, Security(), addrs, None))[0]

    (big, small), found = asyncio.run(run())
    plan, kept, left_out = plan_without_small(source, found, "workers left")
    assert [s.node.name for s in plan.stages] == ["big"] and list(kept) == ["big"]
    assert len(left_out) == 1 and left_out[0].startswith(f"small at {small} (64 MiB available"), left_out
    assert "cannot hold even one layer" in left_out[0]
    with pytest.raises(ValueError, match="cannot hold even one layer"):  # the last worker is never left out
        plan_without_small(source, {"small": found["small"]})


def test_two_pcs_with_one_worker_id_are_a_clear_error_naming_both():
    from coordinator.fleet.planned import DuplicateWorkerId

    async def run():
        async with slots(("0123456789ab", Capacity(8 * GIB, "CPU", 30.0)),
                         ("0123456789ab", Capacity(4 * GIB, "CPU", 40.0))) as addrs:
            with pytest.raises(DuplicateWorkerId) as twice:  # was: silently counted as one
                await answering(addrs, Security(), addrs, None)
            return addrs, str(twice.value)

    (first, second), message = asyncio.run(run())
    assert "0123456789ab" in message and first in message and second in message, message
    assert "delete <stages-dir>/worker-id on one of them" in message


def test_strings_a_worker_sends_are_printed_with_control_characters_escaped():
    async def run():
        async with slots(("\x1b[2Jid\nX", Capacity(0, "CPU\x1b[31m\r", 30.0))) as addrs:
            return await answering(addrs, Security(), addrs, None)

    found, (why,) = asyncio.run(run())
    assert not found and "\x1b" not in why and "\n" not in why and "\\x1b[2Jid\\nX" in why, why
    assert Capacity(1 << 30, "CPU\x1b[31m", 30.0).line().startswith("1,024 MiB available, CPU\\x1b[31m, 30.00 ms")


def test_with_a_secret_only_workers_proving_it_are_counted_or_shipped_to(tmp_path):
    """A coordinator with --secret plans, ships and serves only through workers that hold the key: an empty
    worker without it (anyone on the LAN, heard by mDNS) answers Info, but its answer carries no proof of the key
    (fleet_common/security.py ``worker_proof`` over the coordinator's challenge), so it is named and not counted,
    ``ship_plan`` ships it nothing, and the health check refuses it; a worker with the key proves it."""
    from coordinator.fleet.planned import ship_plan
    from fleet_common.shipping import ShippingError
    from tests.unit.test_stage_cache import make_build

    (tmp_path / "key").write_text("the fleet's key\n")
    ours = Security.load(tmp_path / "key")
    build, _, _ = make_build(tmp_path)

    async def run():
        servers, addresses = [], []
        for worker_id, security in (("keyed", ours), ("rogue", Security())):
            server, port = open_server("127.0.0.1:0", security)
            add_servicer(pb_grpc.add_StageServicer_to_server,
                         StageSlot(worker_id, Capacity(8 * GIB, "CPU", 30.0), security), server)
            await server.start()
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        try:
            counted = await answering(addresses, ours, addresses, None)
            with pytest.raises(ShippingError) as shipped:
                await ship_plan(build, [addresses[1]], ours)
            return addresses, counted, shipped.value
        finally:
            await asyncio.gather(*(s.stop(None) for s in servers))

    addresses, (found, why), refused = asyncio.run(run())
    assert list(found) == ["keyed"], (found, why)
    assert len(why) == 1 and why[0].startswith(f"{addresses[1]} (worker rogue)") and "--secret" in why[0], why
    assert "does not hold this fleet's --secret" in str(refused) and addresses[1] in str(refused), refused
    assert ours.proven("c", "w", ours.prove("c", "w")) and not ours.proven("c", "w", Security().prove("c", "w"))
    assert not ours.proven("c", "other", ours.prove("c", "w"))  # bound to the worker's id
