"""``--memory-mb`` bounds what a worker holds (issue 45 #5): its KV budget (unset ``--kv-budget-mb``) fits
beside its loaded stage within that memory; before, it was half of the machine's available memory whatever
the flag said (11.8 GB offered with 1500 MiB set)."""

from __future__ import annotations

import grpc
import psutil
import pytest

from fleet_common import fleet_pb2 as pb
from tests.conftest import start_worker

pytestmark = pytest.mark.integration

MEMORY_MB = 1500


def test_the_kv_budget_stays_within_memory_mb(build_1, tmp_path):
    proc, address = start_worker(build_1, 0, tmp_path, "--no-announce", "--memory-mb", str(MEMORY_MB))
    try:
        with grpc.insecure_channel(address) as channel:
            info = pb.InfoReply.FromString(channel.unary_unary("/fleet.v1.Stage/Info")(b"", timeout=10))
        rss = psutil.Process(proc.popen.pid).memory_info().rss
        print(f"--memory-mb {MEMORY_MB}: KV budget {info.kv_budget_bytes >> 20} MiB beside {rss >> 20} MiB "
              f"resident; machine available {psutil.virtual_memory().available >> 20} MiB")
        assert 0 < info.kv_budget_bytes <= (MEMORY_MB << 20) - rss + (64 << 20)  # RSS moves a little after start
    finally:
        proc.stop()
