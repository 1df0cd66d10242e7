"""``fleet-compiler build`` (the torch-free builder) on bad input: every bad model folder, a full or
unwritable disk, gives ONE clear error line naming the file and the problem, exit code 2, no Python
traceback, and leaves no half-written build behind (neither ``OUT`` nor a hidden ``.OUT.partial-*``
folder beside it); a previous good build in ``OUT`` is left exactly as it was and still passes
``fleet-compiler inspect``. And the success path: a sharded bf16 model builds into 2 stages.

The models are tiny random Llamas made here with transformers (hidden 64, 4 layers, vocab 1000; bf16,
as one ``model.safetensors`` and as 6 shards with an index), shipped with the demo model's
tokenizer.json; each test breaks its own copy. Full disks are real: a small tmpfs the test mounts
(root only; skipped otherwise), filled with a filler file to leave exactly the free space that makes
the build fail at the phase under test (the estimate check, a stage, the tokenizer, the manifest).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.integration.test_compiler import run_cli

pytestmark = pytest.mark.integration

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 4, 2, 1000
PAGE = 4096
ERROR_PREFIX = "fleet-compiler: error: "
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING) \S+: ")  # logging's lines (cli.py's basicConfig format)
SUPPORTED = "llama, mistral, qwen2, qwen3"


# ---------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo_hf) -> SimpleNamespace:
    """The tiny models every test copies: ``llama`` (one bf16 model.safetensors), ``sharded`` (the same
    weights in several files with model.safetensors.index.json) and ``gpt2`` (an unsupported architecture)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-models")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    llama, sharded, gpt2 = root / "tiny-llama", root / "tiny-llama-sharded", root / "tiny-gpt2"
    model.save_pretrained(llama)
    model.save_pretrained(sharded, max_shard_size="100KB")
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64)).save_pretrained(gpt2)
    for folder in (llama, sharded, gpt2):
        shutil.copy(demo_hf / "tokenizer.json", folder / "tokenizer.json")
    assert (llama / "model.safetensors").is_file() and not (llama / "model.safetensors.index.json").exists()
    assert len(_shards(sharded)) >= 3, _shards(sharded)
    return SimpleNamespace(llama=llama, sharded=sharded, gpt2=gpt2)


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))
    return folder


def _edit_header(path: Path, edit) -> None:  # noqa: ANN001
    """Rewrite ``path``'s safetensors JSON header through ``edit(header)``, keeping its length (spaces pad)."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8:8 + length] = text.ljust(length, b" ")
    path.write_bytes(bytes(data))


def _file_of(folder: Path, tensor: str) -> Path:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return folder / json.loads(index.read_text())["weight_map"][tensor]
    return folder / "model.safetensors"


NORM = "model.layers.3.post_attention_layernorm.weight"  # a norm: stored as float16, whatever the build


def _set_weight(folder: Path, tensor: str, value: float, at: tuple[int, ...] = (3, 5)) -> Path:
    """Set one element of ``tensor`` (bf16) in whichever file holds it; returns that file."""
    from safetensors.torch import load_file, save_file

    path = _file_of(folder, tensor)
    tensors = load_file(path)
    tensors[tensor][at] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return path


# --------------------------------------------------------------------------------------------- helpers


def build(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("build", str(src), "-o", str(out), *extra, timeout=180)


def leftovers(out: Path) -> list[str]:
    """What a build of ``out`` may leave beside it: ``.OUT.partial-*`` staging and ``.OUT.old`` folders."""
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refused build (exit 2, no traceback, nothing else on stderr but log lines)."""
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, report
    assert result.returncode == 2, report
    lines = [line for line in result.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), report
    return lines[0][len(ERROR_PREFIX):]


def assert_refused(result: subprocess.CompletedProcess, out: Path, *patterns: str) -> str:
    """``result`` is one clear error matching every regex of ``patterns``, and nothing of ``out`` was written."""
    line = error_line(result)
    for pattern in patterns:
        assert re.search(pattern, line, re.IGNORECASE), f"{pattern!r} not in the error: {line}"
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    assert leftovers(out) == []
    return line


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file of ``folder``: (sha256, mtime_ns, inode), so a rewritten or replaced file shows."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns,
                                         p.stat().st_ino)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def snapshot_hashes(folder: Path) -> dict[str, str]:
    return {name: facts[0] for name, facts in snapshot(folder).items()}


def assert_inspect_ok(out: Path) -> None:
    result = run_cli("inspect", str(out), timeout=180)
    assert result.returncode == 0 and "inspect: OK" in result.stdout, result.stdout + result.stderr


def q(path: Path | str) -> str:
    """``path`` as a regex matching it literally."""
    return re.escape(str(path))


# ------------------------------------------------------------------------------------ corrupt weights


@pytest.mark.parametrize("cut", ["half", "after-header", "in-header", "empty"])
def test_truncated_safetensors_is_refused(cut, models, tmp_path):
    src = _copy(models.llama, tmp_path / "src")
    path = src / "model.safetensors"
    size = path.stat().st_size
    (header_length,) = struct.unpack("<Q", path.read_bytes()[:8])
    keep = {"half": size // 2, "after-header": 8 + header_length, "in-header": 8 + header_length // 2, "empty": 0}[cut]
    os.truncate(path, keep)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(path), "truncated")


@pytest.mark.parametrize("damage", ["garbage-in-header", "text-in-header", "random-bytes", "bad-offsets"])
def test_corrupt_safetensors_is_refused(damage, models, tmp_path):
    src = _copy(models.llama, tmp_path / "src")
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "garbage-in-header":
        data[8:72] = b"\xff" * 64
    elif damage == "text-in-header":
        data[8:72] = b"#" * 64
    elif damage == "random-bytes":
        data = bytearray(np.random.default_rng(0).bytes(len(data)))
    path.write_bytes(bytes(data))
    if damage == "bad-offsets":  # valid JSON, but one tensor's bytes no longer match its shape

        def shorten(header: dict) -> None:
            header["model.layers.1.self_attn.q_proj.weight"]["data_offsets"][1] -= 2

        _edit_header(path, shorten)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(path), "corrupt")


def test_unsupported_dtype_is_refused(models, tmp_path):
    """An f64 tensor (safetensors allows it; the builder reads bf16, f16 and f32) names the tensor and dtype."""
    from safetensors.torch import load_file, save_file

    src = _copy(models.llama, tmp_path / "src")
    path = src / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()
    save_file(tensors, path, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(path), r"model\.norm\.weight", "F64")


# ------------------------------------------------------------------------------------------ sharded index


def test_index_with_a_missing_shard_is_refused(models, tmp_path):
    src = _copy(models.sharded, tmp_path / "src")
    missing = _shards(src)[2]
    (src / missing).unlink()
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src / "model.safetensors.index.json"), re.escape(missing))


def test_truncated_shard_is_refused(models, tmp_path):
    src = _copy(models.sharded, tmp_path / "src")
    shard = src / _shards(src)[3]
    os.truncate(shard, shard.stat().st_size // 2)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(shard), "truncated")


@pytest.mark.parametrize("index", ["not-json", "weight-map-a-list", "a-list"])
def test_malformed_index_is_refused(index, models, tmp_path, request):
    src = _copy(models.sharded, tmp_path / "src")
    path = src / "model.safetensors.index.json"
    texts = {"not-json": '{"weight_map": ', "weight-map-a-list": '{"weight_map": []}', "a-list": "[1, 2]"}
    path.write_text(texts[index])
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(path), "index")


def test_index_naming_the_wrong_file_is_refused(models, tmp_path):
    src = _copy(models.sharded, tmp_path / "src")
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    tensor = "model.layers.0.mlp.up_proj.weight"
    wrong = next(f for f in _shards(src) if f != index["weight_map"][tensor])
    index["weight_map"][tensor] = wrong
    path.write_text(json.dumps(index, indent=2))
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(path), re.escape(tensor), re.escape(wrong))


def test_tensor_duplicated_in_another_shard_is_read_from_the_indexed_file(models, tmp_path):
    """Refused, or built from the file the index names (bit-identical to the clean sharded build)."""
    from safetensors.torch import load_file, save_file

    src = _copy(models.sharded, tmp_path / "src")
    tensor = "model.layers.0.mlp.up_proj.weight"
    home = _file_of(src, tensor).name
    other = src / next(f for f in reversed(_shards(src)) if f != home)  # read after ``home``: it would win
    tensors = load_file(other)
    tensors[tensor] = load_file(src / home)[tensor] * 0 + 1
    save_file(tensors, other, metadata={"format": "pt"})
    out, clean = tmp_path / "out", tmp_path / "clean"
    result = build(src, out)
    if result.returncode != 0:
        assert_refused(result, out, re.escape(tensor))
        return
    assert build(models.sharded, clean).returncode == 0
    assert snapshot_hashes(out / "stage_0") == snapshot_hashes(clean / "stage_0")


# ---------------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize(("changes", "tensor"), [
    ({"hidden_size": 32}, r"model\.embed_tokens\.weight"),
    ({"hidden_size": 128}, r"model\.embed_tokens\.weight"),
    ({"num_hidden_layers": 6}, r"model\.layers\.4\."),
    ({"intermediate_size": 96}, r"model\.layers\.0\.mlp\.gate_proj\.weight"),
    ({"vocab_size": 1200}, r"model\.embed_tokens\.weight"),
    ({"num_key_value_heads": 4}, r"model\.layers\.0\.self_attn\.k_proj\.weight"),
], ids=["hidden-32", "hidden-128", "layers-6", "intermediate-96", "vocab-1200", "kv-heads-4"])
def test_config_not_matching_the_weights_is_refused(changes, tensor, models, tmp_path):
    src = _edit_config(_copy(models.llama, tmp_path / "src"), **changes)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src / "config.json"), tensor, "match|missing")


@pytest.mark.parametrize("changes", [{"hidden_size": 32}, {"num_hidden_layers": 6}], ids=["hidden-32", "layers-6"])
def test_sharded_config_not_matching_the_weights_is_refused(changes, models, tmp_path):
    """The same check over an index: the error names the config and a shard or the tensor."""
    src = _edit_config(_copy(models.sharded, tmp_path / "src"), **changes)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src / "config.json"), r"model-\d+-of-\d+\.safetensors|missing")


def test_config_with_fewer_layers_than_the_weights_is_refused(models, tmp_path):
    src = _edit_config(_copy(models.llama, tmp_path / "src"), num_hidden_layers=2)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src / "config.json"), r"model\.layers\.[23]\.|layers")


# ------------------------------------------------------------------------------ unsupported architecture


def test_unsupported_architecture_is_refused_before_any_weight(models, tmp_path):
    """A real tiny GPT-2, its weights file replaced by garbage: the error is the architecture's (the
    weights were never opened), with the supported list."""
    src = _copy(models.gpt2, tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"\xff" * 1000)
    out = tmp_path / "out"
    line = assert_refused(build(src, out), out, q(src / "config.json"), "'gpt2'", "GPT2LMHeadModel", "not supported",
                          re.escape(SUPPORTED))
    assert "safetensors" not in line


def test_config_only_gpt_neox_is_refused(tmp_path):
    """No weights and no tokenizer at all: still the architecture error, not a missing file's."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
                                                 "hidden_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "intermediate_size": 256,
                                                 "vocab_size": 1000}))
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src / "config.json"), "'gpt_neox'", "not supported", re.escape(SUPPORTED))


@pytest.mark.parametrize(("changes", "patterns"), [
    ({"vision_config": {"hidden_size": 32, "num_hidden_layers": 2}}, ("a vision tower", "'vision_config'")),
    ({"layer_types": ["linear_attention", "full_attention"]}, ("'linear_attention'", "gated delta net")),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     ("rope scaling 'yarn' is not supported", "longrope")),
], ids=["vision-tower", "gated-delta-net", "yarn-rope"])
def test_part_the_builder_does_not_make_is_refused_by_name(changes, patterns, models, tmp_path):
    """The tiny llama with a vision tower, Qwen3.5's linear-attention layers or a rope type fleet does not model
    in its config: one error line naming the file and what is missing, before any weight is read."""
    src = _edit_config(_copy(models.llama, tmp_path / "src"), **changes)
    (src / "model.safetensors").write_bytes(b"\xff" * 1000)
    out = tmp_path / "out"
    line = assert_refused(build(src, out), out, q(src / "config.json"), *patterns)
    assert "safetensors" not in line


# ---------------------------------------------------------------------------------- bf16 out of range


@pytest.mark.parametrize(("layout", "value"), [("single", 1e6), ("single", -7e4), ("single", float("inf")),
                                               ("single", float("nan")), ("sharded", 1e6)],
                         ids=["1e6", "-7e4", "inf", "nan", "sharded-1e6"])
def test_bf16_value_beyond_float16_is_refused(layout, value, models, tmp_path):
    """The tensor, a norm (stored as float16), sits in layer 3, the last stage's: stage 0 is written whole before
    the refusal."""
    src = _copy(getattr(models, "llama" if layout == "single" else "sharded"), tmp_path / "src")
    path = _set_weight(src, NORM, value, at=(5,))
    out = tmp_path / "out"
    assert_refused(build(src, out), out, re.escape(path.name), re.escape(NORM), "float16")


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_bf16_matrix_holding_inf_or_nan_is_refused(value, models, tmp_path):
    """A matrix fleet's kernels read as stored (bf16) may hold any finite bf16 value, not inf or NaN."""
    src = _copy(models.llama, tmp_path / "src")
    tensor = "model.layers.3.mlp.down_proj.weight"
    path = _set_weight(src, tensor, value)
    out = tmp_path / "out"
    assert_refused(build(src, out), out, re.escape(path.name), re.escape(tensor), "inf or NaN")


def test_bf16_matrix_beyond_float16_builds_as_stored(models, tmp_path):
    """1e6 in a bf16 matrix is a bf16 value like any other: a CPU build keeps the matrix's bytes for fleet's
    kernels, so it builds."""
    src = _copy(models.llama, tmp_path / "src")
    _set_weight(src, "model.layers.3.mlp.down_proj.weight", 1e6)
    result = build(src, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-2000:]


def test_missing_tokenizer_is_refused(models, tmp_path):
    src = _copy(models.llama, tmp_path / "src")
    (src / "tokenizer.json").unlink()
    out = tmp_path / "out"
    assert_refused(build(src, out), out, q(src), "tokenizer.json")


# ---------------------------------------------------------------------------------------- disk space


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mount_tmpfs(mnt: Path, *options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command")
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=16m", *options)), "tmpfs", str(mnt)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


def _unmount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):  # noqa: ANN201
    """A 16 MiB tmpfs (a tiny build with the demo tokenizer takes ~4.4 MB), unmounted after the test."""
    mnt = tmp_path / "fs"
    _mount_tmpfs(mnt)
    try:
        yield mnt
    finally:
        _unmount(mnt)


def fill(fs: Path, free: int) -> None:
    """Leave exactly ``free`` bytes (whole pages) free on ``fs``, with a filler file ``fs/fill``."""
    free = -(-free // PAGE) * PAGE
    size = _free(fs) - free
    assert size >= 0, (size, free)
    with open(fs / "fill", "ab") as fh:
        fh.write(b"\0" * size)  # written, not sparse: tmpfs counts the pages
    assert _free(fs) == free


@pytest.fixture(scope="module")
def sizes(tmp_path_factory, models) -> SimpleNamespace:
    """What a good 2-stage build of ``models.llama`` takes on a tmpfs, phase by phase (built once there)."""
    from compiler.arch import ModelConfig
    from compiler.build import estimated_bytes, stage_ranges

    fs = tmp_path_factory.mktemp("measure") / "fs"
    _mount_tmpfs(fs)
    try:
        before, probe = _free(fs), fs / "probe"
        result = build(models.llama, probe)
        assert result.returncode == 0, result.stderr
        cfg = ModelConfig.from_folder(models.llama)
        return SimpleNamespace(
            total=before - _free(fs),
            stages=sum(p.stat().st_blocks * 512 for p in probe.glob("stage_*/*")),
            manifest=(probe / "manifest.json").stat().st_size,
            estimate=estimated_bytes(cfg, stage_ranges(cfg, 2, None), 0))
    finally:
        _unmount(fs)


def free_for(phase: str, sizes: SimpleNamespace) -> int:
    """Free bytes that let a build pass every phase before ``phase`` and fail in it."""
    if phase == "estimate":  # less than the builder's own estimate: refused before writing anything
        return 16 * 1024
    if phase == "stage":  # the estimate check passes, the stage files (weights + XML) do not fit
        free = -(-sizes.estimate // PAGE) * PAGE + PAGE
        assert sizes.estimate <= free < sizes.stages, vars(sizes)
        return free
    if phase == "tokenizer":  # the stages fit, the 3.5 MB tokenizer.json does not
        return sizes.stages + 16 * PAGE
    assert phase == "manifest" and sizes.manifest <= PAGE  # everything but the manifest's one page
    return sizes.total - PAGE


DISK_PHASES = [
    "estimate",
    "stage",
    "tokenizer",
    "manifest",
]


@pytest.mark.parametrize("phase", DISK_PHASES)
def test_full_disk_is_refused_and_leaves_nothing(phase, sizes, small_fs, models):
    fill(small_fs, free_for(phase, sizes))
    out = small_fs / "out"
    assert_refused(build(models.llama, out), out, r"disk full|no space left|free", q(small_fs))
    assert sorted(p.name for p in small_fs.iterdir()) == ["fill"]


def test_disk_estimate_message_shows_the_shortfall(sizes, small_fs, models):
    fill(small_fs, free_for("estimate", sizes))
    out = small_fs / "out"
    line = assert_refused(build(models.llama, out), out, "free")
    m = re.search(r"has ([\d.]+) (\w+) free, the build needs about ([\d.]+) (\w+)", line)
    assert m, line
    assert (m.group(1), m.group(2)) != (m.group(3), m.group(4)), line


def test_bad_weight_on_a_small_disk_is_not_called_disk_full(small_fs, models, tmp_path):
    """compiler/save.py's disk_errors reads errors under 64 MiB free as a full disk: a weights error
    raised while a stage is written there must still say what it is."""
    src = _copy(models.llama, tmp_path / "src")
    _set_weight(src, NORM, 1e6, at=(5,))
    out = small_fs / "out"
    line = assert_refused(build(src, out), out, re.escape(NORM), "float16")
    assert "disk full" not in line
    assert list(small_fs.iterdir()) == []


def test_read_only_output_folder_is_refused(models, tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "ro")
    try:
        out = mnt / "out"
        assert_refused(build(models.llama, out), out, q(mnt), "read-only|permission|writ")
    finally:
        _unmount(mnt)


@pytest.mark.parametrize("where", ["out-is-a-file", "out-under-a-file"])
def test_output_path_through_a_file_is_refused(where, models, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder\n")
    out = blocker if where == "out-is-a-file" else blocker / "out"
    result = build(models.llama, out)
    error_line(result)
    assert blocker.read_text() == "not a folder\n"
    assert leftovers(blocker) == []


# --------------------------------------------------------------------------------- previous build kept


KEEP_CASES = ["truncated", "config-mismatch", "bf16-overflow-last-stage", "missing-tokenizer", "unsupported",
              "disk-full-stage", "disk-full-tokenizer", "disk-full-manifest"]


@pytest.mark.parametrize("case", KEEP_CASES)
def test_failed_build_keeps_the_previous_build(case, models, tmp_path, request):
    """A good build in OUT, then a failing build into the same OUT: OUT holds the old build, every file
    the same one (content, mtime, inode), nothing beside it, and inspect passes."""
    disk = case.startswith("disk-full-")
    parent = request.getfixturevalue("small_fs") if disk else tmp_path / "builds"
    out = parent / "out"
    sizes = request.getfixturevalue("sizes") if disk else None
    good = build(models.llama, out)
    assert good.returncode == 0, good.stderr
    before = snapshot(out)
    src = _copy(models.llama, tmp_path / "src")
    if case == "truncated":
        os.truncate(src / "model.safetensors", (src / "model.safetensors").stat().st_size // 2)
    elif case == "config-mismatch":
        _edit_config(src, intermediate_size=96)
    elif case == "bf16-overflow-last-stage":
        _set_weight(src, NORM, 1e6, at=(5,))
    elif case == "missing-tokenizer":
        (src / "tokenizer.json").unlink()
    elif case == "unsupported":
        _edit_config(src, model_type="gpt_neox")
    else:
        fill(parent, free_for(case.removeprefix("disk-full-"), sizes))
    bad = build(src, out)
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert snapshot(out) == before
    assert leftovers(out) == []
    assert sorted(p.name for p in parent.iterdir()) == (["fill", "out"] if disk else ["out"])
    assert_inspect_ok(out)


# --------------------------------------------------------------------------------------- success path


def test_sharded_bf16_model_builds_into_two_stages(models, tmp_path):
    """Several safetensors files with an index, bf16: 2 stages, inspect passes, and each stage is
    bit-identical to the build of the same weights from one file."""
    out, single = tmp_path / "out", tmp_path / "single"
    result = build(models.sharded, out, "--shards", "2")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert leftovers(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    stages = manifest["stages"]
    assert len(stages) == 2 and stages[0]["start"] == 0 and stages[0]["end"] == stages[1]["start"]
    assert stages[1]["end"] == LAYERS and manifest["architecture"]["num_layers"] == LAYERS
    assert manifest["weights"] == "fp16" and {"tokenizer.json", "config.json"} <= set(manifest["files"])
    assert_inspect_ok(out)
    assert build(models.llama, single, "--shards", "2").returncode == 0
    for stage in stages:
        for key in ("xml", "bin"):
            assert manifest["files"][stage[key]] == json.loads((single / "manifest.json").read_text())["files"][
                stage[key]], stage[key]
