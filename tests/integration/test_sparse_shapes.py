"""The sparse FFN on ReLU models of real models' shapes (issue 47): MiniCPM-S-1B's and ProSparse-Llama-2-7B's
dimensions, a few of their layers (3 and 1: the suite's time), random weights whose sparsity is set to 88% (the ProSparse models' measured
share) by bench/kernels/sparse_model_bench.py's construction (a per-neuron gate bias over a constant residual
coordinate, neurons hot and cold by a power law), its layers' updates (``update_std``) large enough that the MLPs
move the logits by far more than rounding, small enough that each layer's sparsity stays within 0.03 of the set. transformers measures the zeros of every layer's ReLU and gives the
reference logits in f32; fleet's ``--sparse-ffn`` build computes them as its dense build does (the same function,
summed in another order)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.kernels import sparse_model_bench as smb
from fleet_common.manifest import load_manifest

pytestmark = pytest.mark.integration

SPARSITY = 0.88
TOKENS = 12


def transformers_log_probs(folder, ids: list[int], mlp: bool = True) -> np.ndarray:  # noqa: ANN001
    """transformers' f32 log-probabilities [len(ids), V] of the folder's model (``mlp`` False: every MLP's output
    zeroed, to see how much the MLPs move them)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if not mlp:
        for layer in model.model.layers:
            layer.mlp.register_forward_hook(lambda module, inputs, out: torch.zeros_like(out))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()


@pytest.mark.parametrize("shape, layers, update_std", [("minicpm-s-1b", 3, 2e-4), ("prosparse-7b", 1, 5e-5)])
def test_a_relu_model_of_real_shape_at_88_percent_computes_what_its_dense_build_does(shape, layers, update_std, tmp_path,
                                                                                      demo_hf):
    from compiler.build import build
    from compiler.quality import StageChain

    folder, _ = smb.ensure_model(layers, SPARSITY, tmp_path, shape, with_gguf=False, update_std=update_std)
    measured = smb.measured_sparsity(folder)
    assert len(measured) == layers and all(abs(m - SPARSITY) < 0.03 for m in measured), measured
    build(folder, tmp_path / "dense", shards=1)
    build(folder, tmp_path / "sparse", shards=1, sparse_ffn=True)
    assert (tmp_path / "sparse/stage_0/openvino_model.xml").read_text().count('type="GgufSparseFfn"') == layers
    ids = np.random.default_rng(5).integers(3, 49152, TOKENS).tolist()
    expected = transformers_log_probs(folder, ids)
    mlps_move = np.abs(expected - transformers_log_probs(folder, ids, mlp=False)).max()
    dense, sparse = (StageChain(load_manifest(tmp_path / b)).score(ids, 0) for b in ("dense", "sparse"))
    error = np.abs(sparse - expected).max()
    assert error < 1e-3 and error < mlps_move / 20, (error, mlps_move)
    assert np.abs(sparse - dense).max() < 2e-4
    assert (sparse.argmax(-1) == expected.argmax(-1)).all()
