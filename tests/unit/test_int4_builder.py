"""The builder's int4 stages are NNCF's: written tensor by tensor (compress.int4_plan picks each weight's
precision from the graph and, below ratio 1.0, from compress.sensitivity's scores; compress.int4_rows
compresses it in blocks of rows), they hold the same constants, byte for byte, and the same ops as
``nncf.compress_weights`` on the whole fp16 stage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import openvino as ov
import pytest

from compiler.build import build
from compiler.compress import WeightSpec, compress

from .test_compile_deps import tiny_llama

PACKED = (ov.Type.u8, ov.Type.i8, ov.Type.u4, ov.Type.i4, ov.Type.f16)


def tiny_model(folder: Path, tied: bool) -> Path:
    """A 2-layer random Llama whose matrices are both under and over NNCF's 10,000-weight threshold for its
    OpenVINO-compiled compression, with rows of 96 (group 64 adjusted to 32) and 272 (no power of two >= 32
    divides it: at group 64 NNCF keeps such a matrix at its int8 backup; group 16 divides both, so the last
    MatMul's rule decides: the stage's last down projection at int8, or int4 when the last MatMul is the LM
    head tied to the embedding)."""
    return tiny_llama(folder, hidden=96, intermediate=272, vocab=300, kv_rows=48, tied=tied, std=0.05, seed=1)


def _constants(model: ov.Model) -> dict[str, tuple[str, list[int], bytes]]:
    return {op.get_friendly_name(): (op.get_element_type().get_type_name(), list(op.get_shape()), op.get_data().tobytes())
            for op in model.get_ordered_ops()
            if op.get_type_name() == "Constant" and op.get_element_type() in PACKED}


def _op_counts(model: ov.Model) -> Counter:
    return Counter(op.get_type_name() for op in model.get_ordered_ops())


@pytest.mark.parametrize(("shards", "tied", "symmetric", "group", "ratio"),
                         [(2, False, False, 64, 1.0), (2, False, True, 16, 1.0), (1, True, False, 16, 1.0),
                          (2, False, False, 16, 0.6)],
                         ids=["2-stage-asym-g64", "2-stage-sym-g16", "1-stage-tied-asym-g16", "2-stage-asym-g16-r0.6"])
def test_int4_stages_equal_nncf_on_the_whole_stage(shards, tied, symmetric, group, ratio, tmp_path, monkeypatch):
    import compiler.compress
    import compiler.save

    def whole_stage(*args: object) -> None:
        raise AssertionError("an int4 stage went through NNCF on the whole stage")

    monkeypatch.setattr(compiler.compress, "ROW_BLOCK_BYTES", 4096)  # several blocks per weight, a tail merged
    src = tiny_model(tmp_path / "tiny", tied)
    build(src, tmp_path / "fp16", shards=shards)
    monkeypatch.setattr(compiler.save, "compress", whole_stage)
    build(src, tmp_path / "int4", shards=shards, weights="int4", symmetric=symmetric, group_size=group, ratio=ratio)
    manifest = json.loads((tmp_path / "int4" / "manifest.json").read_text())
    assert {s["compression"]["ratio"] for s in manifest["stages"]} == {ratio}
    core = ov.Core()
    spec = WeightSpec("int4", symmetric=symmetric, group_size=group, ratio=ratio)
    for stage in range(shards):
        xml = f"stage_{stage}/openvino_model.xml"
        ours_model = core.read_model(tmp_path / "int4" / xml)
        nncf_model = compress(core.read_model(tmp_path / "fp16" / xml), spec)
        ours, nncf = _constants(ours_model), _constants(nncf_model)
        four_bit = sorted(k for k, (t, _, _) in nncf.items() if t in ("u4", "i4") and not k.endswith("/zero_point"))
        eight_bit = sorted(k for k, (t, _, _) in nncf.items() if t in ("u8", "i8") and not k.endswith("/zero_point"))
        assert four_bit and eight_bit, (four_bit, eight_bit)
        assert sorted(ours) == sorted(nncf), sorted(set(ours) ^ set(nncf))
        for name in nncf:
            assert ours[name][:2] == nncf[name][:2], (name, ours[name][:2], nncf[name][:2])
            assert ours[name][2] == nncf[name][2], name
        assert _op_counts(ours_model) == _op_counts(nncf_model)
