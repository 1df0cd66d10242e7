"""Announce a worker on the LAN with zeroconf (DNS-SD over mDNS, service ``_fleet._tcp.local.``)."""

from __future__ import annotations

import logging
import socket

from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from fleet_common import SERVICE_TYPE
from fleet_common.discovery import encode_txt, WorkerAd

log = logging.getLogger(__name__)


def _addresses(host: str) -> tuple[list[str], list[str] | None]:
    """(addresses to advertise, interfaces to announce on) for a bind address."""
    if host in ("0.0.0.0", "", "::"):
        from zeroconf import get_all_addresses

        addrs = [a for a in get_all_addresses() if not a.startswith("127.")] or ["127.0.0.1"]
        return addrs, None
    return [socket.gethostbyname(host)], [socket.gethostbyname(host)]


class Announcer:
    """Registers one ``_fleet._tcp`` service for this worker; TXT carries identity, never secrets.

    The instance name is stable per (host, port, stage), so a restarted worker replaces its entry.
    """

    def __init__(self, ad: WorkerAd, host: str) -> None:
        self.ad = ad
        addrs, interfaces = _addresses(host)
        self._zc = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
        name = f"fleet-stage{ad.stage}-{socket.gethostname()}-{addrs[0].replace('.', '-')}-{ad.port}"
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addrs],
            port=ad.port,
            properties=encode_txt(ad),
            server=f"{socket.gethostname()}.local.",
        )

    async def start(self) -> None:
        await self._zc.async_register_service(self.info, allow_name_change=True)
        log.info("announced %s on %s", self.info.name, self.info.parsed_addresses())

    async def stop(self) -> None:
        try:
            await self._zc.async_unregister_service(self.info)
        finally:
            await self._zc.async_close()
