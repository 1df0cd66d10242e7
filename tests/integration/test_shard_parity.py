"""The parity bench's no-hints variant (bench/kernels/shard_parity.py): stripping the fusion hint from a shard
unfuses its attention on CPU and changes none of its outputs at batch 1, so the bench compares like
with like."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from bench.kernels.shard_parity import strip_fusion_hints
from compiler.inspect import fusion_report
from fleet_common.runtime import KVSession, compile_ir, run_chunk

pytestmark = pytest.mark.integration

LAYERS = 2


def tiny_shard(path: Path) -> Path:
    """A random 2-layer Llama exported whole by the fleet exporter (with its fusion hints)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.reference_models import save_whole_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path.parent / "hf")
    return save_whole_model(path.parent / "hf", path, "f32")


def decode(xml: Path) -> np.ndarray:
    """Logits [3, V] of a prefill and two decode steps, at f32."""
    compiled, _, _ = compile_ir(xml, threads=1, inference_precision="f32")
    session = KVSession("s", compiled.create_infer_request(), 16)
    out = []
    for ids in ([3, 1, 4, 1, 5], [9], [2]):
        logits, _ = run_chunk(session, "input_ids", np.array([ids], dtype=np.int64), session.length, session.length,
                              [], np.array([len(ids) - 1], dtype=np.int64))
        out.append(logits[0, -1])
    return np.stack(out)


def test_stripped_hints_unfuse_attention_and_keep_the_outputs(tmp_path):
    hinted = tiny_shard(tmp_path / "hinted.xml")
    model = ov.Core().read_model(hinted)
    assert strip_fusion_hints(model) == 2 * LAYERS  # one Gather per K and per V state
    bare = tmp_path / "bare.xml"
    ov.save_model(model, bare, compress_to_fp16=False)

    with_hints, without = (fusion_report(xml, 0, (0, LAYERS)) for xml in (hinted, bare))
    assert with_hints.fused
    assert not without.fused and without.sdpa_with_kv == 0
    np.testing.assert_allclose(decode(bare), decode(hinted), rtol=0, atol=1e-5)

    with pytest.raises(ValueError, match="not a fleet shard"):
        strip_fusion_hints(model)  # nothing left to strip
