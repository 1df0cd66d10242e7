"""The builder's int8 stages are NNCF's: per-channel int8 written tensor by tensor (compress.int8_rows, in
blocks of rows) gives the same bytes as ``nncf.compress_weights`` on the whole fp16 stage."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from compiler.build import build
from compiler.compress import WeightSpec, compress

from .test_compile_deps import tiny_llama


def _constants(model: ov.Model) -> dict[str, np.ndarray]:
    return {op.get_friendly_name(): op.get_data() for op in model.get_ordered_ops()
            if op.get_type_name() == "Constant" and op.get_element_type() in (ov.Type.u8, ov.Type.i8, ov.Type.f16)}


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_int8_stages_equal_nncf_on_the_whole_stage(symmetric, tmp_path, monkeypatch):
    import compiler.compress

    monkeypatch.setattr(compiler.compress, "ROW_BLOCK_BYTES", 4096)  # several blocks per weight
    src = tiny_llama(tmp_path / "tiny")
    # OpenVINO's own fp16 forms (a GPU stage's) as NNCF's input: a CPU build's matrices are fleet's
    # kernels' bytes
    build(src, tmp_path / "fp16", shards=2, devices=("GPU",) * 2)
    build(src, tmp_path / "int8", shards=2, weights="int8", symmetric=symmetric)
    core = ov.Core()
    for stage in (0, 1):
        xml = f"stage_{stage}/openvino_model.xml"
        ours = _constants(core.read_model(tmp_path / "int8" / xml))
        nncf = _constants(compress(core.read_model(tmp_path / "fp16" / xml), WeightSpec("int8", symmetric=symmetric)))
        weights = [k for k, v in nncf.items() if v.dtype in (np.uint8, np.int8) and not k.endswith("/zero_point")]
        assert weights and set(weights) <= set(ours), sorted(set(weights) - set(ours))
        for name in weights:
            assert np.array_equal(ours[name], nncf[name]), name
            assert np.array_equal(ours[f"{name}/scale"], nncf[f"{name}/scale"]), name
            if not symmetric:
                assert np.array_equal(ours[f"{name}/zero_point"], nncf[f"{name}/zero_point"]), name
