"""``fleet-wan``: WAN links on one machine. An asyncio TCP proxy per link adds a one-way delay with
jitter, caps bandwidth and can drop the connection after N bytes or seconds (kernel ``tc netem`` is
not available here, so the simulation is part of the product).

Put one link in front of each worker and give the coordinator the proxies' addresses (``--peer``):
every pipeline hop, including the last stage's result stream back to the coordinator (it flows on
the connection the coordinator opened), crosses a link, in both directions.

How a byte travels: it is stamped when it arrives, waits for its link direction to be free (the
bandwidth cap: a token bucket of one chunk's serialization time, ``bytes * 8 / rate``), then for
its propagation delay (``delay_ms`` plus a uniform jitter in ``[-jitter_ms, +jitter_ms]``), and is
written at that release time from a queue. Delay therefore never serialises unrelated bytes (a 50 ms
link carries many messages per 50 ms), and release times never go backwards, so a TCP byte stream
stays in order, as the kernel's reassembly would keep it.

    fleet-wan --profile wan-50 --link 127.0.0.1:9000=127.0.0.1:50051 --link 127.0.0.1:9001=127.0.0.1:50052
    fleet-wan --config links.toml        # [[link]] listen/target/profile or delay_ms, jitter_ms, ...
    fleet-wan --list-profiles
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkProfile:
    """One direction's behaviour of a link (both directions get the same).

    ``delay_ms``: one-way propagation delay; ``jitter_ms``: uniform +/- around it; ``rate_mbit``:
    bandwidth cap in Mbit/s (0 = unlimited); ``drop_after_bytes`` / ``drop_after_s``: close the
    connection once that many bytes crossed it (both directions together) or that many seconds
    passed since it opened (0 = never), to rehearse a link that dies.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 0.0
    drop_after_bytes: int = 0
    drop_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_mbit < 0 or self.drop_after_bytes < 0 \
                or self.drop_after_s < 0:
            raise ValueError(f"link profile values must be >= 0: {self}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms {self.jitter_ms} exceeds delay_ms {self.delay_ms}")


# Typical one-way figures: LAN (switched gigabit), Wi-Fi (the paper measured ~6 ms TCP RTT), WANs
# with 50 and 100 ms per hop, and a relayed VPN path (slow and narrow).
PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile(delay_ms=0.2, jitter_ms=0.05, rate_mbit=1000),
    "wifi": LinkProfile(delay_ms=3.0, jitter_ms=1.0, rate_mbit=200),
    "wan-50": LinkProfile(delay_ms=50.0, jitter_ms=2.0, rate_mbit=20),
    "wan-100": LinkProfile(delay_ms=100.0, jitter_ms=5.0, rate_mbit=20),
    "relay": LinkProfile(delay_ms=80.0, jitter_ms=10.0, rate_mbit=5),
}


def profile(name: str | None = None, **overrides: float) -> LinkProfile:
    """A named profile (or the zero profile) with ``overrides`` applied. Raises ``ValueError`` for an
    unknown name or bad values."""
    if name is not None and name not in PROFILES:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}")
    base = PROFILES[name] if name else LinkProfile()
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


class _Direction:
    """Release-time queue of one direction of one connection."""

    def __init__(self, link: WanLink, writer: asyncio.StreamWriter) -> None:
        self.link, self.writer = link, writer
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.free_at = 0.0  # when the bandwidth cap lets the next chunk start
        self.last_due = 0.0  # release times never go backwards (stream order)

    def stamp(self, data: bytes) -> None:
        """Stamp ``data``'s release time (bandwidth cap, then delay and jitter) and queue it."""
        p, now = self.link.profile, time.monotonic()
        start = max(now, self.free_at)
        sent = start + (len(data) * 8 / (p.rate_mbit * 1e6) if p.rate_mbit else 0.0)
        self.free_at = sent
        jitter = self.link.rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms else 0.0
        self.last_due = max(self.last_due, sent + (p.delay_ms + jitter) / 1000)
        self.queue.put_nowait((self.last_due, data))

    async def release(self) -> None:
        """Write queued chunks as their release times come, in order."""
        while True:
            due, data = await self.queue.get()
            if not data:
                break
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()
        with contextlib.suppress(OSError):
            self.writer.write_eof()


class WanLink:
    """Forward ``listen`` (host:port; port 0 picks one) to ``target`` (host:port) through ``profile``.

    ``start()`` runs it on its own event-loop thread and returns it (``address`` is then the bound
    listen address); ``stop()`` ends it and every connection. ``profile`` may be replaced while it
    runs: bytes arriving from then on follow the new one. ``bytes`` counts what crossed (both ways).
    """

    def __init__(self, target: str, link_profile: LinkProfile, listen: str = "127.0.0.1:0", seed: int = 0) -> None:
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        host, _, lport = listen.rpartition(":")
        self.listen_host, self.listen_port = host or "127.0.0.1", int(lport or 0)
        self.profile = link_profile
        self.rng = random.Random(seed)
        self.bytes = 0
        self.connections = 0
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"wan-{target}")
        self._server: asyncio.base_events.Server | None = None

    @property
    def address(self) -> str:
        """The link's listening address, ``host:port``: where a client dials to reach the target."""
        return f"{self.listen_host}:{self.listen_port}"

    @property
    def thread_id(self) -> int | None:
        """The native id of the thread running the link's event loop (None before :meth:`start`)."""
        return self._thread.native_id

    async def _pump(self, reader: asyncio.StreamReader, direction: _Direction, crossed: list[int],
                    drop: asyncio.Event) -> None:
        try:
            while data := await reader.read(1 << 16):
                limit = self.profile.drop_after_bytes
                if limit and crossed[0] + len(data) >= limit:
                    data = data[:max(0, limit - crossed[0])]
                    drop.set()
                crossed[0] += len(data)
                self.bytes += len(data)
                if data:
                    direction.stamp(data)
                if drop.is_set():
                    break
        except OSError:
            pass
        finally:
            direction.queue.put_nowait((0.0, b""))

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            await self._relay(client_r, client_w)
        except asyncio.CancelledError:  # stop(): end quietly (asyncio logs a handler that ends cancelled)
            client_w.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as exc:
            log.warning("link %s: cannot reach %s:%d: %s", self.address, self.target_host, self.target_port, exc)
            client_w.close()
            return
        up, down = _Direction(self, up_w), _Direction(self, client_w)
        crossed, drop = [0], asyncio.Event()
        tasks = [asyncio.ensure_future(c) for c in (self._pump(client_r, up, crossed, drop),
                                                    self._pump(up_r, down, crossed, drop), up.release(),
                                                    down.release())]
        if self.profile.drop_after_s:
            self._loop.call_later(self.profile.drop_after_s, drop.set)
        dropper = asyncio.ensure_future(drop.wait())
        await asyncio.wait([dropper, asyncio.gather(*tasks, return_exceptions=True)],
                           return_when=asyncio.FIRST_COMPLETED)
        if drop.is_set():  # the link dies: both sides see the connection reset, queued bytes are lost
            self.dropped += 1
            for task in tasks:
                task.cancel()
            for w in (client_w, up_w):
                with contextlib.suppress(OSError, RuntimeError):
                    w.transport.abort()
        dropper.cancel()
        await asyncio.gather(*tasks, dropper, return_exceptions=True)
        for w in (client_w, up_w):
            w.close()

    def start(self) -> WanLink:
        """Start the link's event loop thread and listen; returns the link (its port is known now)."""
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, self.listen_host, self.listen_port), self._loop).result()
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then stop the event loop thread."""
        async def close() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def load_config(path: Path) -> list[tuple[str, str, LinkProfile]]:
    """Links from a TOML or JSON file: ``[[link]]`` tables (JSON: ``{"link": [...]}``) with ``listen``,
    ``target`` and a ``profile`` name and/or ``LinkProfile`` fields. Raises ``ValueError``."""
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    links = []
    for entry in data.get("link", []):
        entry = dict(entry)
        try:
            listen, target = entry.pop("listen"), entry.pop("target")
        except KeyError as exc:
            raise ValueError(f"{path}: every link needs listen and target ({exc} missing)") from None
        links.append((listen, target, profile(entry.pop("profile", None), **entry)))
    if not links:
        raise ValueError(f"{path}: no [[link]] entries")
    return links


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-wan`` console script."""
    parser = argparse.ArgumentParser(prog="fleet-wan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", action="append", default=[], metavar="LISTEN=TARGET",
                        help="proxy host:port LISTEN to host:port TARGET (repeatable)")
    parser.add_argument("--profile", help=f"link profile: {', '.join(PROFILES)} (default: no delay)")
    parser.add_argument("--delay-ms", type=float, help="one-way delay (overrides the profile)")
    parser.add_argument("--jitter-ms", type=float, help="uniform jitter around the delay")
    parser.add_argument("--rate-mbit", type=float, help="bandwidth cap per direction, Mbit/s (0 = none)")
    parser.add_argument("--drop-after-bytes", type=int, help="close each connection after this many bytes")
    parser.add_argument("--drop-after-s", type=float, help="close each connection after this many seconds")
    parser.add_argument("--config", type=Path, help="TOML/JSON file of [[link]] entries (listen, target, profile, ...)")
    parser.add_argument("--list-profiles", action="store_true", help="print the built-in profiles and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s fleet-wan: %(message)s")
    if args.list_profiles:
        for name, p in PROFILES.items():
            print(f"{name:<8} {json.dumps(asdict(p))}")
        return 0
    try:
        links = load_config(args.config) if args.config else []
        overrides = dict(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, rate_mbit=args.rate_mbit,
                         drop_after_bytes=args.drop_after_bytes, drop_after_s=args.drop_after_s)
        for spec in args.link:
            listen, sep, target = spec.partition("=")
            if not sep or ":" not in listen or ":" not in target:
                raise ValueError(f"--link {spec!r}: expected LISTEN_HOST:PORT=TARGET_HOST:PORT")
            links.append((listen, target, profile(args.profile, **overrides)))
        if not links:
            raise ValueError("no links: give --link LISTEN=TARGET or --config FILE")
        running = [WanLink(target, p, listen).start() for listen, target, p in links]
    except (OSError, ValueError) as exc:
        print(f"fleet-wan: error: {exc}", file=sys.stderr)
        return 2
    for link in running:
        print(f"{link.address} -> {link.target_host}:{link.target_port}  {asdict(link.profile)}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        for link in running:
            link.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
