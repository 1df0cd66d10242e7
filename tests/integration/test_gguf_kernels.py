"""A GGUF's CPU stages run on fleet's own kernels (fleet_common/kernels.py ``GgufMatMul``), its GPU/NPU stages on
OpenVINO's forms, and every reader of a stage knows which: the demo's Q4_1 GGUF built with a plan's devices
(stage 0 on the CPU, stage 1 on a GPU) in this process.

* the CPU stage's matrices are the file's bytes (``gguf_bytes.py`` hashes them), the GPU stage has no kernels' op
  and keeps OpenVINO's compressed pattern; the manifest (format 4) names the kernels' version of the CPU stage only;
* ``--inference-precision f32`` (``compile_ir``) runs every ``GgufMatMul`` at precision f32: bit for bit the IR
  whose nodes were written so, and not what the default int8 precision gives;
* a real ``fleet-worker`` refuses a stage needing another version of the kernels with one line saying what to
  do, and ``load_shard`` one needing kernels this install lacks with the install hint;
* a blob key of the CPU stage carries the kernels' version, and a blob of another version is not imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from bench.harness import repo_env
from tests.conftest import BIN, ROOT

from .gguf_bytes import assert_constants_are_gguf_bytes, kernel_constants
from .test_gguf import demo_gguf  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cpu_gpu_build(demo_gguf, tmp_path_factory):  # noqa: F811 - demo_gguf is a fixture
    """The demo GGUF as 2 stages planned for the CPU and a GPU (``build(devices=...)``, what ``build --plan``
    passes), and the GGUF's path."""
    from compiler.build import build

    out = tmp_path_factory.mktemp("kernels") / "build"
    build(demo_gguf, out, layers="0:20,20:30", devices=("CPU", "GPU"))
    return out, demo_gguf


def test_cpu_stage_holds_the_gguf_bytes_and_the_gpu_stage_openvino_forms(cpu_gpu_build, tmp_path):
    from fleet_common.kernels import KERNELS_VERSION
    from fleet_common.manifest import KERNELS_FORMAT, load_manifest

    out, gguf_path = cpu_gpu_build
    manifest = load_manifest(out).manifest
    assert manifest.format == KERNELS_FORMAT
    assert [s.kernels for s in manifest.stages] == [KERNELS_VERSION, None]
    assert all(s.weights == "gguf" for s in manifest.stages)
    # 20 layers x (q, k, v, o, gate, up, down) on stage 0, each the file's bytes; stage 1 none (checked inside)
    assert assert_constants_are_gguf_bytes(out, gguf_path, tmp_path / "work") == 7 * 20
    assert not kernel_constants(out / manifest.stages[1].xml)
    gpu_xml = (out / manifest.stages[1].xml).read_text()
    assert "GgufMatMul" not in gpu_xml and 'element_type="u4"' in gpu_xml  # Q4_1 as OpenVINO's u4 codes
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["stages"][0]["kernels"] == KERNELS_VERSION and "kernels" not in raw["stages"][1]


def _hidden(compiled, ids: np.ndarray) -> np.ndarray:  # noqa: ANN001 - an ov.CompiledModel
    n = ids.shape[1]
    return compiled.create_infer_request().infer({
        "input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(n)[None],
        "beam_idx": np.zeros(1, np.int32)})["hidden_states"].copy()


def test_f32_runs_every_kernel_exactly(cpu_gpu_build, tmp_path):
    """``compile_ir(inference_precision="f32")`` gives bit for bit what the IR with every ``GgufMatMul`` written
    at precision f32 gives, and differs from the default (int8 activations)."""
    from fleet_common.runtime import compile_ir

    out, _ = cpu_gpu_build
    xml = out / "stage_0" / "openvino_model.xml"
    text = xml.read_text()
    # a layer's q, k, v are one op, gate and up another: 4 products a layer (o and down the others)
    assert text.count('precision="int8"') == 4 * 20 and 'precision="f32"' not in text
    exact = tmp_path / "exact.xml"
    exact.write_text(text.replace('precision="int8"', 'precision="f32"'))
    os.link(out / "stage_0" / "openvino_model.bin", tmp_path / "exact.bin")
    ids = np.random.default_rng(5).integers(0, 49152, (1, 12))
    ours = _hidden(compile_ir(xml, threads=1, inference_precision="f32")[0], ids)
    written = _hidden(compile_ir(exact, threads=1, inference_precision="f32")[0], ids)
    default = _hidden(compile_ir(xml, threads=1, compressed=True)[0], ids)
    assert np.array_equal(ours, written)
    assert not np.array_equal(ours, default)
    print(f"f32 against int8 activations: max |diff| {np.abs(ours - default).max():.3g}")


def _with_stage_kernels(out, dest, version: str):  # noqa: ANN001, ANN202
    """A copy of build ``out`` (hard links) whose manifest says stage 0 needs kernels ``version``."""
    shutil.copytree(out, dest, copy_function=os.link)
    path = dest / "manifest.json"
    path.unlink()  # a fresh file, not the hard link's shared one
    raw = json.loads((out / "manifest.json").read_text())
    raw["stages"][0]["kernels"] = version
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return dest


def test_a_worker_refuses_a_stage_of_other_kernels(cpu_gpu_build, tmp_path):
    out, _ = cpu_gpu_build
    other = _with_stage_kernels(out, tmp_path / "other", "999")
    result = subprocess.run([str(BIN / "fleet-worker"), "--model", str(other), "--shard", "0", "--port", "0",
                             "--threads", "1"], capture_output=True, text=True, timeout=120)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if " ERROR " in line]
    print(errors)
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "stage 0" in errors[0] and "needs fleet's kernels version 999, this fleet has version" in errors[0]


def test_a_stage_needing_kernels_this_install_lacks_is_refused(cpu_gpu_build, tmp_path):
    """Without the library (its path made to miss, in a fresh interpreter that has not loaded it), ``load_shard``
    refuses the CPU stage with one line naming what to install, and loads the GPU-built stage on the CPU."""
    import sys

    from fleet_common.kernels import INSTALL_HINT

    out, _ = cpu_gpu_build
    code = f"""
from pathlib import Path
from fleet_common import kernels
kernels.LIBRARY = Path({str(tmp_path / "missing.so")!r})
from fleet_common.manifest import load_manifest
from worker.loader import load_shard
loaded = load_manifest(Path({str(out)!r}))
load_shard(loaded, 1, threads=1)
print("stage 1 loaded")
try:
    load_shard(loaded, 0, threads=1)
except kernels.KernelsUnavailable as exc:
    print("refused:", exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=repo_env())
    lines = result.stdout.splitlines()
    print(lines)
    assert result.returncode == 0 and lines[0] == "stage 1 loaded", result.stderr[-2000:]
    assert len(lines) == 2 and lines[1].startswith("refused: stage 0 of ") and INSTALL_HINT in lines[1], lines


def test_blob_keys_carry_the_kernels_version(cpu_gpu_build):
    from fleet_common.blobs import BlobKey
    from fleet_common.kernels import KERNELS_VERSION
    from fleet_common.manifest import load_manifest

    manifest = load_manifest(cpu_gpu_build[0]).manifest
    here = BlobKey.here(manifest, 0, "CPU", 1, "auto")
    assert here.identity["fleet_kernels"] == KERNELS_VERSION
    assert "fleet_kernels" not in BlobKey.here(manifest, 1, "CPU", 1, "auto").identity
    older = BlobKey.from_dict(here.to_dict() | {"identity": here.identity | {"fleet_kernels": "0"}})
    reason = older.mismatch(here)
    assert reason is not None and "fleet_kernels '0' in the blob" in reason, reason
