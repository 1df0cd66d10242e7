"""A small delaying TCP proxy: every byte is released ``delay_ms`` after it arrived, in each direction.

Put one in front of each worker (and point the coordinator at the proxies with ``--peer``) and every
pipeline hop, including the last stage's result stream back to the coordinator, gets a one-way
delay. Bytes are stamped on arrival and written at their release time from a queue, so the delay
does not serialize unrelated bytes (a 10 ms link still carries many messages per 10 ms). The WAN
tooling (jitter, bandwidth caps, drops) builds on this.

    python bench/delay_proxy.py --listen 127.0.0.1:9000 --target 127.0.0.1:50051 --delay-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: Callable[[], float]) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    sender = asyncio.create_task(release())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s(), data))
    except OSError:
        pass
    finally:
        queue.put_nowait((time.monotonic() + delay_s(), b""))
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await sender


class DelayProxy:
    """Forward ``listen_port`` on 127.0.0.1 to ``target`` (host:port), adding ``delay_ms`` one way in
    each direction. ``start()`` runs it on its own event-loop thread; ``stop()`` ends it. Setting
    ``delay_s`` applies to bytes arriving from then on, on open connections too."""

    def __init__(self, target: str, delay_ms: float, listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.delay_s = delay_ms / 1000.0
        self.listen_host, self.listen_port = listen_host, listen_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="delay-proxy")
        self._server: asyncio.base_events.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as exc:
            log.warning("proxy %s: cannot reach %s:%d: %s", self.address, self.target_host, self.target_port, exc)
            client_w.close()
            return
        delay = lambda: self.delay_s  # noqa: E731 - read per chunk: the delay may be changed while running
        await asyncio.gather(_pump(client_r, up_w, delay), _pump(up_r, client_w, delay))
        for w in (client_w, up_w):
            w.close()

    def start(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, self.listen_host, self.listen_port), self._loop).result()
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="host:port to accept on")
    parser.add_argument("--target", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    proxy = DelayProxy(args.target, args.delay_ms, host, int(port)).start()
    print(f"{proxy.address} -> {args.target}, +{args.delay_ms} ms each way; Ctrl-C stops")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
