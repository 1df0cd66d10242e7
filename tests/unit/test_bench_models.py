"""bench/models.py: what a bench's --model PATH names (GGUF, HF folder, fleet build, or a clear error), the
cache key of the builds it makes (bench/harness.py), and one real tiny build through fleet-compiler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import harness, models
from bench.pipeline.interleave_bench import parse_args
from fleet_common.manifest import Architecture, Manifest, StageEntry

from .test_compile_deps import tiny_llama


def fake_build(folder: Path, ranges: list[tuple[int, int]], drafts: tuple = ()) -> Path:
    """A folder with only a manifest.json of ``ranges`` (no weights): enough to resolve and check."""
    folder.mkdir(parents=True)
    stages = tuple(StageEntry(i, a, b, f"stage_{i}/m.xml", f"stage_{i}/m.bin") for i, (a, b) in enumerate(ranges))
    m = Manifest(model_id="m", architecture=Architecture("llama", ranges[-1][1], 2048, 32, 8, 64, 49152, 4096),
                 stages=stages, openvino_version="x", protocol_version=1, weights="fp16", kv_cache_precision="f16",
                 eos_token_ids=(2,), drafts=drafts)
    (folder / "manifest.json").write_text(m.to_json())
    return folder


def test_each_kind_is_recognised(tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 12)
    blob = tmp_path / "sha256-abc"  # an Ollama blob: GGUF magic, no suffix
    blob.write_bytes(b"GGUF" + b"\0" * 12)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    build = fake_build(tmp_path / "build", [(0, 10), (10, 16)])
    assert [(m.kind, m.name) for m in map(models.resolve, (gguf, blob, hf, build))] == [
        ("gguf", "m.Q4_0"), ("gguf", "sha256-abc"), ("hf", "hf"), ("build", "build")]
    assert models.resolve(build).stages == 2 and models.resolve(hf).stages is None
    assert models.architecture(build).vocab_size == 49152 and models.even_split(build) == "0:8,8:16"


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.gguf", "no such file or folder"),
    (lambda p: p, "neither manifest.json nor config.json"),
    (lambda p: (p / "x.gguf").write_text("not a gguf") and p / "x.gguf", "not a GGUF file"),
])
def test_nonsense_paths_are_clear_errors(tmp_path: Path, make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(models.ModelError, match=message) as exc:
        models.resolve(make(tmp_path))
    assert "give a .gguf file, a Hugging Face model folder" in str(exc.value)


def test_the_option_refuses_nonsense_with_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert f"argument --model: {tmp_path / 'nope'}: no such file or folder" in capsys.readouterr().err


def test_a_build_has_its_own_stage_count_and_drafts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = models.resolve(fake_build(tmp_path / "b", [(0, 10), (10, 16)]))
    assert models.stage_counts(build, None, [1, 2, 3]) == [2] and models.stage_counts(build, [3], [1]) == [3]
    assert models.builds(build, tmp_path, [2], optional=(1,)) == {2: build.path}  # no 1-stage: left out
    with pytest.raises(models.ModelError, match=r"fleet build of 2 stage\(s\), and this bench asks for 3: give "
                                                r"--stages 2"):
        models.builds(build, tmp_path, [2, 3])
    with pytest.raises(models.ModelError, match=r"no self-int8 draft \(it has: none\)"):
        models.check_stages(build, [2], ("self-int8",))
    with pytest.raises(SystemExit):
        parse_args(["--model", str(build.path), "--stages", "1,2"])
    assert "asks for 1" in capsys.readouterr().err
    assert parse_args(["--model", str(build.path)]).stages == [2]


def test_llama_cpp_needs_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(models.ModelError, match="needs --model to be a GGUF file"):
        models.require_gguf(models.resolve(hf), "the llama.cpp comparison")
    for path in (hf, fake_build(tmp_path / "b", [(0, 4)])):
        with pytest.raises(SystemExit):
            parse_args(["--llama-cpp", "--model", str(path)])
        assert "--llama-cpp needs --model to be a GGUF file" in capsys.readouterr().err


def test_the_cache_key_follows_the_source_and_the_options(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for p in (a, b):
        p.write_bytes(b"GGUF" + b"\0" * 12)
    one = harness.build_dir(a, tmp_path, 2)
    assert one == harness.build_dir(a, tmp_path, 2) and one.name.startswith("a-2stage-")
    assert len({one, harness.build_dir(b, tmp_path, 2), harness.build_dir(a, tmp_path, 1),
                harness.build_dir(a, tmp_path, 2, "0:1,1:2"),
                harness.build_dir(a, tmp_path, 2, drafts=("self-int8",))}) == 5
    a.write_bytes(b"GGUF" + b"\1" * 20)  # the file changed
    assert harness.build_dir(a, tmp_path, 2) != one


def test_a_real_tiny_build_is_made_once_and_then_used_as_a_build(tmp_path: Path) -> None:
    src = models.resolve(tiny_llama(tmp_path / "tiny"))
    cache = tmp_path / "cache"
    built = models.builds(src, cache, [1])
    assert list(built) == [1] and built[1] == harness.build_dir(src.path, cache, 1)
    manifest = built[1] / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    assert models.builds(src, cache, [1]) == built and manifest.stat().st_mtime_ns == stamp  # cached
    assert json.loads(manifest.read_text())["stages"][0]["end"] == 2
    again = models.resolve(built[1])
    assert again.kind == "build" and models.builds(again, cache, [1]) == {1: built[1]}
