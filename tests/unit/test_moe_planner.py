"""Issue 28 item 3: the planner counts every expert's bytes for memory and only the chosen experts' for speed, on
published Mixture-of-Experts configs (Qwen3-30B-A3B, Mixtral-8x7B's dimensions): the weights a stage stores, the
ms per token it is predicted from an empty worker's ms_per_gb (coordinator/fleet/planned.py) or a ``fleet-worker
--profile`` record (compiler/nodes.py), and the build's default split (compiler/build.py ``stage_ranges``)."""

from __future__ import annotations

import pytest

from compiler.arch import ModelConfig
from compiler.build import stage_ranges
from compiler.compress import resolve
from compiler.nodes import node_from_record
from compiler.plan import balanced_split, decode_weights
from compiler.planner import ModelDims, plan, report_lines, runtime_bytes, weight_bytes
from coordinator.fleet.planned import nodes_from_capacities
from fleet_common.discovery import Capacity

GIB = 1 << 30
# Qwen3-30B-A3B's config.json (as published): 48 layers, all sparse, 128 experts of 768, 8 chosen per token
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "tie_word_embeddings": False}
H, LAYERS, VOCAB = 2048, 48, 151936
ATTENTION = H * 32 * 128 * 2 + H * 4 * 128 * 2  # q, o and k, v: weights a token reads in every layer
CHOSEN = 8 * 3 * 768 * H  # the 8 chosen experts' gate, up and down
ALL_EXPERTS = 128 * 3 * 768 * H + 128 * H  # every expert and the router


def test_a_stage_stores_every_expert_and_is_timed_by_the_chosen_ones():
    """Four empty workers of 80 GiB, two of them twice as slow (ms_per_gb): the stages' fp16 weights add up to
    every expert's (61 GB, the published 30.5B parameters x 2 B) and each stage's predicted ms per token is the
    worker's ms_per_gb times the bytes a token reads there, 2 B x (layers x (attention + 8 experts) + the head):
    the 3.3B activated parameters less the embedding in all. The dense model of that active count plans to the same
    speeds."""
    dims = ModelDims.from_config(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    assert dims.layer_params == ATTENTION + CHOSEN
    assert dims.layer_params + dims.idle_params == pytest.approx(ATTENTION + ALL_EXPERTS, rel=1e-9)
    caps = {f"pc-{i}": Capacity(80 * GIB, "CPU", ms) for i, ms in enumerate((20.0, 20.0, 40.0, 40.0))}
    p = plan(dims, nodes_from_capacities(caps, dims), "fp16", max_context=4096, max_sessions=1)
    assert [s.node.name for s in p.stages] == sorted(caps)
    last = len(p.stages) - 1
    for s in p.stages:
        layers = s.end - s.start
        tables = (s.index == 0) + (s.index == last)
        stored = 2 * (layers * (ATTENTION + ALL_EXPERTS + 2 * H) + tables * VOCAB * H + (H if s.index == last else 0))
        assert s.weight_bytes == pytest.approx(stored, rel=1e-6), s
        read = 2 * (layers * (ATTENTION + CHOSEN) + (VOCAB * H if s.index == last else 0))
        assert s.ms_per_token == pytest.approx(caps[s.node.name].ms_per_gb * read / 1e9, rel=1e-9), s
    assert sum(s.weight_bytes for s in p.stages) == pytest.approx(2 * 30.53e9, rel=0.002)
    read_all = sum(s.ms_per_token / caps[s.node.name].ms_per_gb * 1e9 / 2 for s in p.stages)
    # the published 3.3B activated parameters less the embedding (a token reads one row of it): 3.03B
    assert read_all == pytest.approx(3.34e9 - VOCAB * H, rel=0.01)
    slow = [s.end - s.start for s in p.stages[2:]]
    assert max(slow) < min(s.end - s.start for s in p.stages[:2])  # the slower workers get fewer layers

    dense = ModelDims.from_config(QWEN3_30B_A3B | {"model_type": "qwen3"}, "dense-of-its-active")
    assert dense.layer_params == dims.layer_params and dense.idle_params == 0
    q = plan(dense, nodes_from_capacities(caps, dense), "fp16", max_context=4096, max_sessions=1)
    for s in q.stages:  # the same ms per layer: the dense model's stages are timed by the same reads
        read = 2 * ((s.end - s.start) * (ATTENTION + CHOSEN) + (VOCAB * H if s.index == last else 0))
        assert s.ms_per_token == pytest.approx(caps[s.node.name].ms_per_gb * read / 1e9, rel=1e-9), s
    assert sum(s.weight_bytes for s in p.stages) > 8 * sum(s.weight_bytes for s in q.stages)
    # the dense plan's fastest split gives the first worker 18 layers; all their experts would not fit its 80 GiB
    assert q.layers == "0:18,18:36,36:45,45:48" and p.layers == "0:16,16:33,33:43,43:48"
    w18 = weight_bytes(dims, resolve("fp16", dims.parameters), 18, True, False)
    assert w18 + runtime_bytes(w18, "fp16", moe=True) > 80 * GIB > p.stages[0].total_bytes


def test_a_profile_record_of_an_moe_build_takes_the_head_out_by_active_reads():
    """A 1-stage ``fleet-worker --profile`` of the MoE build timed its 48 layers and the head: the head's share
    taken out is the head's reads over one layer's active reads (5.5 layers' worth here), not over all experts'."""
    dims = ModelDims.from_config(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    head_layers = VOCAB * H / (ATTENTION + CHOSEN)
    assert dims.head_layers == pytest.approx(head_layers) and 5 < head_layers < 6
    node = node_from_record({"name": "pc", "memory_bytes": 64 * GIB, "ms_per_token": 100.0, "layers": LAYERS,
                             "lm_head": True}, dims.head_layers)
    assert node.ms_per_layer == pytest.approx(100.0 / (LAYERS + head_layers))


def test_default_split_of_a_mixtral_build_balances_its_two_chosen_experts():
    """``fleet-compiler build --shards 4`` of Mixtral-8x7B's dimensions with a 131,072-token vocabulary: a layer
    reads 2 experts of 14,336 (``read_intermediate_size``), so the split is that of a SwiGLU of 28,672; counting one
    expert (``intermediate_size``, what the split used to read) gives the head a layer's worth more weight and
    another split."""
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 131072,
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
              "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    cfg = ModelConfig.from_hf(config, "Mixtral-8x7B/config.json")
    assert cfg.read_intermediate_size == 2 * 14336
    want = balanced_split(32, 4, *decode_weights(4096, 32, 8, 128, 2 * 14336, 131072))
    assert stage_ranges(cfg, 4, None) == want == [(0, 7), (7, 16), (16, 25), (25, 32)]
    assert balanced_split(32, 4, *decode_weights(4096, 32, 8, 128, 14336, 131072)) != want
    assert ModelDims.from_config(config, "m").layer_params == decode_weights(4096, 32, 8, 128, 2 * 14336, 131072)[0]


def test_int8_memory_counts_every_expert_too():
    """``--weights int8``: every expert stored at 1 B per weight plus its rows' scales, the same 128 experts."""
    dims = ModelDims.from_config(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    stored = weight_bytes(dims, resolve("int8", dims.parameters), LAYERS, False, False)
    assert stored == pytest.approx(LAYERS * (ATTENTION + ALL_EXPERTS), rel=0.01)


def test_an_fp16_moe_stage_counts_the_runtime_its_workers_were_measured_to_hold():
    """Real workers of an fp16 MoE build (compiler/planner.py ``UNPACKED_COPY_MOE``: 4 Qwen3-30B-A3B-shaped layers,
    2 stages) peaked at 14,373 MiB for a 3,757 MiB stage and 5,456 for 1,380, above the dense rule (320 MiB + 3x
    the weights); the MoE rule holds them. int8 MoE stages (3,827 and 1,431 MiB for 1,881 and 691) keep the dense
    rule; a dense model's plan is as it was."""
    mib = 1 << 20
    for stage, peak in ((3757, 14373), (1380, 5456)):
        assert stage * mib + runtime_bytes(stage * mib, "fp16") < peak * mib
        assert stage * mib + runtime_bytes(stage * mib, "fp16", moe=True) > peak * mib
    for stage, peak in ((1881, 3827), (691, 1431)):
        assert stage * mib + runtime_bytes(stage * mib, "int8", moe=True) > peak * mib
    moe = ModelDims.from_config(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    dense = ModelDims.from_config(QWEN3_30B_A3B | {"model_type": "qwen3"}, "dense")
    assert moe.moe and not dense.moe
    node = [nodes_from_capacities({"pc": Capacity(256 * GIB, "CPU", 20.0)}, moe)[0]]
    fp16, int8 = (plan(moe, node, fmt, max_context=4096, max_sessions=1) for fmt in ("fp16", "int8"))
    assert fp16.stages[0].runtime_bytes == runtime_bytes(fp16.stages[0].weight_bytes, "fp16", moe=True)
    assert int8.stages[0].runtime_bytes == runtime_bytes(int8.stages[0].weight_bytes, "int8")
    assert '"weights_factor": 3.0' in fp16.to_json() and "+ 3 x weights" in report_lines(fp16)[0]
    d = plan(dense, node, "fp16", max_context=4096, max_sessions=1)
    assert d.stages[0].runtime_bytes == runtime_bytes(d.stages[0].weight_bytes, "fp16")
