"""What a worker announces over zeroconf (TXT record) and how the coordinator reads it back."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    """What an empty worker can hold and how fast it runs (worker/capacity.py): ``memory_available_bytes``
    (MemAvailable at its start), ``device`` (OpenVINO's name) and ``ms_per_gb``, ms to read 1 GB (1e9 bytes)
    of f16 weights in a MatMul (the planner's ``ms_per_layer`` is that times a layer's weight bytes / 1e9);
    ``cached``: read back from the worker's cache rather than measured at this start."""

    memory_available_bytes: int
    device: str
    ms_per_gb: float
    cached: bool = False

    def line(self) -> str:
        """For logs and errors: ``12,595 MiB available, CPU, 4.21 ms per GB of f16 weights (measured)`` (MiB: the
        planner's unit)."""
        return (f"{self.memory_available_bytes / 2**20:,.0f} MiB available, {printable(self.device)}, "
                f"{self.ms_per_gb:.2f} ms per "
                f"GB of f16 weights ({'cached' if self.cached else 'measured'})")


MIN_MS_PER_GB, MAX_MS_PER_GB = 0.01, 1e5  # 100 TB/s .. 10 MB/s of weights read: beyond either, not a measurement
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: no PC of a LAN fleet has more


def printable(text: str, limit: int = 80) -> str:
    """``text`` from another PC (a device name, a worker id) as it may be printed: control characters (an ANSI
    escape, a newline) escaped, cut at ``limit`` characters."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)[:limit])
    return shown + ("..." if len(str(text)) > limit else "")


def implausible(capacity: Capacity) -> str | None:
    """Why ``capacity`` (as a worker announced it) cannot be a measured one, or None: a speed not finite or
    outside ``MIN_MS_PER_GB``..``MAX_MS_PER_GB`` ms per GB, a memory not in 1..``MAX_MEMORY_BYTES`` bytes."""
    ms, memory = capacity.ms_per_gb, capacity.memory_available_bytes
    if not isinstance(ms, (int, float)) or not MIN_MS_PER_GB <= ms <= MAX_MS_PER_GB:  # NaN and inf fail too
        return (f"a speed of {ms!r} ms per GB of weights (a measured one is {MIN_MS_PER_GB:g}..{MAX_MS_PER_GB:g}: "
                "100 TB/s..10 MB/s)")
    if not isinstance(memory, int) or not 0 < memory <= MAX_MEMORY_BYTES:
        return f"{memory!r} bytes of memory available (a PC has 1..{MAX_MEMORY_BYTES:,})"
    return None


class EmptyWorker(ValueError):
    """The TXT record of an empty worker (no stage yet; fleet-worker without --shard/--model): ``capacity``."""

    def __init__(self, message: str, capacity: Capacity, worker_id: str) -> None:
        super().__init__(message)
        self.capacity, self.worker_id = capacity, worker_id


@dataclass(frozen=True)
class WorkerAd:
    """A worker's advertisement: enough to place it in a pipeline and to refuse a mismatched one."""

    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    manifest_sha256: str
    protocol_version: int
    model_id: str
    worker_id: str
    port: int
    host: str = ""  # filled in by the browser from the DNS A record
    capacity: Capacity | None = None  # an empty worker's (stage -1): announced instead of a stage

    @property
    def empty(self) -> bool:
        """A worker with no stage yet (it announces its capacity)."""
        return self.stage < 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def encode_txt(ad: WorkerAd) -> dict[str, str]:
    """TXT properties for ``ad`` (all strings; mDNS TXT values are short byte strings). An empty worker's
    say ``state=empty`` and carry its capacity (``mem`` bytes, ``device``, ``msgb``: ms per GB)."""
    if ad.empty:
        cap = ad.capacity or Capacity(0, "", 0.0)
        return {"state": "empty", "proto": str(ad.protocol_version), "id": ad.worker_id,
                "mem": str(cap.memory_available_bytes), "device": cap.device, "msgb": f"{cap.ms_per_gb:.4f}"}
    return {
        "stage": str(ad.stage),
        "stages": str(ad.num_stages),
        "layers": f"{ad.layer_start}:{ad.layer_end}",
        "manifest": ad.manifest_sha256,
        "proto": str(ad.protocol_version),
        "model": ad.model_id[:120],
        "id": ad.worker_id,
    }


def decode_txt(props: dict[bytes, bytes | None], host: str, port: int) -> WorkerAd:
    """Parse TXT properties back into a ``WorkerAd``; raises ``ValueError`` when fields are missing or bad,
    and its subclass ``EmptyWorker`` (with the capacity) for an empty worker's, which serves no stage yet."""
    try:
        p = {k.decode(): (v or b"").decode() for k, v in props.items()}
        if p.get("state") == "empty":
            capacity = Capacity(int(p["mem"]), p.get("device", ""), float(p["msgb"]))
            raise EmptyWorker(f"worker {host}:{port} (id {p.get('id', '')}) is empty ({capacity.line()}): it serves a "
                              "stage once one is shipped to it and loaded (fleet_common/shipping.py): a coordinator "
                              "serving --model SOURCE plans it in", capacity, p.get("id", ""))
        start, end = (int(x) for x in p["layers"].split(":"))
        return WorkerAd(
            stage=int(p["stage"]),
            num_stages=int(p["stages"]),
            layer_start=start,
            layer_end=end,
            manifest_sha256=p["manifest"],
            protocol_version=int(p["proto"]),
            model_id=p.get("model", ""),
            worker_id=p.get("id", ""),
            port=port,
            host=host,
        )
    except EmptyWorker:
        raise
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"bad fleet TXT record from {host}:{port}: {exc!r}") from exc


def record_problem(props: dict[bytes, bytes | None], port: int) -> str | None:
    """Why a ``_fleet._tcp`` record's TXT ``props`` are not a fleet worker's of this protocol (missing or bad
    fields, another ``proto``), or None. The record is a hint only: its address still has to answer Info."""
    from . import PROTOCOL_VERSION

    try:
        decode_txt(props, "", port)
    except EmptyWorker:
        pass
    except ValueError as exc:
        return str(exc)
    proto = (props.get(b"proto") or b"").decode(errors="replace")
    if proto != str(PROTOCOL_VERSION):
        return f"its TXT record names protocol {printable(proto)!r}, this coordinator speaks {PROTOCOL_VERSION}"
    return None


MIN_PORT = 1024  # a worker's port: never a privileged one (nor 0)
CGNAT = ipaddress.IPv4Network("100.64.0.0/10")  # shared address space: a VPN's LAN (Tailscale), not the internet


def implausible_endpoint(host: str, port: int) -> str | None:
    """Why ``host:port`` (from an mDNS record, which anyone on the LAN can send) is not a fleet worker's
    address worth dialing, or None. A worker listens on an IPv4 address of the LAN (private, loopback,
    link-local, or a VPN's 100.64.0.0/10) and a port in ``MIN_PORT``..65535; a public, multicast, broadcast,
    unspecified or reserved address, or a privileged port, is refused."""
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        return f"{printable(host)!r} is not an IPv4 address"
    if not MIN_PORT <= port <= 65535:
        return f"port {port} (a worker listens on {MIN_PORT}..65535)"
    if addr.is_unspecified or addr.is_multicast or addr.is_reserved or addr == ipaddress.IPv4Address("255.255.255.255"):
        return f"{addr} is not a host's address"
    if not (addr.is_private or addr.is_loopback or addr.is_link_local or addr in CGNAT):
        return f"{addr} is not a LAN address (private, loopback, link-local or 100.64.0.0/10)"
    return None


def local_ipv4() -> list[str]:
    """This PC's IPv4 addresses, loopback included (psutil: getifaddrs)."""
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]


def announce_addresses(host: str, advertise: Sequence[str] = ()) -> tuple[list[str], list[str] | None]:
    """(addresses to announce, interfaces to announce on; None = all) for a service bound to ``host``.

    Bound to every interface (0.0.0.0), every non-loopback IPv4 address this PC has, sorted (instance
    names take the first); the reader keeps the first that answers. ``advertise`` (IPv4 addresses or
    host names) replaces that list, announced on the interfaces holding those addresses (on all of them
    when none is local: a NAT's address). Never the host name's address: /etc/hosts often maps it to
    127.0.0.1 or 127.0.1.1, which no other PC can reach. Raises ``OSError`` for a name that does not resolve."""
    if advertise:
        addrs = [socket.gethostbyname(a) for a in advertise]
        local = [a for a in addrs if a in local_ipv4()]
        return addrs, local or None
    if host in ("0.0.0.0", "", "::"):
        addrs = sorted((a for a in local_ipv4() if not a.startswith("127.")), key=socket.inet_aton) or ["127.0.0.1"]
        return addrs, None
    return [socket.gethostbyname(host)], [socket.gethostbyname(host)]
