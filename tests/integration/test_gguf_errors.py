"""Bad GGUF files: one clear error naming the file and the field, exit 2, nothing left in ``-o``; a
quant type the builder does not keep is dequantized with a warning that names it."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.conftest import BIN

from .test_gguf import demo_gguf, write_tiny_gguf  # noqa: F401 - demo_gguf is a fixture

pytestmark = pytest.mark.integration


def build(src, out):  # noqa: ANN001, ANN201
    return subprocess.run([str(BIN / "fleet-compiler"), "build", str(src), "--shards", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)


def assert_refused(result, out, *words: str) -> None:  # noqa: ANN001
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = next(ln for ln in result.stderr.splitlines() if ln.startswith("fleet-compiler: error:"))
    for word in words:
        assert word in line, line
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def _rewrite(src, dst, arch: str = "llama", pre: str = "smollm", ternary: bool = False) -> None:  # noqa: ANN001
    """The tiny GGUF with another architecture, pre-tokenizer or TQ2_0 ``ffn_down`` matrices (layers 0 and 1; a
    type the builder dequantizes, as it does every IQ and TQ type)."""
    from .test_gguf import KINDS

    write_tiny_gguf(dst, src, arch=arch, pre=pre, kinds={**KINDS, "ffn_down": "TQ2_0"} if ternary else None)


def test_truncated_gguf_is_refused(demo_gguf, tmp_path):  # noqa: F811
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_gguf)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert_refused(build(cut, tmp_path / "out"), tmp_path / "out", "cut.gguf", "truncated or corrupt")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_refused(build(garbage, tmp_path / "out"), tmp_path / "out", "garbage.gguf")


def test_unknown_architecture_and_pre_tokenizer_are_refused_by_name(demo_gguf, tmp_path):  # noqa: F811
    falcon = tmp_path / "falcon.gguf"
    _rewrite(demo_gguf, falcon, arch="falcon")
    assert_refused(build(falcon, tmp_path / "out"), tmp_path / "out", "falcon.gguf", "'falcon'", "not supported")
    jais = tmp_path / "jais-tokenizer.gguf"  # a llama.cpp pre-tokenizer fleet does not rebuild
    _rewrite(demo_gguf, jais, pre="jais")
    assert_refused(build(jais, tmp_path / "out"), tmp_path / "out", "jais-tokenizer.gguf", "tokenizer.ggml.pre='jais'")


def test_a_type_not_kept_is_dequantized_with_a_warning(demo_gguf, tmp_path):  # noqa: F811
    path = tmp_path / "tq2.gguf"
    _rewrite(demo_gguf, path, ternary=True)
    result = build(path, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TQ2_0 tensor(s)" in result.stderr and "dequantized and stored as fp16" in result.stderr, result.stderr
