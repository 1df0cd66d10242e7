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


def test_stage_weights_round_trip_and_format_1_builds_still_load(tmp_path):
    """Format 2 records each stage's and draft's weights; a format 1 manifest (before compression
    existed) loads as fp16 throughout; an unknown format is refused with a message that says what to do."""
    import dataclasses
    import json

    m = make(tmp_path)
    int4 = {"mode": "int4_asym", "group_size": 32, "ratio": 1.0}
    m = dataclasses.replace(m, weights="mixed", stages=(dataclasses.replace(m.stages[0], weights="int8",
                                                                            compression={"mode": "int8_asym"}),
                                                        dataclasses.replace(m.stages[1], weights="int4",
                                                                            compression=int4)))
    (tmp_path / "manifest.json").write_text(m.to_json())
    loaded = load_manifest(tmp_path).manifest
    assert loaded == m and loaded.format == 2 and loaded.stages[1].compression == int4

    raw = json.loads(m.to_json())
    raw["format"] = 1
    for stage in raw["stages"]:
        del stage["weights"], stage["compression"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    old = load_manifest(tmp_path).manifest
    assert [s.weights for s in old.stages] == ["fp16", "fp16"] and old.stages[0].compression == {}

    raw["format"] = 5
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="manifest format 5: this fleet reads formats 1, 2, 3, 4; rebuild with "
                                            "this fleet-compiler, or upgrade fleet"):
        load_manifest(tmp_path)


def test_a_stage_names_the_kernels_it_needs(tmp_path):
    """Format 4: a stage holding fleet's kernels' op names their version (``kernels``), written only when it does,
    so a manifest without such stages reads as before."""
    import dataclasses
    import json

    m = make(tmp_path)
    plain = json.loads(m.to_json())
    assert all("kernels" not in s for s in plain["stages"])
    m = dataclasses.replace(m, format=4, stages=(dataclasses.replace(m.stages[0], kernels="1"), m.stages[1]))
    (tmp_path / "manifest.json").write_text(m.to_json())
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["stages"][0]["kernels"] == "1" and "kernels" not in raw["stages"][1]
    loaded = load_manifest(tmp_path).manifest
    assert loaded == m and [s.kernels for s in loaded.stages] == ["1", None]


def test_stage_devices_round_trip_and_cpu_builds_keep_format_2(tmp_path):
    """Format 3 records a stage's planned device; a build whose stages are all on the CPU writes no device
    and stays format 2 (older fleets read it), and reads back as CPU."""
    import dataclasses
    import json

    from fleet_common.manifest import DEVICES_FORMAT, FORMAT_VERSION

    m = make(tmp_path)
    raw = json.loads(m.to_json())
    assert raw["format"] == FORMAT_VERSION == 2 and all("device" not in s for s in raw["stages"])
    assert [s.device for s in load_manifest(tmp_path).manifest.stages] == ["CPU", "CPU"]

    gpu = dataclasses.replace(m, format=DEVICES_FORMAT, stages=(dataclasses.replace(m.stages[0], device="GPU"),
                                                                m.stages[1]))
    (tmp_path / "manifest.json").write_text(gpu.to_json())
    raw = json.loads(gpu.to_json())
    assert raw["stages"][0]["device"] == "GPU" and "device" not in raw["stages"][1]
    assert load_manifest(tmp_path).manifest == gpu
