"""A stage transfer cut midway across real interfaces (issue 30): two empty PCs found by zeroconf (real mDNS)
and a coordinator PC holding the demo's GGUF, its link shaped to 100 Mbit/s (tc tbf) so that a stage takes
seconds. Once a worker holds 20 MB of its stage's .bin, the coordinator's TCP connection to it is destroyed
(``ss -K`` in the coordinator's namespace: the kernel aborts the socket and resets the worker's end, as a
router dropping its state does). The coordinator resumes over a new connection from the bytes the worker
holds: the worker receives every byte of its stage exactly once, and the fleet answers."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from bench import harness

from .conftest import LanCoordinator, stop_all
from .test_empty_fleet import empty_worker, fleet_key

pytestmark = pytest.mark.lan

CUT_AT = 20_000_000  # bytes of a stage's .bin the worker holds when the connection is destroyed


def partial_bins(home: Path) -> list[Path]:
    """The partial .bin files in the stage cache under ``home``."""
    return list((home / "stages").glob("*/stage_*/openvino_model.bin.part"))


def test_a_transfer_cut_midway_resumes_where_it_stopped(lan, demo_hf, tmp_path):
    for pc in ("coord", "w0", "w1"):
        lan.add_pc(pc)
    shaped = subprocess.run(lan.pcs["coord"].cmd("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                                                 "burst", "256kb", "latency", "100ms"), capture_output=True, text=True)
    if shaped.returncode:
        pytest.skip(f"tc tbf unavailable here: {shaped.stderr.strip()}")
    gguf = harness.demo_gguf(demo_hf)
    workers = {pc: empty_worker(lan, pc, tmp_path) for pc in ("w0", "w1")}
    coord = None
    try:
        addresses = {pc: w.ready() for pc, w in workers.items()}
        coord = LanCoordinator(lan, "coord", gguf, tmp_path, "--expect-workers", "2", "--build-cache-dir",
                               str(tmp_path / "builds"), "--workers-timeout-s", "120", "--secret", fleet_key(tmp_path))
        deadline, cut = time.monotonic() + 300, None
        while cut is None and time.monotonic() < deadline:  # the build first, then the first stage ships
            assert coord.proc.popen.poll() is None, coord.proc.text()[-3000:]
            for pc in workers:
                if any(p.stat().st_size >= CUT_AT for p in partial_bins(tmp_path / pc)):
                    cut = pc
            time.sleep(0.05)
        assert cut is not None, coord.proc.text()[-3000:]
        host, port = addresses[cut].split(":")
        killed = subprocess.run(lan.pcs["coord"].cmd("ss", "-K", "dst", host, "dport", "=", port),
                                capture_output=True, text=True, timeout=30)
        assert host in killed.stdout, (killed.stdout, killed.stderr)  # the connection it destroyed
        coord.wait_ready(300, workers=2)
        r = coord.chat("Name three colours.", max_tokens=8, ignore_eos=True)
        assert r.status_code == 200 and len(r.json()["fleet"]["completion_token_ids"]) == 8, r.text
        log = coord.proc.text()
    finally:
        stop_all([*workers.values(), *([coord] if coord else [])])
    assert "resuming in" in log, log[-3000:]
    worker_log = workers[cut].proc.text()
    received = [int(n) for n in re.findall(r"stage store: (\d+) bytes received", worker_log)]
    stage_files = [p for p in (tmp_path / cut / "stages").glob("*/stage_*/*") if p.suffix in (".xml", ".bin")]
    held = sum(p.stat().st_size for p in stage_files)
    assert len(received) >= 3, worker_log[-3000:]  # the xml, the .bin's cut call, its resumed call
    assert sum(received) == held, (received, held)  # each byte once: resumed at the bytes held
    assert not partial_bins(tmp_path / cut)
    shipped = re.findall(r"stage \d+: sent .*", log)
    print(f"{cut}'s connection destroyed at {CUT_AT / 1e6:.0f} MB of its .bin; it received {received} bytes "
          f"per call, {held:,} in all; {shipped}")
