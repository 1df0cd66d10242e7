import pytest

from fleet_common.manifest import (Architecture, Manifest, ManifestError, StageEntry, load_manifest, sha256_file,
                                   verify_files)


def make(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"weights")
    m = Manifest(model_id="m", architecture=Architecture("llama", 4, 8, 2, 1, 4, 10, 64),
                 stages=(StageEntry(0, 0, 2, "a.xml", "a.bin"), StageEntry(1, 2, 4, "b.xml", "b.bin")),
                 openvino_version="x", protocol_version=1, weights="fp16", kv_cache_precision="f16",
                 eos_token_ids=(2,), files={"a.bin": sha256_file(tmp_path / "a.bin")})
    (tmp_path / "manifest.json").write_text(m.to_json())
    return m


def test_round_trip_and_identity(tmp_path):
    m = make(tmp_path)
    loaded = load_manifest(tmp_path)
    assert loaded.manifest == m
    assert len(loaded.sha256) == 64
    assert m.kv_bytes_per_token(1) == 2 * 2 * 1 * 4 * 4


def test_verify_detects_tampering(tmp_path):
    make(tmp_path)
    loaded = load_manifest(tmp_path)
    assert verify_files(loaded) == []
    (tmp_path / "a.bin").write_bytes(b"other")
    assert "a.bin: sha256" in verify_files(loaded)[0]
    (tmp_path / "a.bin").unlink()
    assert verify_files(loaded) == ["a.bin: missing"]


def test_malformed(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": 1}')
    with pytest.raises(ManifestError, match="malformed"):
        load_manifest(tmp_path)
