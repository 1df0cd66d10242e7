"""Failures a real fleet meets: mismatched builds and protocol versions (and what `fleet-coordinator status`
reports of them), dead workers, missing stages, bad wire input, a stop before the fleet is whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
from fleet_common import PROTOCOL_VERSION
from tests.conftest import BIN, EXACT_WORKER, Fleet, Proc, chat, start_coordinator, start_worker, wait_ready

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
        assert r.status_code == 503 and "stage 1 (of stages 0..1)" in r.json()["error"]["message"]
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


# fleet-worker as a release with the previous wire protocol: the real worker, its version constant set before
# its modules import it (no product code edited for the test)
OLD_WORKER = ("import sys, fleet_common; fleet_common.PROTOCOL_VERSION -= 1; "
              "from worker.cli import main; sys.exit(main())")


def test_worker_of_another_protocol_version_is_refused_and_status_exits_3(build_2, tmp_path):
    good, good_address = start_worker(build_2, 0, tmp_path, "--no-announce")
    old = Proc([sys.executable, "-c", OLD_WORKER, "--shard", "1", "--model", str(build_2), "--port", "0",
                *EXACT_WORKER, "--no-announce"], tmp_path / "worker1-old.log")
    try:
        old_address = old.wait_for(r"serving on ([\d.]+:\d+)").group(1)
        coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover", "--peer", good_address,
                                             "--peer", old_address)
    except BaseException:
        old.stop()
        good.stop()
        raise
    try:
        reason = (f"refusing worker {old_address}: protocol version {PROTOCOL_VERSION - 1}, coordinator speaks "
                  f"{PROTOCOL_VERSION}")
        coordinator.wait_for(f"ERROR coordinator coordinator.fleet.registry: {reason}", timeout=30)

        def status(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(BIN / "fleet-coordinator"), "status", "--url", url, *args],
                                  capture_output=True, text=True, timeout=60)

        as_json = status("--json")
        assert as_json.returncode == 3, as_json.stdout + as_json.stderr  # a stage is missing
        health = json.loads(as_json.stdout)
        assert health["ready"] is False and health["missing_stages"] == [1] and health["num_stages"] == 2, health
        assert health["protocol_version"] == PROTOCOL_VERSION
        workers = {w["address"]: w for w in health["workers"]}
        assert workers.keys() == {good_address, old_address}, workers
        assert workers[good_address]["healthy"] and workers[good_address]["refused"] is None
        assert workers[good_address]["stage"] == 0 and workers[good_address]["protocol_version"] == PROTOCOL_VERSION
        assert not workers[old_address]["healthy"] and workers[old_address]["refused"] == reason
        assert workers[old_address]["protocol_version"] == PROTOCOL_VERSION - 1, workers[old_address]
        text = status()
        assert text.returncode == 3, text.stdout + text.stderr
        assert "NOT READY, missing stage(s) [1]" in text.stdout and "<- MISSING" in text.stdout, text.stdout
        assert f"{old_address:<21} REFUSED  {reason}" in text.stdout, text.stdout
        r = chat(url, "hi", max_tokens=4)
        assert r.status_code == 503 and "stage 1 (of stages 0..1)" in r.json()["error"]["message"], r.text
    finally:
        coordinator.stop()
        old.stop()
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
        print(f"\nkill -9 of stage 1 mid-answer: HTTP {outcome['status']} {outcome['done'] - killed_at:.2f} s later")
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


def test_coordinator_stopped_before_its_fleet_is_whole_exits_cleanly(build_2, tmp_path):
    coordinator, url = start_coordinator(build_2, tmp_path, "--no-discover")  # no workers: never ready
    assert httpx.get(f"{url}/health", timeout=5).json()["missing_stages"] == [0, 1]
    coordinator.stop()
    assert coordinator.popen.returncode == 0, coordinator.text()[-3000:]
    assert "coordinator stopped" in coordinator.text()
    errors = [line for line in coordinator.text().splitlines() if " ERROR " in line]
    assert not errors, coordinator.text()[-3000:]
