"""The planner's count of a sparse FFN build (issue 47; compiler/planner.py, ``fleet-compiler plan --sparse-ffn``):
a layer reads all of gate and the kept fraction of up and down_t, holds what the dense build holds; refusals by
name. ProSparse-Llama-2-7B's dimensions (its config.json: hidden 4096, 32 heads of 128, FFN 11008, ReLU)."""

from __future__ import annotations

import json

import pytest

from compiler.cli import main as compiler_main
from compiler.compress import resolve
from compiler.planner import ModelDims, plan, read_plan, weight_bytes
from tests.unit.test_planner import nodes

PROSPARSE = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
             "head_dim": 128, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
             "tie_word_embeddings": False, "model_type": "llama", "hidden_act": "relu"}
DENSE = ModelDims.from_config(PROSPARSE, "prosparse-7b")


def test_a_sparse_layer_reads_gate_and_the_kept_rows_of_up_and_down_t():
    attention = 4096 * 4096 * 4  # q, k, v, o (32 KV heads)
    ffn = 4096 * 11008
    assert DENSE.layer_params == attention + 3 * ffn and DENSE.read_fraction == 1.0
    for sparsity in (0.01, 0.5, 0.88):
        dims = DENSE.with_sparse_ffn(sparsity, "relu")
        expected = (attention + ffn + 2 * (1 - sparsity) * ffn) / (attention + 3 * ffn)
        assert dims.read_fraction == pytest.approx(expected, rel=1e-12)
    assert DENSE.with_sparse_ffn(0.88, "relu").read_fraction == pytest.approx(0.6079, abs=1e-4)


def test_a_sparse_plan_holds_the_dense_bytes_and_predicts_the_reads_it_saves():
    fleet = nodes("a:48GiB:0.5ms", "b:48GiB:0.5ms")  # measured ms per dense layer
    dense = plan(DENSE, fleet, max_context=2048)
    sparse = plan(DENSE.with_sparse_ffn(0.88, "relu"), fleet, max_context=2048)
    spec = resolve("fp16", DENSE.parameters)
    for p in (dense, sparse):
        for s in p.stages:  # down_t replaces down with the same bytes: memory as dense
            assert s.weight_bytes == weight_bytes(DENSE, spec, s.end - s.start, s.index == 0, s.index == 1)
    fraction = sparse.dims.read_fraction
    for s in sparse.stages:
        work = (s.end - s.start) * fraction + (DENSE.head_layers if s.index == 1 else 0.0)
        assert s.ms_per_token == pytest.approx(0.5 * work)
    # the head weighs more against cheaper layers: the last stage takes fewer of them, and the slowest is faster
    assert sparse.stages[1].end - sparse.stages[1].start < dense.stages[1].end - dense.stages[1].start
    assert sparse.bottleneck.ms_per_token < 0.7 * dense.bottleneck.ms_per_token
    assert "sparse FFN at 88%: a layer reads 0.61 of a dense one's weights" in "\n".join(
        __import__("compiler.planner", fromlist=["report_lines"]).report_lines(sparse))


def test_refused_by_name():
    assert DENSE.with_sparse_ffn(0.3, "silu").ffn_sparsity == 0.3  # SwiGLU: calibrated (build --sparse-ffn 0.3)
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh'"):
        DENSE.with_sparse_ffn(0.5, "gelu_pytorch_tanh")
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="0 < s < 1"):
            DENSE.with_sparse_ffn(bad, "relu")
    with pytest.raises(ValueError, match="--weights int8"):
        plan(DENSE.with_sparse_ffn(0.5, "relu"), nodes("a:12GiB", "b:12GiB"), weights="int8", max_context=2048)


def test_plan_and_build_commands(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(PROSPARSE))
    out = tmp_path / "plan.json"
    argv = ["plan", str(hf), "--node", "a:48GiB", "--node", "b:48GiB", "--max-context", "2048"]
    assert compiler_main(argv + ["--sparse-ffn", "0.88", "-o", str(out)]) == 0
    assert "sparse FFN at 88%" in capsys.readouterr().out
    assert read_plan(out).dims.ffn_sparsity == 0.88
    # build --plan: the plan's choice must be the build's, both ways
    assert compiler_main(["build", str(hf), "--plan", str(out), "-o", str(tmp_path / "b1")]) == 2
    assert "the plan was made for a sparse FFN build at 0.88: add --sparse-ffn (a ReLU model)" in capsys.readouterr().err
    dense_out = tmp_path / "dense.json"
    assert compiler_main(argv + ["-o", str(dense_out)]) == 0
    assert compiler_main(["build", str(hf), "--plan", str(dense_out), "--sparse-ffn", "-o", str(tmp_path / "b2")]) == 2
    assert "plan again with --sparse-ffn S" in capsys.readouterr().err
    (hf / "config.json").write_text(json.dumps({**PROSPARSE, "hidden_act": "gelu_pytorch_tanh"}))
    assert compiler_main(argv + ["--sparse-ffn", "0.5"]) == 2
    assert "hidden_act 'gelu_pytorch_tanh'" in capsys.readouterr().err
    # a SwiGLU model's plan at S: its build must skip that S
    (hf / "config.json").write_text(json.dumps({**PROSPARSE, "hidden_act": "silu"}))
    assert compiler_main(argv + ["--sparse-ffn", "0.3", "-o", str(out)]) == 0
    assert f"fleet-compiler build SRC --plan {out} --sparse-ffn 0.3 -o BUILD" in capsys.readouterr().out
    assert compiler_main(["build", str(hf), "--plan", str(out), "--sparse-ffn", "0.5", "-o", str(tmp_path / "b3")]) == 2
    assert "--sparse-ffn 0.5 differs from the plan's 0.3" in capsys.readouterr().err
    assert compiler_main(["build", str(hf), "--plan", str(out), "-o", str(tmp_path / "b4")]) == 2
    assert "or --sparse-ffn 0.3 (a SwiGLU model)" in capsys.readouterr().err
    # the calibration's options mean nothing without --sparse-ffn S, and impossible limits are refused first
    for extra, says in ((["--min-agreement", "0.9"], "--min-agreement: for a calibrated sparse FFN build only"),
                        (["--sparse-ffn", "0.2", "--max-ppl-increase", "nan"], "--max-ppl-increase nan: give"),
                        (["--sparse-ffn", "0.2", "--min-agreement", "1.5"], "--min-agreement 1.5: give")):
        assert compiler_main(["build", str(hf), "-o", str(tmp_path / "b5"), *extra]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "b5").exists()
