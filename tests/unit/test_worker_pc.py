"""A PC that only runs a worker (issue 30 item 5): ``pip install .`` pulls neither torch nor the compile extra,
an empty worker runs with both blocked from import (a real process answering Info and StageStatus over gRPC),
and the demo's ``deploy/setup.sh`` installs ``.[compile]`` only: the test extra comes with ``--test`` alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from contextlib import ExitStack
from pathlib import Path

import grpc

from bench import harness
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.security import Security, open_channel
from tests.unit.test_compile_deps import FORBIDDEN, dependency_closure

ROOT = Path(__file__).resolve().parents[2]
COMPILE_ONLY = {"nncf", "safetensors", "gguf"}  # the compile extra's own packages

# torch, transformers and the compile extra's packages fail if anything imports them; then an empty worker runs
WORKER_BLOCKED = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'optimum', 'accelerate', 'nncf', 'gguf', 'safetensors'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
from worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_pc_installs_neither_torch_nor_the_compile_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    closure = dependency_closure(project["dependencies"])
    assert {"openvino", "grpcio", "rich", "zeroconf"} <= closure, sorted(closure)
    assert not closure & (FORBIDDEN | COMPILE_ONLY), sorted(closure & (FORBIDDEN | COMPILE_ONLY))


def test_an_empty_worker_runs_with_torch_and_the_compile_extra_blocked(tmp_path):
    with ExitStack() as stack:
        proc = harness.spawn([sys.executable, "-c", WORKER_BLOCKED, "--port", "0", "--no-announce", "--threads", "1",
                              "--stages-dir", str(tmp_path / "stages")], tmp_path / "worker.log", stack)
        address = proc.wait_for(r"worker ready: empty .* serving on ([\d.]+:\d+)", 120).group(1)

        async def ask() -> tuple[pb.InfoReply, grpc.aio.AioRpcError]:
            async with open_channel(address, Security()) as channel:
                info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=30)
                try:  # the StageStore answers (no manifest sent: refused by name)
                    await pb_grpc.StageStoreStub(channel).StageStatus(pb.StageStatusRequest(
                        manifest_sha256="a" * 64, stage=0), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return info, exc
                raise AssertionError("StageStatus without a manifest succeeded")

        info, refused = asyncio.run(ask())
    assert info.empty and info.memory_available_bytes > 0 and info.ms_per_gb > 0, info
    assert "send it with StageStatus first" in refused.details(), refused
    assert "blocked for this test" not in proc.text(), proc.text()[-2000:]


def test_the_demo_setup_installs_the_compile_extra_only(tmp_path):
    """``deploy/setup.sh`` (no --test) run in a copy of the repository's setup files, with a recording stand-in
    for python: its pip installs ``-e .[compile]`` and nothing of the test extra or torch."""
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "setup.sh").write_bytes((ROOT / "deploy" / "setup.sh").read_bytes())
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    calls = tmp_path / "calls.txt"
    recorder = tmp_path / "python"  # `python -m venv .venv` makes .venv/bin/python, a recorder of its arguments
    recorder.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
""")
    recorder.chmod(0o755)
    out = subprocess.run(["bash", str(tmp_path / "deploy" / "setup.sh")], env={**os.environ, "PYTHON": str(recorder)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    installs = [line for line in calls.read_text().splitlines() if " pip install " in f" {line} "]
    assert any(line.endswith("-e .[compile]") for line in installs), installs
    assert not any("dev" in line or "torch" in line for line in installs), installs

