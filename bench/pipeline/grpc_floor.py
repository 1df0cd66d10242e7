"""What gRPC's Python side costs per message on this machine, before any of fleet's code: the floor
under ``bench/pipeline/hop_overhead.py``'s overhead.

Three processes on loopback, each pinned to a core: a client, a relay and a sink. The relay does with
bare grpc.aio what a stage does with a step: it reads a ``ForwardRequest`` (a decode step's hidden
state, [1, 1, H] float32) from the client's ``Link`` stream and writes it on its own ``Link`` stream to
the sink, which answers each message with a ``LinkAck``; the relay reads that and writes it back up.
One message is in flight at a time, as with one user. Per round trip the relay reads 2 messages and
writes 2, the client writes 1 and reads 1. The bench prints the relay's and the client's CPU per round
trip (``psutil``, user + system), per message handled and the wall time per round trip, for
``--messages`` round trips after 200 of warm-up, and writes them with ``--json``.

    python bench/pipeline/grpc_floor.py [--messages 3000] [--hidden 576] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil

from bench import harness
from coordinator.fleet.local import free_port
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.wire import GRPC_OPTIONS


class Sink(pb_grpc.StageServicer):
    """The next stage: one ``LinkAck`` per message."""

    async def Link(self, requests, context):  # noqa: ANN001, ANN201
        async for request in requests:
            yield pb.LinkAck(step_id=request.step_id)


class Relay(pb_grpc.StageServicer):
    """A stage without a model: each message read goes down the link, each ack read goes back up."""

    def __init__(self, down: pb_grpc.StageStub) -> None:
        self.down = down

    async def Link(self, requests, context):  # noqa: ANN001, ANN201
        call = self.down.Link()
        acks: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            async for request in requests:
                await call.write(request)

        async def relay_acks() -> None:
            async for ack in call:
                acks.put_nowait(ack)

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(relay_acks())]
        try:
            while True:
                yield await acks.get()
        finally:
            for task in tasks:
                task.cancel()


async def serve(role: str, port: int, down: int) -> None:
    """Serve ``role`` (``sink``, or ``relay`` to the sink on port ``down``) on ``port`` until killed."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    if role == "sink":
        servicer = Sink()
    else:
        servicer = Relay(pb_grpc.StageStub(grpc.aio.insecure_channel(f"127.0.0.1:{down}", options=GRPC_OPTIONS)))
    pb_grpc.add_StageServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def client(port: int, relay: psutil.Process, messages: int, hidden: int) -> dict:
    """``messages`` round trips through the relay on ``port`` (after 200 of warm-up): CPU and wall per trip."""
    step = pb.ForwardRequest(session_id="s", input=pb.Tensor(data=bytes(4 * hidden), shape=[1, 1, hidden],
                                                               dtype="float32"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        call = pb_grpc.StageStub(channel).Link()
        for n in (200, messages):  # warm-up, then measured
            relay0, me0, t0 = relay.cpu_times(), time.process_time(), time.perf_counter()
            for i in range(n):
                step.step_id = i
                await call.write(step)
                await call.read()
            wall, me1, relay1 = time.perf_counter() - t0, time.process_time(), relay.cpu_times()
        call.cancel()
    relay_us = ((relay1.user + relay1.system) - (relay0.user + relay0.system)) / messages * 1e6
    return {"round_trips": messages, "hidden": hidden, "message_bytes": step.ByteSize(),
            "relay_cpu_us_per_round_trip": relay_us, "relay_cpu_us_per_message": relay_us / 4,
            "client_cpu_us_per_round_trip": (me1 - me0) / messages * 1e6,
            "client_cpu_us_per_message": (me1 - me0) / messages * 1e6 / 2, "wall_us_per_round_trip": wall / messages * 1e6}


def main(argv: list[str] | None = None) -> int:
    """Start the sink and the relay, run the client; prints the table, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size of the step carried (the demo's: 576)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", nargs=3, metavar=("ROLE", "PORT", "DOWN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        role, port, down = args.serve
        asyncio.run(serve(role, int(port), int(down)))
        return 0
    sink_port, relay_port = free_port(), free_port()
    procs = []
    try:
        for core, (role, port, down) in enumerate((("sink", sink_port, 0), ("relay", relay_port, sink_port))):
            proc = subprocess.Popen(harness.pinned(core + 1, [sys.executable, "-m", "bench.pipeline.grpc_floor",
                                                              "--serve", role, str(port), str(down)]),
                                    stdout=subprocess.PIPE, text=True, cwd=harness.ROOT, env=harness.repo_env())
            procs.append(proc)
            if proc.stdout.readline().strip() != "serving":
                raise RuntimeError(f"the {role} did not start")
        os.sched_setaffinity(0, {0})
        result = asyncio.run(client(relay_port, psutil.Process(procs[1].pid), args.messages, args.hidden))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    print(f"grpc.aio Link stream, {result['message_bytes']}-byte steps, {args.messages} round trips, one in flight")
    print(harness.table(["process", "CPU us / round trip", "messages", "CPU us / message"],
                        [["relay", f"{result['relay_cpu_us_per_round_trip']:.0f}", 4,
                          f"{result['relay_cpu_us_per_message']:.0f}"],
                         ["client", f"{result['client_cpu_us_per_round_trip']:.0f}", 2,
                          f"{result['client_cpu_us_per_message']:.0f}"]], pad=True))
    print(f"wall per round trip: {result['wall_us_per_round_trip']:.0f} us")
    harness.write_json(args.json, "grpc_floor", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
