"""What a real ``fleet-worker`` holds in memory once it serves: every stage of a build started as a worker,
one session run through the chain over gRPC, then each worker's RSS (and its parts, and the resident pages
of its mapped weight file) against its shard's weights plus KV. Used by ``bench/kernels/shard_parity.py`` and
``bench/builds/gguf_forms.py``; :func:`runtime_baseline` is a worker process that has loaded nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench import harness
from fleet_common.manifest import LoadedManifest, load_manifest

PREFILL_CHUNK = 256  # tokens per Forward when filling a worker's KV (the coordinator's default is 64: fewer calls)


def mapped_weights(pid: int) -> int:
    """Resident bytes of ``pid``'s mappings of weight files (an IR's ``.bin``, a compiled ``.blob``): page
    cache the kernel can drop and re-read, counted in RSS while mapped."""
    total, weights = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                weights = line.rstrip().endswith((".bin", ".blob"))
            elif weights and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def runtime_baseline() -> int:
    """VmRSS of a worker process that has loaded nothing: Python, gRPC, the worker's modules and
    OpenVINO's CPU plugin (loaded by asking the device for a property)."""
    code = ("import openvino as ov, worker.cli, worker.server; "
            "ov.Core().get_property('CPU', 'FULL_DEVICE_NAME'); "
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])")
    done = subprocess.run([sys.executable, "-c", code], cwd=harness.ROOT, env=harness.repo_env(), capture_output=True,
                          text=True, check=True)
    return int(done.stdout.split()[-1]) * 1024


def run_session(loaded: LoadedManifest, addresses: list[str], tokens: list[int], context: int, steps: int,
                stack: ExitStack) -> list:
    """One session through the workers at ``addresses`` (stage order), as the speed part runs one: prefill to
    ``context`` in chunks of ``PREFILL_CHUNK``, then ``steps`` one-token steps; left open. Returns each
    worker's ``Info`` reply."""
    import grpc

    from fleet_common import fleet_pb2 as pb
    from fleet_common import fleet_pb2_grpc as pb_grpc
    from fleet_common.wire import to_tensor

    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    stubs = [pb_grpc.StageStub(stack.enter_context(grpc.insecure_channel(a, options=options))) for a in addresses]
    sid = "shard-parity-memory"
    for stub in stubs:
        stub.OpenSession(pb.OpenSessionRequest(session_id=sid, max_context=context + steps,
                                               manifest_sha256=loaded.sha256), timeout=30)
    starts = [*range(0, context, PREFILL_CHUNK), *range(context, context + steps)]
    for step_id, (pos, end) in enumerate(zip(starts, [*starts[1:], context + steps])):
        chunk = np.asarray([tokens[pos:end]], dtype=np.int64)  # [1, S]
        stubs[0].Forward(pb.ForwardRequest(session_id=sid, step_id=step_id, stage=0, input=to_tensor(chunk),
                                           past_length=pos, start_position=pos, route=addresses[1:],
                                           logits_count=0, manifest_sha256=loaded.sha256), timeout=120)
    infos = [stub.Info(pb.InfoRequest(), timeout=10) for stub in stubs]
    stack.callback(lambda: [stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10) for stub in stubs])
    return infos


def worker_memory(build: Path, tokens: list[int], context: int, steps: int, flags: list[str],
                  logs: Path) -> list[dict]:
    """Serve every stage of ``build`` with a real ``fleet-worker`` (``--no-announce`` and ``flags``), run one
    session through the chain (:func:`run_session`) and read each worker's memory; one row per stage."""
    loaded = load_manifest(build)
    stages = loaded.manifest.stages
    with harness.Fleet(build, logs, worker_args=flags, coordinator=False, prefix=f"shard-parity-{build.name}-") \
            as fleet, ExitStack() as session:
        ready = [harness.proc_status(proc.pid)["VmRSS"] for proc, _ in fleet.workers]
        infos = run_session(loaded, [a for _, a in fleet.workers], tokens, context, steps, session)
        rows = []
        for s, info, (proc, _), rss0 in zip(stages, infos, fleet.workers, ready):
            mem = harness.proc_status(proc.pid)
            rows.append({"build": build.name, "weights": loaded.manifest.weights, "stages": len(stages),
                         "stage": s.index, "layers": [s.start, s.end], "weight_bytes": (build / s.bin).stat().st_size,
                         "kv_bytes": info.kv_bytes, "kv_slots": context + steps, "rss_ready_bytes": rss0,
                         "rss_bytes": mem["VmRSS"], "rss_anon_bytes": mem["RssAnon"], "rss_file_bytes": mem["RssFile"],
                         "mapped_weights_bytes": mapped_weights(proc.pid), "peak_rss_bytes": mem["VmHWM"],
                         "load_source": info.load_source})
        return rows
