"""Blob keys and their place in the manifest (fleet_common/blobs.py, compiler/precompile.py); the
import itself is tested with real workers in tests/integration/test_blobs.py."""

import hashlib
import json
from dataclasses import replace

import openvino as ov

from compiler.precompile import record_blobs
from fleet_common.blobs import BlobKey, blob_name, device_identity
from fleet_common.manifest import (
    Architecture,
    BlobEntry,
    Manifest,
    StageEntry,
    build_identity,
    load_manifest,
    sha256_file,
)

KEY = BlobKey(ir="ab" * 32, device="CPU", openvino_version="2026.4.1-1-x",
              identity={"FULL_DEVICE_NAME": "Some CPU", "isa": "avx avx2"},
              config={"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "KV_CACHE_PRECISION": "f16"})


def make(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"weights")
    m = Manifest(model_id="m", architecture=Architecture("llama", 4, 8, 2, 1, 4, 10, 64),
                 stages=(StageEntry(0, 0, 2, "a.xml", "a.bin"), StageEntry(1, 2, 4, "b.xml", "b.bin")),
                 openvino_version="x", protocol_version=1, weights="fp16", kv_cache_precision="f16",
                 eos_token_ids=(2,), files={"a.bin": sha256_file(tmp_path / "a.bin")})
    (tmp_path / "manifest.json").write_text(m.to_json())
    return m


def test_blobs_are_recorded_without_changing_the_build_identity(tmp_path):
    m = make(tmp_path)
    data = (tmp_path / "manifest.json").read_bytes()
    assert "blobs" not in json.loads(data)  # a build without blobs is written as before blobs existed
    before = load_manifest(tmp_path).sha256
    assert before == hashlib.sha256(data).hexdigest() == build_identity(data)

    raw = json.loads(data)
    raw["field_of_a_newer_fleet"] = {"kept": True}
    (tmp_path / "manifest.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    newer = load_manifest(tmp_path).sha256
    entry = BlobEntry(stage=1, file="b.cpu-1.blob", sha256="0" * 64, key=KEY.to_dict())
    record_blobs(tmp_path, [entry])
    record_blobs(tmp_path, [replace(entry, sha256="1" * 64)])  # same stage and key: replaced, not added
    other = BlobEntry(stage=1, file="b.cpu-2.blob", sha256="2" * 64, key=replace(KEY, device="GPU").to_dict())
    record_blobs(tmp_path, [other])

    loaded = load_manifest(tmp_path)
    assert loaded.manifest.blobs == (replace(entry, sha256="1" * 64), other)
    assert loaded.manifest.stages == m.stages
    assert json.loads((tmp_path / "manifest.json").read_text())["field_of_a_newer_fleet"] == {"kept": True}
    assert loaded.sha256 == newer != before  # blobs do not count; other fields do


def test_key_mismatch_says_what_differs():
    assert KEY.mismatch(KEY) is None
    assert BlobKey.from_dict(KEY.to_dict()) == KEY
    assert KEY.mismatch(replace(KEY, openvino_version="2026.5.0-2-y")) == \
        "is for OpenVINO 2026.4.1-1-x, this is 2026.5.0-2-y"
    assert KEY.mismatch(replace(KEY, ir="cd" * 32)) == "was compiled from another IR of this stage"
    assert KEY.mismatch(replace(KEY, device="GPU")) == "is for device CPU, this worker runs on GPU"
    here = replace(KEY, identity={**KEY.identity, "isa": "avx avx2 avx512f"})
    assert KEY.mismatch(here) == "was compiled on another CPU: isa 'avx avx2' in the blob, 'avx avx2 avx512f' here"
    f32 = replace(KEY, config={**KEY.config, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    assert f32.mismatch(KEY) == ("was compiled with other settings: INFERENCE_PRECISION_HINT 'f32' in the blob, "
                                 "unset here; KV_CACHE_PRECISION 'f32' in the blob, 'f16' here")
    assert BlobKey.from_dict({}).mismatch(KEY)  # an entry without a key never matches
    assert blob_name("stage_1/openvino_model.xml", KEY) == f"stage_1/openvino_model.cpu-{KEY.digest()}.blob"
    assert KEY.digest() != replace(KEY, config={}).digest()


def test_cpu_identity():
    identity = device_identity(ov.Core(), "CPU")
    assert identity["FULL_DEVICE_NAME"] and "EXPORT_IMPORT" in identity["OPTIMIZATION_CAPABILITIES"]
    assert "isa" in identity and identity == device_identity(ov.Core(), "CPU")
