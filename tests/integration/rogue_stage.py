"""A rogue last stage for tests: a real gRPC server in front of a real worker that passes every ``fleet.v1.Stage``
call through, bytes untouched, except what ``--mode`` spoils (issue 45 #5):

* ``nan``: the step results' log-probabilities are NaN;
* ``int64``: the step results' token ids travel as int64;
* ``oob``: the best token id is past the vocabulary (1,000,000);
* ``bigerror``: every step fails, its ``LinkAck`` carrying 100 KB of text naming addresses and a path.

``python -m tests.integration.rogue_stage --upstream HOST:PORT --mode-file PATH`` prints ``serving on HOST:PORT``;
the mode is read from PATH at each call ("" or no file: spoil nothing)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import numpy as np

from fleet_common import fleet_pb2 as pb
from fleet_common.wire import from_tensor, to_tensor

SERVICE = "fleet.v1.Stage"
UNARY = ("OpenSession", "CloseSession", "Forward", "Compact", "Merge", "Copy", "Info")
BIG_ERROR = ("stage cache /home/alice/.cache/fleet/stages/abc at 10.1.2.3:50051 and 192.168.7.9:50052 failed; "
             * 1000)  # ~100 KB


def spoil(result: pb.StepResult, mode: str) -> pb.StepResult:
    """``result`` with its candidates spoiled as ``mode`` says (a handshake, without candidates, untouched)."""
    if not result.session_id or not result.top_ids.data:
        return result
    ids = np.array(from_tensor(result.top_ids))
    logprobs = np.array(from_tensor(result.top_logprobs))
    if mode == "nan":
        logprobs[:] = np.nan
    elif mode == "int64":
        ids = ids.astype(np.int64)
    elif mode == "oob":
        ids[:, 0] = 1_000_000
    result.top_ids.CopyFrom(to_tensor(ids))
    result.top_logprobs.CopyFrom(to_tensor(logprobs))
    return result


def handlers(upstream: grpc.aio.Channel, mode_file: Path) -> grpc.GenericRpcHandler:
    """Pass-through handlers of every Stage method (raw bytes), spoiling what the mode in ``mode_file`` says."""
    def mode() -> str:
        return mode_file.read_text().strip() if mode_file.is_file() else ""

    def unary(name: str):  # noqa: ANN202
        call = upstream.unary_unary(f"/{SERVICE}/{name}")

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await call(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
        return grpc.unary_unary_rpc_method_handler(handle)

    subscribe = upstream.unary_stream(f"/{SERVICE}/Subscribe")

    async def on_subscribe(request: bytes, context: grpc.aio.ServicerContext):  # noqa: ANN202
        async for reply in subscribe(request):
            yield spoil(pb.StepResult.FromString(reply), mode()).SerializeToString()

    link = upstream.stream_stream(f"/{SERVICE}/Link")

    async def on_link(requests, context: grpc.aio.ServicerContext):  # noqa: ANN001, ANN202
        """Steps pass to the real worker's link, its acks back; under "bigerror" each step fails instead, its
        ``LinkAck`` (a message: no metadata limit) saying so at length."""
        up = link()
        out: asyncio.Queue = asyncio.Queue()

        async def pump_in() -> None:
            async for raw in requests:
                if mode() == "bigerror":
                    step = pb.ForwardRequest.FromString(raw)
                    out.put_nowait(pb.LinkAck(session_id=step.session_id, step_id=step.step_id,
                                              code=grpc.StatusCode.INTERNAL.value[0],
                                              details=BIG_ERROR).SerializeToString())
                else:
                    await up.write(raw)
            await up.done_writing()

        async def pump_up() -> None:
            async for reply in up:
                out.put_nowait(reply)
            out.put_nowait(None)

        pumps = [asyncio.ensure_future(pump_in()), asyncio.ensure_future(pump_up())]
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:
            for pump in pumps:
                pump.cancel()

    table = {name: unary(name) for name in UNARY}
    table["Subscribe"] = grpc.unary_stream_rpc_method_handler(on_subscribe)
    table["Link"] = grpc.stream_stream_rpc_method_handler(on_link)
    return grpc.method_handlers_generic_handler(SERVICE, table)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--mode-file", type=Path, required=True)
    args = parser.parse_args()
    upstream = grpc.aio.insecure_channel(args.upstream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers(upstream, args.mode_file),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
