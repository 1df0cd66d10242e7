"""Split GGUF files (llama.cpp's gguf-split layout, written by gguf-py's ``GGUFWriter(split_max_tensors=...)``:
``<name>-00001-of-0000N.gguf``, ...; the first part holds the metadata, every part ``split.no``, ``split.count``
and ``split.tensors.count``) built from their first part: the same stages, byte for byte, as the unsplit file
(the same weights written whole), every part memory-mapped; a missing part or a later part given is one error
naming the file, with nothing left in ``-o``."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.conftest import BIN

from .test_architectures import SEQ, chained_logits
from .test_gguf import build, demo_gguf, write_tiny_gguf  # noqa: F401 - demo_gguf is a fixture

pytestmark = pytest.mark.integration

VOCAB = 2048  # the demo tokenizer's first tokens: small files


@pytest.fixture(scope="module")
def files(tmp_path_factory, demo_gguf):  # noqa: F811
    """The tiny model written whole and split in parts of at most 16 tensors (39 tensors: 3 parts)."""
    root = tmp_path_factory.mktemp("split")
    write_tiny_gguf(root / "whole.gguf", demo_gguf, vocab=VOCAB)
    write_tiny_gguf(root / "tiny.gguf", demo_gguf, vocab=VOCAB, split_max_tensors=16)
    parts = sorted(root.glob("tiny-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"tiny-{i:05d}-of-00003.gguf" for i in range(1, 4)]
    return root / "whole.gguf", parts


def mapped(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a file's memory map (an ``mmap.mmap`` down its chain of bases)."""
    import mmap

    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_a_split_file_builds_what_the_whole_file_builds(files, tmp_path):
    from compiler.gguf import SplitReader, open_reader

    whole, parts = files
    reader = open_reader(parts[0])
    assert isinstance(reader, SplitReader) and reader.parts == tuple(parts)
    assert len(reader.tensors) == len(open_reader(whole).tensors)
    assert all(mapped(t.data) for t in reader.tensors)  # views into each part's map: read lazily
    one = build(whole, tmp_path / "whole", "--layers", "0:1,1:3,3:4")
    split = build(parts[0], tmp_path / "split", "--layers", "0:1,1:3,3:4")
    assert split["model_id"] == "tiny" and one["model_id"] == "whole"
    assert split["files"] == one["files"]  # sha256 of every stage's .xml/.bin and tokenizer file
    ids = np.random.default_rng(0).integers(0, VOCAB, SEQ)
    garbage = np.random.default_rng(1).integers(0, VOCAB, 16)
    np.testing.assert_array_equal(chained_logits(tmp_path / "split", ids, garbage),
                                  chained_logits(tmp_path / "whole", ids, garbage))


def refused(src, out) -> str:  # noqa: ANN001
    result = subprocess.run([str(BIN / "fleet-compiler"), "build", str(src), "-o", str(out)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))
    return next(line for line in result.stderr.splitlines() if line.startswith("fleet-compiler: error:"))


def test_a_missing_part_or_a_later_part_is_refused_by_name(files, tmp_path):
    _, parts = files
    for part in parts:
        (tmp_path / part.name).symlink_to(part)
    assert f"give the first part, {tmp_path / parts[0].name}" in refused(tmp_path / parts[-1].name, tmp_path / "out")
    (tmp_path / parts[1].name).unlink()
    line = refused(tmp_path / parts[0].name, tmp_path / "out")
    assert "part 1 of a 3-part split GGUF; missing part(s): " + str(tmp_path / parts[1].name) in line, line
