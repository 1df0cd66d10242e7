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
    import nncf

    import compiler.compress

    def whole_stage(*args: object) -> None:
        raise AssertionError("an int4 stage went through NNCF on the whole stage")

    monkeypatch.setattr(compiler.compress, "ROW_BLOCK_BYTES", 4096)  # several blocks per weight, a tail merged
    src = tiny_model(tmp_path / "tiny", tied)
    # OpenVINO's own fp16 forms (a GPU stage's) as NNCF's input: a CPU build's matrices are fleet's
    # kernels' bytes
    build(src, tmp_path / "fp16", shards=shards, devices=("GPU",) * shards)
    monkeypatch.setattr(nncf, "compress_weights", whole_stage)
    build(src, tmp_path / "int4", shards=shards, weights="int4", symmetric=symmetric, group_size=group, ratio=ratio)
    monkeypatch.undo()  # NNCF on the fp16 stages below, for the reference
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


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_int4_rows_packed_block_by_block_equal_nncf_on_the_whole_tensor(symmetric, monkeypatch):
    """``int4_rows(..., out=)`` (what a stacked expert matrix is written with: the codes packed block by block
    into the constant, never unpacked whole) gives the bytes of NNCF's ``compress_weight`` on the whole tensor,
    over several blocks of rows and a merged tail."""
    import nncf
    import numpy as np
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    import compiler.compress
    from compiler.compress import int4_rows, pack_nibbles, row_blocks

    monkeypatch.setattr(compiler.compress, "ROW_BLOCK_BYTES", 4096)
    weight = np.random.default_rng(3).normal(0, 0.05, (300, 256)).astype(np.float16)
    assert len(row_blocks(300, 256)) > 2
    out = np.zeros(300 * 256 // 2, np.uint8)
    parts = int4_rows(lambda a, b: weight[a:b], weight.shape, symmetric, 32, out=out)
    assert parts["weights"] is out
    mode = nncf.CompressWeightsMode.INT4_SYM if symmetric else nncf.CompressWeightsMode.INT4_ASYM
    whole = compress_weight(Tensor(weight), (1,), WeightCompressionConfig(mode, group_size=32))
    assert out.tobytes() == pack_nibbles(np.asarray(whole.tensor.data)).tobytes()
    assert np.array_equal(parts["scale"], np.asarray(whole.scale.data).reshape(300, 8).astype(np.float16))
    if not symmetric:
        assert parts["zero_point"].tobytes() == pack_nibbles(np.asarray(whole.zero_point.data)).tobytes()
    with pytest.raises(ValueError, match="cols must be even"):
        int4_rows(lambda a, b: weight[a:b], weight.shape, symmetric, 32, out=out[:-1])


def test_expert_rows_read_across_experts(tmp_path):
    """``export.expert_rows``: rows of the experts stacked [E * rows, cols], read from a real safetensors folder
    expert by expert, equal the stacked array's rows for ranges inside one expert and across several; each
    expert is reported once its last row is read."""
    import numpy as np
    from safetensors.numpy import save_file

    from compiler.export import expert_rows
    from compiler.weights import SafetensorsWeights

    rng = np.random.default_rng(5)
    names = [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    experts = {name: rng.normal(0, 1, (6, 8)).astype(np.float16) for name in names}
    save_file(experts, str(tmp_path / "model.safetensors"))
    reported = []
    read = expert_rows(SafetensorsWeights(tmp_path), names, lambda name, rows: reported.append(name))
    stacked = np.concatenate([experts[name] for name in names])
    assert read.shape == (24, 8)
    for start, stop in [(0, 24), (1, 5), (6, 12), (4, 19), (23, 24)]:
        assert np.array_equal(read(start, stop), stacked[start:stop]), (start, stop)
    assert reported == [names[e] for e in (0, 1, 2, 3, 1, 0, 1, 2, 3)]
