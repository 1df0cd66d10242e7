"""bench/builds/gguf_forms.py without builds or llama.cpp: the GGUFs it writes with gguf-py (metadata copied, layer
matrices re-quantized by gguf-py's own quantizer, the rest untouched) and its speed cells and table."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np

from bench.builds.gguf_forms import is_layer_matrix, same_tensors, speed_cells, table, tensor_types, write_gguf
from compiler.gguf_read import read_gguf_file

Q = gguf.GGMLQuantizationType


def tiny_gguf(path):
    """A GGUF with a layer matrix in F32, a Q8_0 embedding, an F32 norm and a few metadata fields."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(0)
    w.add_block_count(1)
    w.add_token_list(["<a>", "b", "ç"])
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64), dtype=np.float32))
    w.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((3, 64), dtype=np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensors(path):
    return {t.name: t for t in read_gguf_file(str(path)).tensors}


def test_write_gguf_requantizes_layer_matrices_only(tmp_path):
    src = tiny_gguf(tmp_path / "src.gguf")
    out = write_gguf(src, tmp_path / "q4_0.gguf", "Q4_0")
    assert not (tmp_path / "q4_0.gguf.partial").exists()
    a, b = tensors(src), tensors(out)
    expected = gguf.quants.quantize(np.asarray(a["blk.0.attn_q.weight"].data), Q.Q4_0)
    assert b["blk.0.attn_q.weight"].tensor_type == Q.Q4_0
    assert np.array_equal(np.asarray(b["blk.0.attn_q.weight"].data), expected)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight"):  # copied byte for byte
        assert b[name].tensor_type == a[name].tensor_type
        assert np.array_equal(np.asarray(b[name].data), np.asarray(a[name].data))
    reader = read_gguf_file(str(out))
    assert reader.fields["general.file_type"].contents() == 2  # LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<a>", "b", "ç"]
    assert reader.fields["general.architecture"].contents() == "llama"
    assert tensor_types(out) == {"Q4_0": 1, "Q8_0": 1, "F32": 1}
    # re-quantizing a Q4_0 file's dequantization to Q4_0 gives its blocks back (as Q4_1 does for the demo)
    assert same_tensors(write_gguf(out, tmp_path / "again.gguf", "Q4_0"), out)
    assert not same_tensors(out, src)


def test_write_gguf_f32_dequantizes_everything(tmp_path):
    src = tiny_gguf(tmp_path / "src.gguf")
    b = tensors(write_gguf(src, tmp_path / "f32.gguf", "F32"))
    embd = tensors(src)["token_embd.weight"]
    assert {t.tensor_type for t in b.values()} == {Q.F32}
    assert np.array_equal(np.asarray(b["token_embd.weight"].data), gguf.quants.dequantize(np.asarray(embd.data), Q.Q8_0))


def test_layer_matrix_names():
    assert is_layer_matrix("blk.12.ffn_down.weight") and is_layer_matrix("blk.0.attn_output.weight")
    assert not any(map(is_layer_matrix, ("token_embd.weight", "blk.0.attn_norm.weight", "output.weight",
                                         "blk.0.attn_q.bias")))


def test_speed_cells_pair_each_round_with_fp16_at_the_same_precision():
    def config(form, precision, runs, top1):
        return SimpleNamespace(form=form, precision=precision, runs=runs, top1=top1)

    configs = [config("fp16", "auto", [[10, 10, 12], [20, 20, 20]], [[1, 2, 3], [1, 2, 3]]),
               config("fp16", "f32", [[30, 30, 30], [30, 30, 30]], [[1, 2, 3], [1, 2, 3]]),
               config("Q4_0", "auto", [[5, 5, 5], [30, 30, 30]], [[1, 2, 0], [1, 2, 3]]),
               config("Q4_0", "f32", [[15, 15, 15], [15, 15, 60]], [[1, 2, 3], [1, 2, 3]])]
    cells = speed_cells(configs)
    assert cells["Q4_0"]["auto"] == {"ms": 17.5, "over_fp16": 1.0, "top1_same_as_fp16": 5 / 6}  # ratios 0.5, 1.5
    assert cells["Q4_0"]["f32"]["over_fp16"] == 0.5 and cells["Q4_0"]["f32"]["ms"] == 15
    assert cells["fp16"]["auto"]["over_fp16"] == 1.0


def test_table_one_row_per_build():
    runtime = {"auto": {"weights": {"u4 g32": 210, "i8 g32": 1}}, "f32": {"weights": {"u4 g32": 210, "i8 g32": 1}}}
    rows = [{"label": "fp16 (HF folder)", "bin_bytes": 269e6, "runtime": {"auto": {"weights": {"bf16": 211}}},
             "quality": {"perplexity": 21.214, "ppl_increase": 0.0, "agreement": 1.0, "identical": 8, "prompts": 8},
             "speed": {"auto": {"ms": 10.6, "over_fp16": 1.0}}, "memory": {}},
            {"label": "Q4_0 GGUF", "bin_bytes": 105.4e6, "runtime": runtime, "quality": None,
             "speed": {"auto": {"ms": 9.5, "over_fp16": 0.9}, "f32": {"ms": 12.0, "over_fp16": 0.61}},
             "memory": {"auto": {"peak_rss_bytes": 360e6, "own_bytes": 150e6},
                        "f32": {"peak_rss_bytes": 380e6, "own_bytes": 170e6}}}]
    lines = table(rows).splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| fp16 (HF folder) | 269 | bf16 211 | 21.214 | +0.00% | 1.000, 8/8 | 10.60 | 1.00 | - | - | - / - | - / - |" \
        == lines[2]
    assert lines[3] == ("| Q4_0 GGUF | 105 | u4 g32 210, i8 g32 1 / u4 g32 210, i8 g32 1 | - | - | - | 9.50 | 0.90 "
                        "| 12.00 | 0.61 | 360 / 380 | 150 / 170 |")
