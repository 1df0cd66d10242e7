"""What a worker or coordinator announces (fleet_common.discovery.announce_addresses): its addresses in a stable order (the instance name takes
the first), only ``--advertise-addr`` when given, on the interfaces holding it."""

from __future__ import annotations

import socket

from fleet_common.discovery import announce_addresses as _addresses
from fleet_common.discovery import local_ipv4


def test_every_address_sorted_when_bound_to_all():
    addrs, interfaces = _addresses("0.0.0.0")
    assert interfaces is None  # announced on every interface
    assert addrs == sorted(addrs, key=socket.inet_aton)
    assert set(addrs) == ({a for a in local_ipv4() if not a.startswith("127.")} or {"127.0.0.1"})


def test_advertise_addr_replaces_the_list():
    assert _addresses("0.0.0.0", ["127.0.0.1"]) == (["127.0.0.1"], ["127.0.0.1"])  # local: announced there
    assert _addresses("0.0.0.0", ["192.0.2.7"]) == (["192.0.2.7"], None)  # a NAT's (TEST-NET-1): on every interface
    assert _addresses("127.0.0.1") == (["127.0.0.1"], ["127.0.0.1"])
