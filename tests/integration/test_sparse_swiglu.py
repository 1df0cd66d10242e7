"""``fleet-compiler build --sparse-ffn S`` on a SwiGLU model (issue 47): the demo (SmolLM2-135M, real weights) built
with each layer's threshold on |silu(gate)| calibrated to skip a fraction S of its neurons, checked against
transformers: on the calibration text each layer's activations fall under its threshold in the share S; the build's
logits are transformers' with the same neurons zeroed (and not the dense model's); its manifest states the loss
measured against the dense build, within the limits; ``inspect --quality`` holds it to them. A build past its limits
is refused, naming what it measured, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.quality import EVAL_TEXT
from fleet_common.manifest import load_manifest
from tests.integration.test_architectures import reference_model

pytestmark = pytest.mark.integration

SPARSITY = 0.2  # the demo at 0.2: perplexity +1-2% over the dense build (0.3: +6.5%, over the default 5%)
TOKENS = 256  # of the evaluation text, for the logits
TIE = 1e-6  # |a| this close to its threshold may land on either side (f32)


@pytest.fixture(scope="module")
def sparse_build(tmp_path_factory, demo_hf):  # noqa: ANN201
    from compiler.build import build

    out = tmp_path_factory.mktemp("sparse-swiglu") / "build"
    build(demo_hf, out, shards=2, ffn_sparsity=SPARSITY)
    return out


def masked_reference(demo_hf, thresholds: dict[int, float] | None):  # noqa: ANN001, ANN201
    """transformers' demo in f32 (the build's fp16 values) with each layer's silu(gate) zeroed where |a| <= its
    threshold (None: dense), and the activations each layer computed (``model.seen``)."""
    import torch

    model = reference_model(demo_hf)
    model.seen = {}

    def hook(layer: int):  # noqa: ANN202
        def zero_under(module, inputs, a):  # noqa: ANN001, ANN202
            model.seen.setdefault(layer, []).append(a.detach().reshape(-1, a.shape[-1]).abs())
            return a if thresholds is None else torch.where(a.abs() > thresholds[layer], a, torch.zeros_like(a))
        return zero_under

    for i, layer in enumerate(model.model.layers):
        layer.mlp.act_fn.register_forward_hook(hook(i))
    return model


def log_softmax(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()


def test_each_layer_skips_s_of_its_activations_on_the_calibration_text(sparse_build, demo_hf):
    from compiler.calibrate import CALIBRATION_TOKENS, calibration_ids, calibration_text

    entry = load_manifest(sparse_build).manifest.sparse_ffn
    text = calibration_text(None)
    ids = calibration_ids(sparse_build, text)
    assert (entry.calibration, entry.calibration_sha256) == (text.name, text.sha256)
    assert entry.calibration_tokens == len(ids) == CALIBRATION_TOKENS
    model = masked_reference(demo_hf, None)
    log_softmax(model, ids)
    for layer, t in enumerate(entry.thresholds):
        a = model.seen[layer][0].numpy()
        assert t > 0 and abs(float((a <= t).mean()) - SPARSITY) < 0.005, (layer, t, float((a <= t).mean()))


def test_every_mlp_is_a_silu_sparse_op_with_its_layer_s_threshold(sparse_build):
    from fleet_common.runtime import stage_core

    manifest = load_manifest(sparse_build).manifest
    thresholds = []
    for stage in manifest.stages:
        ops = [n for n in stage_core().read_model(str(sparse_build / stage.xml)).get_ordered_ops()
               if n.get_type_name() == "GgufSparseFfn"]
        assert len(ops) == stage.num_layers and stage.kernels is not None
        assert {n.get_attributes()["activation"] for n in ops} == {"silu"}
        thresholds += [n.get_attributes()["threshold"] for n in ops]
    assert thresholds == pytest.approx(manifest.sparse_ffn.thresholds, rel=1e-6)


def test_logits_are_transformers_with_the_same_neurons_zeroed(sparse_build, demo_hf):
    """Exact up to a near tie: a neuron whose |silu(gate)| lies within rounding of its threshold may fall on either
    side in two f32 computations, and one of |a| ~ t switched changes the rest of the sequence by more than rounding
    (0.16 in log-probability, 15 positions into the text, here). So every position before the first that differs
    is within rounding, that first one holds a neuron within ``TIE`` of its threshold in some layer, and the whole
    text stays far closer to the masked reference than to the dense model."""
    from coordinator.tokenizer import ChatTokenizer
    from compiler.quality import StageChain

    ids = ChatTokenizer(sparse_build).encode(EVAL_TEXT.read_text())[:TOKENS]
    got = StageChain(load_manifest(sparse_build)).score(ids, 0)
    thresholds = dict(enumerate(load_manifest(sparse_build).manifest.sparse_ffn.thresholds))
    model = masked_reference(demo_hf, thresholds)
    expected = log_softmax(model, ids)
    dense = log_softmax(masked_reference(demo_hf, None), ids)
    gap = np.min([np.abs(model.seen[i][0].numpy() - t).min(-1) for i, t in thresholds.items()], axis=0)  # [TOKENS]
    error = np.abs(got - expected).max(-1)
    if (error > 2e-4).any():
        first = int(np.argmax(error > 2e-4))
        assert gap[first] < TIE, (first, gap[first], error[:first + 1])
    assert np.abs(got - expected).mean() < 0.2 * np.abs(got - dense).mean()  # it skipped what transformers skips
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.95


def test_the_manifest_states_the_measured_loss_and_inspect_holds_it(sparse_build, build_1, capsys):
    from compiler.cli import main as compiler_main
    from compiler.sparse_build import MAX_PPL_INCREASE, MIN_AGREEMENT, QUALITY_TOKENS

    entry = load_manifest(sparse_build).manifest.sparse_ffn
    assert (entry.activation, entry.sparsity, entry.quality_tokens) == ("silu", SPARSITY, QUALITY_TOKENS)
    assert (entry.max_ppl_increase, entry.min_agreement) == (MAX_PPL_INCREASE, MIN_AGREEMENT)
    assert 0 < entry.ppl_increase <= MAX_PPL_INCREASE and MIN_AGREEMENT <= entry.agreement < 1
    assert len(entry.thresholds) == load_manifest(sparse_build).manifest.architecture.num_layers
    assert compiler_main(["inspect", str(sparse_build), "--quality", "--reference", str(build_1),
                          "--tokens", str(QUALITY_TOKENS)]) == 0
    out = capsys.readouterr().out
    assert "quality: OK" in out and f"<= {0.001 + MAX_PPL_INCREASE:+.1%}, >= {MIN_AGREEMENT:.2f}" in out, out
    assert f"as built: perplexity {entry.ppl_increase:+.2%} over {QUALITY_TOKENS} tokens" in out  # the manifest's
    # a sparse build is measured against a dense one, never the other way round
    assert compiler_main(["inspect", str(build_1), "--quality", "--reference", str(sparse_build)]) == 2
    assert "is a sparse FFN build (--sparse-ffn 0.2): give a dense build as the reference" in capsys.readouterr().err


def test_a_build_past_its_stated_loss_is_refused(sparse_build, build_1, tmp_path):
    """The build's last step (compiler/sparse_build.py ``hold_to_limits``) on a copy of the sparse build, held to a
    stricter limit than it meets: refused with the measurement, its manifest untouched (``build`` then removes its
    staging folder and the dense reference, as for any error: the calibration-text test below checks that)."""
    import shutil

    from compiler.calibrate import Calibration, CalibrationText
    from compiler.save import BuildError
    from compiler.sparse_build import Limits, hold_to_limits

    copy = tmp_path / "staging"
    shutil.copytree(sparse_build, copy)
    before = (copy / "manifest.json").read_bytes()
    e = load_manifest(copy).manifest.sparse_ffn
    calibration = Calibration(e.sparsity, dict(enumerate(e.thresholds)), CalibrationText(e.calibration, "", ""),
                              e.calibration_tokens)
    with pytest.raises(BuildError, match=r"--sparse-ffn 0.2: perplexity \+\d\.\d\d% against the dense build over "
                                         r"1024 tokens, greedy agreement 0\.\d+, past the stated loss \(perplexity at "
                                         r"most \+1\.0%, agreement at least 0.85\): skip fewer neurons"):
        hold_to_limits(copy, build_1, calibration, load_manifest(copy).manifest, Limits(max_ppl_increase=0.01))
    assert (copy / "manifest.json").read_bytes() == before and not (copy / "quality.json").exists()


def test_a_calibration_text_that_cannot_serve_is_refused_before_the_dense_build(sparse_build, tmp_path, demo_hf):
    import os

    from compiler.build import build
    from compiler.calibrate import MAX_TEXT_BYTES, CalibrationError, calibration_ids, calibration_text

    short = tmp_path / "short.txt"
    short.write_text("Only a few words to calibrate on.")
    with pytest.raises(CalibrationError, match="short.txt has 9 tokens; give one of at least 256"):
        calibration_ids(sparse_build, calibration_text(short))
    binary, fifo, huge = tmp_path / "model.bin", tmp_path / "fifo", tmp_path / "huge.txt"
    binary.write_bytes(b"\x00\xc6\xff" * 100)
    os.mkfifo(fifo)
    for path, says in ((tmp_path / "missing.txt", "No such file"), (tmp_path, "not a regular file"),
                       (fifo, "not a regular file"), (binary, "not UTF-8 text")):
        with pytest.raises(CalibrationError, match=f"--calibration-text {path}: {says}"):
            build(demo_hf, tmp_path / "out", shards=1, ffn_sparsity=0.2, calibration_text=path)
        assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())
    huge.write_text("é" * MAX_TEXT_BYTES)  # 2 MiB: only the first MiB is read, and its cut last character dropped
    text = calibration_text(huge)
    assert text.text == "é" * (MAX_TEXT_BYTES // 2) and text.name == "huge.txt"
    assert len(calibration_ids(sparse_build, calibration_text(EVAL_TEXT), tokens=300)) == 300


def test_a_hand_edited_sparse_entry_is_refused_by_name(sparse_build, tmp_path):
    import json
    import shutil

    from fleet_common.manifest import ManifestError

    copy = tmp_path / "edited"
    shutil.copytree(sparse_build, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    for field, value, says in (("max_ppl_increase", "0.05", "sparse_ffn.max_ppl_increase is '0.05', not a finite"),
                               ("agreement", None, "sparse_ffn.agreement is None"),
                               ("thresholds", "abc", "sparse_ffn.thresholds\\[0\\] is 'a'"),
                               ("thresholds", [0.1, 0.2], "holds 2 'silu' thresholds; this fleet reads 30"),
                               ("activation", "gelu", "holds 30 'gelu' thresholds")):
        (copy / "manifest.json").write_text(json.dumps({**raw, "sparse_ffn": {**raw["sparse_ffn"], field: value}}))
        with pytest.raises(ManifestError, match=says):
            load_manifest(copy)


def test_a_fleet_serves_the_sparse_build_and_says_so(sparse_build, tmp_path):
    import httpx

    from tests.conftest import Fleet, chat

    entry = load_manifest(sparse_build).manifest.sparse_ffn
    fleet = Fleet(sparse_build, tmp_path, peers=True)
    try:
        card = httpx.get(f"{fleet.url}/v1/models", timeout=30).json()["data"][0]
        r = chat(fleet.url, "What is the capital of France?", max_tokens=16)
    finally:
        fleet.stop()
    assert card["sparse_ffn"] == {"sparsity": SPARSITY, "ppl_increase": entry.ppl_increase,
                                  "agreement": entry.agreement, "quality_tokens": entry.quality_tokens}
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]  # greedy, its int8 kernels: still the answer
