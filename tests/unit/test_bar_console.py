"""The coordinator's shipping bars (fleet_common.shipping.RichProgress) and a worker's receiving bars
(worker/receiving.py) written into a log file, not a terminal (``nohup``): one line per file, not wrapped at 80
columns (both take fleet_common/console.py ``bar_console``). Real processes writing into real files."""

from __future__ import annotations

import subprocess
import sys

LABEL = "stage 1 -> 192.168.100.200:50051: stage_1/openvino_model.bin"  # with the bar: far past 80 columns

SHIP = f"""
from fleet_common.shipping import RichProgress
with RichProgress() as bars:
    bars({LABEL!r}, 0, 90_000_000)
    bars({LABEL!r}, 90_000_000, 90_000_000)
"""
RECEIVE = f"""
from worker.receiving import ReceiveBars
bars = ReceiveBars()
bars.update("k", {LABEL!r}, 90_000_000, 90_000_000)
bars.end("k")
"""


def drawn(code: str, tmp_path, name: str) -> list[str]:
    """The lines ``code`` wrote into a file (stdout and stderr), each bar's last state."""
    log = tmp_path / name
    with log.open("w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, timeout=60, check=True,
                       env={"PATH": "/usr/bin:/bin", "TERM": "dumb"})
    return [line for line in log.read_text().splitlines() if line.strip()]


def test_the_coordinators_and_the_workers_bars_are_not_wrapped_in_a_log(tmp_path):
    for code, name in ((SHIP, "coordinator.log"), (RECEIVE, "worker.log")):
        lines = drawn(code, tmp_path, name)
        bar = [line for line in lines if "openvino_model.bin" in line]
        assert len(bar) == 1 and "90.0/90.0 MB" in bar[0] and LABEL in bar[0], lines
