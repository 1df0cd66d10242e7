"""Announce a worker on the LAN with zeroconf (DNS-SD over mDNS, service ``_fleet._tcp.local.``)."""

from __future__ import annotations

import dataclasses
import logging
import socket
import uuid
from collections.abc import Sequence

from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from fleet_common import SERVICE_TYPE
from fleet_common.discovery import Capacity, WorkerAd, announce_addresses, encode_txt

log = logging.getLogger(__name__)


class Announcer:
    """Registers one ``_fleet._tcp`` service for this worker; TXT carries identity, never secrets (an empty
    worker's: its ``capacity``, fleet_common/discovery.py).

    The instance name is stable per (host, first address, port, stage), so a restarted worker replaces
    its entry. Its host record is the worker's own (``fleet-<worker id>.local.``), never the PC's host
    name: cloned PCs (one host name) and workers in network namespaces of one host would otherwise
    merge their addresses into one record, and a coordinator dial one worker's port on another's address.
    """

    def __init__(self, ad: WorkerAd, host: str, advertise: Sequence[str] = (), capacity: Capacity | None = None) -> None:
        if capacity is not None:  # an empty worker's (stage -1)
            ad = dataclasses.replace(ad, capacity=capacity)
        self.ad = ad
        addrs, interfaces = announce_addresses(host, advertise)
        self._zc = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
        name = f"fleet-{'empty' if ad.empty else f'stage{ad.stage}'}-{socket.gethostname()}-{addrs[0].replace('.', '-')}-{ad.port}"
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
