"""The weight layouts of bench/kernels/layout_bench.py and bench/kernels/mxfp4_forms.py on OpenVINO's real CPU plugin, at a small
shape: the forms fleet keeps GGUF blocks in are matched by the plugin's compressed-weight pattern (it holds their
codes, not a float copy) and are exact at f32 with its int8 activations off; the decompression in the other order is
folded into a float copy (why compiler/export.py writes Q4_K as codes times scale plus a second product)."""

from __future__ import annotations

import argparse

import pytest

from bench.kernels import layout_bench


@pytest.fixture(scope="module")
def cells() -> dict[tuple[str, str], dict]:
    args = argparse.Namespace(shape=(512, 512), threads=1, precisions=["f32"], dq=[None, 0], matmuls=1, rounds=1,
                              calls=2, probe=False, realtime=False)
    return {(c["form"], str(c["dq"])): c for c in layout_bench.measure(args)}


KEPT = ("Q4_0 kept: i4/32, f32 scale", "Q4_K kept: u4/32 + offset product", "Q8_0 kept: i8/32", "i8/16")


@pytest.mark.parametrize("form", KEPT)
def test_kept_forms_run_on_their_codes_and_are_exact_without_int8_activations(cells, form):
    off, on = cells[(form, "0")], cells[(form, "default")]
    codes = next(f.codes for f in layout_bench.FORMS if f.name == form)
    assert off["runs_weight"] == on["runs_weight"] == codes  # compressed FullyConnected, no float copy
    assert off["rel_err"] < 1e-5  # f32 activations: the blocks' own values
    assert on["rel_err"] < 3e-2  # int8 activations per 32 (dynamic quantization): its usual error


def test_scale_then_offset_is_folded_into_a_float_weight(cells):
    cell = cells[("u4/32, scale then f32 offset", "0")]
    assert cell["runs_weight"] in ("f32", "bf16", "f16")
    assert cell["rel_err"] < 1e-5


def test_mxfp4_forms_run_where_compiler_gguf_mxfp4_says():
    """bench/kernels/mxfp4_forms.py at a small shape: a FullyConnected holds MXFP4's f4e2m1 codes (dense matrices keep
    them), a GatherMatmul folds them into f32 but holds the i8 form's codes (the experts' form); every form gives
    gguf-py's values at f32 activations."""
    from bench.kernels import mxfp4_forms

    args = argparse.Namespace(dense=(256, 512), moe=(4, 128, 64, 2), threads=1, rounds=1, calls=1)
    cells = {(c["kind"], c["form"], c["dq"]): c for c in mxfp4_forms.measure(args)}
    assert cells[("dense", "f4e2m1 x f8e8m0", 0)]["runs_as"] == "f4e2m1"
    assert cells[("moe", "f4e2m1 x f8e8m0", 0)]["runs_as"] == "f32"
    assert cells[("moe", "i8 x 2^(e-128)", 0)]["runs_as"] == "i8"
    assert all(c["rel_err"] < 1e-5 for (_, form, dq), c in cells.items() if dq == 0 and form != "i4/32")
