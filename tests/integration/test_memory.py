"""One compiled model per worker: each added session costs its KV state, not a model copy.

A real worker of the 1-stage build (f32: 46,080 KV bytes per token) gets sessions of 512 tokens each
through its gRPC API; its resident anonymous memory (RssAnon: heap, where the KV states live; not the
pages of the mapped weights file, which come back as the embedding rows of new tokens are read) grows
by about 512 x 46,080 B = 22.5 MiB per session, against ~540 MB of f32 weights a per-session model
copy would add; closing the sessions gives that memory back."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from fleet_common.wire import to_tensor
from tests.conftest import start_worker

pytestmark = pytest.mark.integration

TOKENS = 512
SESSIONS = 3  # sessions measured per round: 22.5 MiB of KV each, far above the allocator's noise; 6 took 13
# prefills of 512 tokens in all (83 s on a loaded 2-core machine), for the same per-session figure


def rss_bytes(pid: int) -> int:
    """Resident anonymous memory of ``pid`` (RssAnon), bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def test_session_costs_its_kv_not_a_model(build_1, tmp_path):
    manifest = load_manifest(build_1).manifest
    kv_per_session = TOKENS * manifest.kv_bytes_per_token(0, 4)
    weights = (build_1 / manifest.stages[0].bin).stat().st_size * 2  # fp16 on disk, f32 in memory
    proc, address = start_worker(build_1, 0, tmp_path, "--no-announce")
    rng = np.random.default_rng(0)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.StageStub(channel)

            def fill(session_id: str) -> None:
                stub.OpenSession(pb.OpenSessionRequest(session_id=session_id, max_context=TOKENS), timeout=30)
                ids = rng.integers(0, 40000, (1, TOKENS), dtype=np.int64)
                stub.Forward(pb.ForwardRequest(session_id=session_id, stage=0, input=to_tensor(ids)), timeout=120)

            fill("warm-up")  # first-inference allocations are not a session's cost
            before = rss_bytes(proc.popen.pid)
            for i in range(SESSIONS):
                fill(f"s{i}")
            per_session = (rss_bytes(proc.popen.pid) - before) / SESSIONS
            info = stub.Info(pb.InfoRequest(), timeout=10)
            assert info.sessions == SESSIONS + 1 and info.kv_bytes == (SESSIONS + 1) * kv_per_session
            for i in range(SESSIONS):
                stub.CloseSession(pb.CloseSessionRequest(session_id=f"s{i}"), timeout=10)
            after_close = rss_bytes(proc.popen.pid)
            for i in range(SESSIONS):
                fill(f"t{i}")
            regrowth = rss_bytes(proc.popen.pid) - after_close
    finally:
        proc.stop()
    print(f"per session: {per_session / 2**20:.1f} MiB RSS, KV {kv_per_session / 2**20:.1f} MiB, "
          f"weights {weights / 2**20:.0f} MiB; after closing: {(after_close - before) / 2**20:+.1f} MiB; "
          f"{SESSIONS} new sessions then: {regrowth / 2**20:+.1f} MiB")
    assert 0.5 * kv_per_session < per_session < 2.0 * kv_per_session
    assert per_session < 0.1 * weights
    assert after_close - before < kv_per_session  # closing gave the KV back (the worker trims its heap)
    assert 0.5 * kv_per_session < regrowth / SESSIONS < 2.0 * kv_per_session
