"""fleet_common/segments.py and StageCache.reuse (issue 30): a stage's .bin tiled by its IR's Const ranges, and a
new file built on a worker from the segments of files it holds, each copied segment hashed again."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from fleet_common.manifest import Architecture, LoadedManifest, Manifest, StageEntry, build_identity
from fleet_common.segments import Segment, file_segments, hash_segments, ir_segments
from worker.stage_cache import SEGMENTS_DIR, StageCache, StageCacheError


def ir_xml(consts: list[tuple[int, int]]) -> str:
    layers = "".join(f'<layer id="{i}" name="c{i}" type="Const" version="opset1"><data element_type="u8" '
                     f'shape="{n}" offset="{o}" size="{n}"/></layer>' for i, (o, n) in enumerate(consts))
    return f'<?xml version="1.0"?><net name="m" version="11"><layers>{layers}' \
           '<layer id="99" name="p" type="Parameter" version="opset1"><data shape="1" element_type="f32"/></layer>' \
           "</layers></net>"


def test_const_ranges_tile_the_bin_with_gaps_overlaps_and_shared_data():
    consts = [(0, 10), (10, 5), (10, 5), (20, 10), (25, 10), (40, 2)]  # (10, 5) twice: two Consts of one blob
    assert ir_segments(ir_xml(consts), 50) == [(0, 10), (10, 5), (15, 5), (20, 15), (35, 5), (40, 2), (42, 8)]
    assert ir_segments(ir_xml([]), 7) == [(0, 7)]


@pytest.mark.parametrize("bad", [ir_xml([(0, 60)]), ir_xml([(-1, 2)]), "<net><layers>"])
def test_ranges_past_the_bin_or_bad_xml_are_refused(bad):
    with pytest.raises(ValueError):
        ir_segments(bad, 50)


def one_stage_build(root, name: str, data: bytes, xml: str) -> LoadedManifest:
    """A 1-stage build folder of a manifest whose stage's files are ``xml`` and ``data`` (written complete)."""
    folder = root / name
    (folder / "stage_0").mkdir(parents=True)
    (folder / "stage_0" / "openvino_model.bin").write_bytes(data)
    (folder / "stage_0" / "openvino_model.xml").write_text(xml)
    files = {f"stage_0/openvino_model.{ext}": hashlib.sha256((folder / f"stage_0/openvino_model.{ext}").read_bytes())
             .hexdigest() for ext in ("xml", "bin")}
    manifest = Manifest("tiny", Architecture("llama", 2, 64, 4, 2, 16, 100, 512),
                        (StageEntry(0, 0, 2, "stage_0/openvino_model.xml", "stage_0/openvino_model.bin"),),
                        "2026.4.1", 5, "fp16", "f16", (1,), files)
    text = manifest.to_json()
    sha = build_identity(text.encode())
    target = root / sha
    folder.rename(target)
    (target / "manifest.json").write_text(text)
    return LoadedManifest(Manifest.from_json(text), target, sha)


def test_a_file_is_built_from_the_segments_held_and_a_stale_one_is_not_copied(tmp_path):
    a, b, c, d = (os.urandom(n) for n in (3000, 5000, 700, 4000))
    cache = StageCache(tmp_path)
    one_stage_build(tmp_path, "old", a + b + c, ir_xml([(0, 3000), (3000, 5000), (8000, 700)]))
    new_data = b + d + a  # b and a held (at other offsets), d not
    new = one_stage_build(tmp_path, "new", new_data, ir_xml([(0, 5000), (5000, 4000), (9000, 3000)]))
    target = new.directory / "stage_0" / "openvino_model.bin"
    target.rename(tmp_path / "new.bin")  # the new build's manifest is in the cache, its .bin is to be made
    segments = hash_segments(tmp_path / "new.bin", [(0, 5000), (5000, 4000), (9000, 3000)])

    have, copied, held = cache.reuse(new, "stage_0/openvino_model.bin", len(new_data), segments)
    assert (have, copied, held) == (5000, 5000, [True, False, True])  # b copied, then d is missing: it stops
    assert json.loads(next((tmp_path / SEGMENTS_DIR).glob("*.json")).read_text())["segments"][1][:2] == [3000, 5000]
    assert cache.write(new, "stage_0/openvino_model.bin", 5000, d, len(new_data)) is False  # d sent
    have, copied, _ = cache.reuse(new, "stage_0/openvino_model.bin", len(new_data), segments)
    assert (have, copied) == (len(new_data), 3000) and target.read_bytes() == new_data  # a copied: checked, in place
    assert cache.reuse(new, "stage_0/openvino_model.bin", len(new_data), segments)[:2] == (len(new_data), 0)

    target.unlink()  # again, but the held file changed under its index: a's bytes are not a's any more
    old_bin = next(p for p in tmp_path.glob("*/stage_0/openvino_model.bin") if p != target)
    old_bin.write_bytes(bytes(3000) + b + c)
    have, copied, _ = cache.reuse(new, "stage_0/openvino_model.bin", len(new_data), segments)
    assert (have, copied) == (5000, 5000)
    cache.write(new, "stage_0/openvino_model.bin", 5000, d, len(new_data))
    have, copied, _ = cache.reuse(new, "stage_0/openvino_model.bin", len(new_data), segments)
    assert (have, copied) == (9000, 0) and not target.exists()  # not copied; the partial file kept up to there
    stale = tmp_path / SEGMENTS_DIR / f"{hashlib.sha256(a + b + c).hexdigest()}.json"
    assert not stale.exists()  # that file's index is made again from its bytes


def test_a_file_whose_bytes_are_all_written_is_finished_and_a_wrong_size_is_not_held(tmp_path):
    a = os.urandom(3000)
    cache = StageCache(tmp_path)
    one_stage_build(tmp_path, "old", a, ir_xml([(0, 3000)]))
    new = one_stage_build(tmp_path, "new", a + a, ir_xml([(0, 3000), (3000, 3000)]))
    target = new.directory / "stage_0" / "openvino_model.bin"
    target.rename(target.with_name(target.name + ".part"))  # all written, the worker stopped before the rename
    sha = hashlib.sha256(a).digest()
    assert cache.reuse(new, "stage_0/openvino_model.bin", 6000, [Segment(0, 3000, sha), Segment(3000, 3000, sha)]) \
        == (6000, 0, [True, True])
    assert target.read_bytes() == a + a  # checked against the manifest and put in place
    assert cache.reuse(new, "stage_0/openvino_model.bin", 6000, [Segment(0, 6000, sha)])[2] == [False]


def test_segments_that_do_not_tile_the_file_are_refused(tmp_path):
    data = os.urandom(100)
    cache = StageCache(tmp_path)
    loaded = one_stage_build(tmp_path, "b", data, ir_xml([(0, 100)]))
    sha = hashlib.sha256(data).digest()
    for bad in ([Segment(0, 50, sha)], [Segment(10, 90, sha)], [Segment(0, 100, b"short")],
                [Segment(0, 60, sha), Segment(50, 50, sha)]):
        with pytest.raises(StageCacheError):
            cache.reuse(loaded, "stage_0/openvino_model.bin", 100, bad)


def test_file_segments_of_a_real_ir(tmp_path):
    xml = ir_xml([(0, 4), (4, 4)])
    (tmp_path / "m.xml").write_text(xml)
    (tmp_path / "m.bin").write_bytes(b"abcdefgh")
    assert file_segments(tmp_path / "m.xml", tmp_path / "m.bin") == [
        Segment(0, 4, hashlib.sha256(b"abcd").digest()), Segment(4, 4, hashlib.sha256(b"efgh").digest())]
