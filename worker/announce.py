"""Announce a worker on the LAN with zeroconf (DNS-SD over mDNS, service ``_fleet._tcp.local.``)."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Sequence

import psutil
from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from fleet_common import SERVICE_TYPE
from fleet_common.discovery import encode_txt, WorkerAd

log = logging.getLogger(__name__)


def local_ipv4() -> list[str]:
    """This PC's IPv4 addresses, loopback included (psutil: getifaddrs)."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]


def _addresses(host: str, advertise: Sequence[str] = ()) -> tuple[list[str], list[str] | None]:
    """(addresses to advertise, interfaces to announce on) for a bind address and ``--advertise-addr``.

    Bound to every interface, a worker announces every non-loopback IPv4 address it has; a coordinator
    uses the first that answers. ``advertise`` (IPv4 addresses or host names) replaces that list, announced
    on the interfaces holding those addresses (on all of them when none is local: a NAT's address)."""
    if advertise:
        addrs = [socket.gethostbyname(a) for a in advertise]
        local = [a for a in addrs if a in local_ipv4()]
        return addrs, local or None
    if host in ("0.0.0.0", "", "::"):  # sorted: the instance name takes the first
        addrs = sorted((a for a in local_ipv4() if not a.startswith("127.")),
                       key=socket.inet_aton) or ["127.0.0.1"]
        return addrs, None
    return [socket.gethostbyname(host)], [socket.gethostbyname(host)]


class Announcer:
    """Registers one ``_fleet._tcp`` service for this worker; TXT carries identity, never secrets.

    The instance name is stable per (host, first address, port, stage), so a restarted worker replaces
    its entry. Its host record is the worker's own (``fleet-<worker id>.local.``), never the PC's host
    name: cloned PCs (one host name) and workers in network namespaces of one host would otherwise
    merge their addresses into one record, and a coordinator dial one worker's port on another's address.
    """

    def __init__(self, ad: WorkerAd, host: str, advertise: Sequence[str] = ()) -> None:
        self.ad = ad
        addrs, interfaces = _addresses(host, advertise)
        self._zc = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
        name = f"fleet-stage{ad.stage}-{socket.gethostname()}-{addrs[0].replace('.', '-')}-{ad.port}"
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addrs],
            port=ad.port,
            properties=encode_txt(ad),
            server=f"fleet-{ad.worker_id or uuid.uuid4().hex[:12]}.local.",
        )

    async def start(self) -> None:
        wanted = self.info.name
        await self._zc.async_register_service(self.info, allow_name_change=True)
        if self.info.name != wanted:
            log.warning("zeroconf name %s is taken on the LAN (a cloned PC with this host name, address and port?): "
                        "announced as %s", wanted, self.info.name)
        log.info("announced %s on %s", self.info.name, self.info.parsed_addresses())

    async def stop(self) -> None:
        try:
            await self._zc.async_unregister_service(self.info)
        finally:
            await self._zc.async_close()
