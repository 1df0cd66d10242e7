"""Failures a real fleet meets: mismatched builds, dead workers, missing stages, bad wire input."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from fleet_common.wire import to_tensor
from tests.conftest import Fleet, chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration


def test_mismatched_build_is_refused_and_missing_stage_reported(build_2, tmp_path):
    other = tmp_path / "other-build"
    shutil.copytree(build_2, other, copy_function=os.link)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model_id"] = "someone-elses-model"
    (other / "manifest.json").unlink()  # hard link: do not write through to the real build
    (other / "manifest.json").write_text(json.dumps(manifest))
    good, _ = start_worker(build_2, 0, tmp_path)
    bad, bad_address = start_worker(other, 1, tmp_path, name="-other")
    coordinator, url = start_coordinator(build_2, tmp_path)
    try:
        line = coordinator.wait_for(rf"refusing worker {bad_address} .*", timeout=30).group(0)
        assert load_manifest(other).sha256[:12] in line and load_manifest(build_2).sha256[:12] in line
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["missing_stages"] == [1]
        r = chat(url, "hi")
        assert r.status_code == 503 and "stage 1 of 2" in r.json()["error"]["message"]
        # the right worker for stage 1 makes the fleet whole
        right, _ = start_worker(build_2, 1, tmp_path, name="-right")
        try:
            wait_ready(url, 30)
            assert chat(url, "What is the capital of France?", max_tokens=16).status_code == 200
        finally:
            right.stop()
    finally:
        coordinator.stop()
        bad.stop()
        good.stop()


def test_killed_worker_fails_fast_then_rejoins(build_2, tmp_path):
    fleet = Fleet(build_2, tmp_path)
    try:
        outcome = {}

        def long_request():
            t0 = time.monotonic()
            r = chat(fleet.url, "Write a long story about a dragon.", max_tokens=2000, ignore_eos=True)
            outcome.update(status=r.status_code, body=r.json(), done=time.monotonic(), started=t0)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(3.0)  # mid-generation
        killed_at = time.monotonic()
        fleet.workers[1][0].kill()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert outcome["done"] - killed_at < 5.0, "the request must end within 5 s of the worker dying"
        assert outcome["status"] == 503
        assert "stage 1" in outcome["body"]["error"]["message"]
        # the coordinator keeps serving: health says what is missing
        deadline = time.monotonic() + 10
        while httpx.get(f"{fleet.url}/health", timeout=5).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(f"{fleet.url}/health", timeout=5).json()["missing_stages"] == [1]
        # restart it (new process, new port): it rejoins by itself through zeroconf and replaces the old entry
        dead = fleet.workers[1][1]
        fleet.workers[1] = start_worker(build_2, 1, tmp_path, name="-restarted")
        wait_ready(fleet.url, 30)
        addresses = [w["address"] for w in httpx.get(f"{fleet.url}/health", timeout=5).json()["workers"]]
        assert fleet.workers[1][1] in addresses and dead not in addresses, addresses
        r = chat(fleet.url, "What is the capital of France?", max_tokens=16)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def last_worker(build_2, tmp_path_factory):
    proc, address = start_worker(build_2, 1, tmp_path_factory.mktemp("wire"), "--max-sessions", "2",
                                 "--no-announce")
    yield address, load_manifest(build_2)
    proc.stop()


def test_worker_rejects_bad_input_and_keeps_serving(last_worker):
    address, loaded = last_worker
    hidden = loaded.manifest.architecture.hidden_size
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StageStub(channel)

        def forward(**kw):
            base = dict(session_id="s1", stage=1, past_length=0, start_position=0,
                        input=to_tensor(np.zeros((1, 2, hidden), np.float32)))
            return stub.Forward(pb.ForwardRequest(**{**base, **kw}), timeout=10)

        def code_of(call):
            with pytest.raises(grpc.RpcError) as info:
                call()
            return info.value.code(), info.value.details()

        assert code_of(lambda: forward())[0] == grpc.StatusCode.NOT_FOUND  # unknown session
        stub.OpenSession(pb.OpenSessionRequest(session_id="s1", max_context=64), timeout=10)
        code, details = code_of(lambda: forward(input=to_tensor(np.zeros((1, 2, hidden + 1), np.float32))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "hidden states" in details
        code, details = code_of(lambda: forward(input=pb.Tensor(data=b"junk", shape=[1, 2, hidden], dtype="float32")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in details
        code, _ = code_of(lambda: forward(input=to_tensor(np.zeros((1, 2), np.int64))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, details = code_of(lambda: forward(stage=0))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "stage 0" in details
        code, details = code_of(lambda: forward(manifest_sha256="0" * 64))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "mismatch" in details
        code, details = code_of(lambda: forward(past_length=5))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "holds 0 KV slots" in details
        code, details = code_of(lambda: forward(input=to_tensor(np.zeros((1, 65, hidden), np.float32))))
        assert code == grpc.StatusCode.OUT_OF_RANGE and "max context 64" in details
        code, details = code_of(lambda: forward(hide_slots=[3]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, details = code_of(lambda: forward(logits_count=1, reply_to="nobody"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "subscriber" in details
        # garbage bytes instead of a protobuf
        raw = channel.unary_unary("/fleet.v1.Stage/Forward", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\x00\x13garbage" * 10, timeout=10)
        assert "Error parsing message" in info.value.details()  # grpc's own clear error; the worker lives on
        # a valid chunk still works and advances the session
        assert forward().compute_ms > 0
        assert forward(past_length=2, start_position=2, hide_slots=[0]).compute_ms > 0
        # the session cap answers RESOURCE_EXHAUSTED
        stub.OpenSession(pb.OpenSessionRequest(session_id="s2"), timeout=10)
        code, details = code_of(lambda: stub.OpenSession(pb.OpenSessionRequest(session_id="s3"), timeout=10))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-sessions" in details
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert info.sessions == 2 and info.kv_bytes > 0 and info.stage == 1
        assert stub.CloseSession(pb.CloseSessionRequest(session_id="s1"), timeout=10).existed
        assert stub.CloseSession(pb.CloseSessionRequest(session_id="s2"), timeout=10).existed
        assert stub.Info(pb.InfoRequest(), timeout=10).sessions == 0
