"""A small LAN of "PCs" made of Linux network namespaces on a bridge (``ip netns``, veth pairs), for tests
that run real workers and coordinators across real interfaces instead of loopback.

Every name carries this run's id (``fleetlan<pid>``), so a crashed earlier run cannot collide, and the
leftovers of dead runs (their pid gone) are removed first. Addresses come from ranges only this test
uses (``10.77.<net>.0/24``) and live only inside the namespaces made here: the host gets none.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

PREFIX = "fleetlan"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")
_LANS = itertools.count()  # Lans of this run: each its own names
_VETHS = itertools.count()


class LanUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, EPERM in a container); the reason."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (iproute2); raises ``RuntimeError`` with its stderr when ``check`` and it fails."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces and bridges of earlier runs whose process is gone; the names removed."""
    removed = []
    for name in ip("netns", "list", check=False).stdout.split():
        if (m := re.fullmatch(rf"{PREFIX}(\d+)-.+", name)) and not _alive(int(m.group(1))):
            _kill_inside(name)  # a worker of a killed test run (its own session) may still run there
            ip("netns", "del", name, check=False)
            removed.append(name)
    for link in json.loads(ip("-j", "link", "show", check=False).stdout or "[]"):
        if (m := re.fullmatch(r"fl[bv](\d+)[nx]\d+", link["ifname"])) and not _alive(int(m.group(1))):
            ip("link", "del", link["ifname"], check=False)
            removed.append(link["ifname"])
    return removed


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes left in namespace ``ns`` (one this module made)."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def check_available() -> None:
    """Raise ``LanUnavailable`` (with the reason) unless namespaces, veth pairs and bridges can be made."""
    if shutil.which("ip") is None:
        raise LanUnavailable("iproute2's `ip` is not installed (deploy/setup.sh installs it with apt)")
    if os.geteuid() != 0:
        raise LanUnavailable("network namespaces need root (run the LAN tests as root, e.g. in CI)")
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        ip("-n", probe, "link", "add", "b0", "type", "bridge")
    except RuntimeError as exc:
        raise LanUnavailable(f"cannot make a network namespace with a veth pair and a bridge here: {exc}") from exc
    finally:
        ip("netns", "del", probe, check=False)


@dataclass
class Pc:
    """One namespace: its name and its interfaces (name in the namespace -> (address, host-side veth))."""

    ns: str
    interfaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    pool: concurrent.futures.ThreadPoolExecutor | None = None  # a thread inside this namespace (Lan.executor)

    @property
    def address(self) -> str:
        """The address of its first interface (on the LAN)."""
        return next(iter(self.interfaces.values()))[0]

    def cmd(self, *args: str) -> list[str]:
        """``args`` run inside this namespace (``ip netns exec NS ...``)."""
        return ["ip", "netns", "exec", self.ns, *args]


class Lan:
    """Namespaces ("PCs") on bridges ("networks", ``10.77.<net>.0/24``); ``close`` removes everything."""

    def __init__(self) -> None:
        self.seq = next(_LANS)
        self.run = f"{PREFIX}{os.getpid()}-{self.seq}"
        self.pcs: dict[str, Pc] = {}
        self.bridges: dict[int, str] = {}
        self._hosts: dict[int, int] = {}
        self._pools: list[concurrent.futures.ThreadPoolExecutor] = []

    def _bridge(self, net: int) -> str:
        if net not in self.bridges:
            name = f"flb{os.getpid()}n{self.seq}{net}"
            ip("link", "add", name, "type", "bridge", "mcast_snooping", "0")
            self.bridges[net] = name
            ip("link", "set", name, "up")
        return self.bridges[net]

    def add_pc(self, name: str, net: int = 0, dummies: dict[str, str] | None = None) -> Pc:
        """A new namespace with loopback up and one interface ``eth0`` on network ``net``; ``dummies``
        (name -> address/prefix, e.g. ``{"docker0": "172.17.0.1/16"}``) are interfaces made before it,
        bridges on no network (as every PC with Docker has docker0 at 172.17.0.1)."""
        pc = Pc(f"{self.run}-{name}")
        ip("netns", "add", pc.ns)
        self.pcs[name] = pc
        ip("-n", pc.ns, "link", "set", "lo", "up")
        for ifname, cidr in (dummies or {}).items():
            ip("-n", pc.ns, "link", "add", ifname, "type", "bridge")  # as docker0 is (no dummy module here)
            ip("-n", pc.ns, "addr", "add", cidr, "dev", ifname)
            ip("-n", pc.ns, "link", "set", ifname, "up")
        self.add_interface(name, net, "eth0")
        return pc

    def add_interface(self, name: str, net: int, ifname: str | None = None, multicast_route: bool = True) -> str:
        """Plug PC ``name`` into network ``net`` with a new veth (``eth<k>`` unless named); its address.
        The first interface also carries the multicast route (224.0.0.0/4) unless ``multicast_route``
        is false."""
        pc = self.pcs[name]
        ifname = ifname or f"eth{len(pc.interfaces)}"
        self._hosts[net] = host = self._hosts.get(net, 1) + 1
        address = f"10.77.{net}.{host}"
        outer = f"flv{os.getpid()}x{next(_VETHS)}"
        ip("link", "add", outer, "type", "veth", "peer", "name", ifname, "netns", pc.ns)
        ip("link", "set", outer, "master", self._bridge(net), "up")
        ip("-n", pc.ns, "addr", "add", f"{address}/24", "dev", ifname)
        ip("-n", pc.ns, "link", "set", ifname, "up")
        if multicast_route and not pc.interfaces:
            ip("-n", pc.ns, "route", "add", "224.0.0.0/4", "dev", ifname)
        pc.interfaces[ifname] = (address, outer)
        return address

    def add_router(self, name: str, nets: tuple[int, ...]) -> Pc:
        """A PC on each of ``nets`` forwarding unicast between them, as a router between subnets does (no
        multicast crosses it: mDNS is link-local); the PCs already on those nets get routes through it."""
        pc = self.add_pc(name, nets[0])
        for net in nets[1:]:
            self.add_interface(name, net)
        subprocess.run(pc.cmd("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"), check=True, timeout=30)
        for other in self.pcs.values():
            if other is pc:
                continue
            for ifname, (address, _) in other.interfaces.items():
                net = int(address.split(".")[2])
                if net in nets:
                    gateway = next(a for a, _ in pc.interfaces.values() if a.split(".")[2] == str(net))
                    for far in (n for n in nets if n != net):
                        ip("-n", other.ns, "route", "add", f"10.77.{far}.0/24", "via", gateway, "dev", ifname)
        return pc

    def link(self, name: str, up: bool, ifname: str = "eth0") -> None:
        """Take PC ``name``'s cable out (``up=False``: its bridge port goes down) or plug it back in."""
        ip("link", "set", self.pcs[name].interfaces[ifname][1], "up" if up else "down")

    def drop_multicast(self, name: str, ifname: str = "eth0") -> None:
        """No multicast reaches PC ``name`` on ``ifname`` (its bridge port floods none to it; unicast passes).
        Only that direction: what the PC sends still goes out (the kernel here has no netfilter or tc
        actions to drop it), so mDNS queries it sends are answered by unicast; for no multicast either
        way put the PC on another subnet behind ``add_router``."""
        subprocess.run(["bridge", "link", "set", "dev", self.pcs[name].interfaces[ifname][1], "mcast_flood", "off"],
                       check=True, capture_output=True, timeout=30)

    def call_in(self, name: str, fn: Callable[..., T], *args, **kw) -> T:
        """Run ``fn(*args, **kw)`` on a thread inside PC ``name``'s namespace (``setns``: sockets it makes
        live there), e.g. HTTP requests to a coordinator bound to that PC's loopback; at once when called
        on such a thread already."""
        if threading.current_thread().name.startswith(self.pcs[name].ns + "_"):
            return fn(*args, **kw)
        return self.executor(name).submit(fn, *args, **kw).result()

    def executor(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        """A pool of 4 threads that live in PC ``name``'s namespace (a stream and health checks at once)."""
        pc = self.pcs[name]
        if pc.pool is None:
            def enter() -> None:
                fd = os.open(f"/run/netns/{pc.ns}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {pc.ns} failed")
                finally:
                    os.close(fd)

            pc.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=pc.ns, initializer=enter)
            self._pools.append(pc.pool)
        return pc.pool

    def close(self) -> None:
        """Remove every namespace and bridge of this LAN (the veths go with their namespace)."""
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for pc in self.pcs.values():
            for _, outer in pc.interfaces.values():
                ip("link", "del", outer, check=False)
            _kill_inside(pc.ns)  # normally none: the tests stop what they start
            ip("netns", "del", pc.ns, check=False)
        for bridge in self.bridges.values():
            ip("link", "del", bridge, check=False)
        self.pcs.clear()
        self.bridges.clear()
