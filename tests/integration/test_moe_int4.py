"""int4 of a Mixture-of-Experts stage (issue 28 item 5): written tensor by tensor like a dense stage, each stacked
expert matrix compressed by NNCF's lowering in blocks of rows across its experts (compiler/export.py
``_Weights._stacked_int4``), no NNCF on the whole stage. The tiny Qwen3-MoE of test_architectures (8 experts of 32,
top-2, a dense layer among sparse ones), built into 2 stages at int4: every stage's constants are
``nncf.compress_weights``' on the fp16 build's stage, byte for byte, its experts' stacked matrices (int4 and the int8
backup) and routers compressed too, and the stage's ops the same."""

from __future__ import annotations

from collections import Counter

import openvino as ov
import pytest

from .test_architectures import make_tiny_model

pytestmark = pytest.mark.integration

PACKED = (ov.Type.u8, ov.Type.i8, ov.Type.u4, ov.Type.i4, ov.Type.f16)


def _constants(model: ov.Model) -> dict[str, tuple[str, list[int], bytes]]:
    return {node.get_friendly_name(): (node.get_element_type().get_type_name(), list(node.get_shape()),
                                       node.get_data().tobytes())
            for node in model.get_ordered_ops()
            if node.get_type_name() == "Constant" and node.get_element_type() in PACKED}


def test_int4_moe_stages_equal_nncf_on_the_fp16_stage(demo_hf, tmp_path, monkeypatch):
    import nncf

    from compiler.arch import ModelConfig
    from compiler.build import build
    from compiler.compress import compress, resolve

    src = make_tiny_model("qwen3moe", tmp_path / "hf", demo_hf)["f32"]
    cfg = ModelConfig.from_folder(src)
    # OpenVINO's own fp16 forms (a GPU stage's) as NNCF's input: a CPU build's matrices are fleet's
    # kernels' bytes
    build(src, tmp_path / "fp16", shards=2, devices=("GPU",) * 2)
    with monkeypatch.context() as patch:  # the int4 build never hands NNCF a whole stage
        patch.setattr(nncf, "compress_weights", lambda *a, **k: pytest.fail("NNCF ran on a whole int4 stage"))
        build(src, tmp_path / "int4", shards=2, weights="int4")
    spec = resolve("int4", cfg.parameters())
    core = ov.Core()
    for stage in range(2):
        xml = f"stage_{stage}/openvino_model.xml"
        ours_model = core.read_model(tmp_path / "int4" / xml)
        nncf_model = compress(core.read_model(tmp_path / "fp16" / xml), spec)
        ours, nncf = _constants(ours_model), _constants(nncf_model)
        experts = [k for k, (t, shape, _) in ours.items() if "experts" in k and len(shape) >= 3 and t != "f16"]
        assert experts, f"stage {stage}: no compressed stacked expert constant in {sorted(ours)}"
        assert sorted(ours) == sorted(nncf), sorted(set(ours) ^ set(nncf))
        for name in nncf:
            assert ours[name] == nncf[name], (name, ours[name][:2], nncf[name][:2])
        assert Counter(n.get_type_name() for n in ours_model.get_ordered_ops()) == \
            Counter(n.get_type_name() for n in nncf_model.get_ordered_ops())
