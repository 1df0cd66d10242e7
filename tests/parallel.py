"""What lets test files run at once under pytest-xdist (``-n 2``, pyproject.toml): each xdist worker in a network
namespace of its own, and a file lock around every artifact two of them may build into the tests' model folder.

Two xdist workers on one network would disturb each other: a coordinator that browses zeroconf finds every
worker announced on the machine with the same build (the demo's), so one test's fleet would take in the
other's workers. In its own namespace (root only: ``unshare(CLONE_NEWNET)``; elsewhere the suite runs
serially, see ``pytest_xdist_auto_num_workers`` in conftest.py) each xdist worker has its own loopback,
its own ports and its own mDNS, and one stand-in LAN interface (``lan0``, a veth pair) with an address, as
a PC has. Downloads (pip) need the machine's network: :func:`host_network`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import filelock

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
LAN_ADDRESS = "10.79.0.1/24"  # lan0's address in each xdist worker's namespace (a range no other test uses)
_host_net: int | None = None  # fd of the machine's network namespace, once this process left it


def can_isolate() -> bool:
    """Whether xdist workers can each have a network namespace: root, Linux, iproute2's ``ip``."""
    import shutil

    return os.name == "posix" and os.geteuid() == 0 and shutil.which("ip") is not None


def _setns(fd: int) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns failed")


def own_network() -> None:
    """Move this thread (xdist runs the tests on the main thread; every process and thread it starts
    inherits it) into a new network namespace with loopback and ``lan0`` up. Raises ``OSError`` or
    ``subprocess.CalledProcessError`` where that fails (not root, no ``ip``)."""
    global _host_net
    host = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        os.close(host)
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    _host_net = host
    for cmd in (("link", "set", "lo", "up"), ("link", "add", "lan0", "type", "veth", "peer", "name", "lan1"),
                ("addr", "add", LAN_ADDRESS, "dev", "lan0"), ("link", "set", "lan1", "up"),
                ("link", "set", "lan0", "up")):
        subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=30)
    log.info("xdist worker %s: own network namespace (lo, lan0 %s)", os.environ.get("PYTEST_XDIST_WORKER"),
             LAN_ADDRESS)


@contextlib.contextmanager
def host_network() -> Iterator[None]:
    """Run the block (a ``pip download``) in the machine's network namespace when this xdist worker has its
    own, else as it is; back in the worker's own namespace after it."""
    if _host_net is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(_host_net)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


@contextlib.contextmanager
def built_once(folder: Path) -> Iterator[None]:
    """Hold ``FOLDER.lock`` beside ``folder`` (an artifact of the tests' model folder) for the block: the
    xdist worker that comes second waits for the first one's build and then finds it done."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder) + ".lock", timeout=3600):
        yield
