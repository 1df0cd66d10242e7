"""The memory- and speed-aware planner (compiler/planner.py, compiler/nodes.py) and ``fleet-compiler plan``,
on SmolLM2-135M's dimensions; no model files needed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compiler.cli import main as compiler_main
from compiler.compress import resolve
from compiler.nodes import Node, parse_node, parse_size, read_nodes
from compiler.plan import balanced_split
from compiler.planner import (MIB, RUNTIME_FIXED_BYTES, ModelDims, PlanRefused, check_source, plan, read_plan,
                              record_devices, weight_bytes)
from fleet_common.manifest import DEVICES_FORMAT, load_manifest
from tests.unit.test_manifest import make

SMOL = ModelDims("SmolLM2-135M-Instruct", num_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                 head_dim=64, intermediate_size=1536, vocab_size=49152, max_context=8192, tied_embeddings=True)
CONFIG = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
          "tie_word_embeddings": True, "model_type": "llama"}
KV_PER_LAYER_TOKEN = 3 * 64 * 2 * 2  # KV heads x head dim x (K, V) x f16


def nodes(*specs: str) -> list[Node]:
    return [parse_node(s) for s in specs]


def test_fitting_plan_counts_weights_kv_and_runtime():
    p = plan(SMOL, nodes("a:4GiB", "b:4GiB"), max_context=1024, max_sessions=2)
    assert p.layers == "0:19,19:30"  # equal speeds: the balanced split fleet-compiler build --shards 2 makes
    assert [s.node.name for s in p.stages] == ["a", "b"]
    for s in p.stages:
        assert s.kv_bytes == 1024 * 2 * (s.end - s.start) * KV_PER_LAYER_TOKEN
        assert s.runtime_bytes == RUNTIME_FIXED_BYTES + 2 * s.weight_bytes  # fp16: an f32 copy on the CPU
        assert s.total_bytes == s.weight_bytes + s.kv_bytes + s.runtime_bytes <= s.node.memory_bytes
        assert s.ms_per_token is None  # relative speeds: no prediction in ms
    assert p.stages[0].weight_bytes == 191_146_752  # the real stage_0 .bin of the demo's 2-stage build: 191,147,072


def test_weight_bytes_match_the_demo_builds():
    """Per format, the model of a stage's weights against the .bin files of the demo's 2-stage (19 + 11 layers)
    and 1-stage builds (tied embedding stored once)."""
    measured = {"fp16": (191_147_072, 134_506_688), "int8": (96_082_372, 67_611_844), "int4": (73_557_380, 54_702_020)}
    for fmt, (first, last) in measured.items():
        spec = resolve(fmt, SMOL.parameters)
        assert weight_bytes(SMOL, spec, 19, True, False) == pytest.approx(first, rel=0.01), fmt
        assert weight_bytes(SMOL, spec, 11, False, True) == pytest.approx(last, rel=0.01), fmt
    assert weight_bytes(SMOL, resolve("fp16", 0), 30, True, True) == pytest.approx(269_030_336, rel=0.001)


def test_refusal_names_the_node_the_shortfall_and_fixes_that_fit():
    fleet = nodes("a:1GiB", "b:1GiB")
    with pytest.raises(PlanRefused) as info:
        plan(SMOL, fleet)  # 4 sessions x 8192 tokens: 432 MiB of KV for 18 layers
    refused = info.value
    assert refused.node == "a" and 200 * MIB < refused.shortfall_bytes < 300 * MIB
    text = str(refused)
    assert "node 'a' (1,024 MiB)" in text and f"short {refused.shortfall_bytes / MIB:,.0f} MiB" in text
    assert refused.fixes == ["1 more node(s) of 1,024 MiB like 'a'", "--weights int8", "--max-context 5376 (now 8192)",
                             "--max-sessions 2 (now 4)"]
    plan(SMOL, [fleet[0], dataclasses.replace(fleet[0], name="a+1"), fleet[1]])  # each fix fits
    plan(SMOL, fleet, weights="int8")
    plan(SMOL, fleet, max_context=5376)
    plan(SMOL, fleet, max_sessions=2)
    with pytest.raises(PlanRefused):
        plan(SMOL, fleet, max_context=5376 + 128)


def test_refusal_when_a_node_cannot_hold_one_layer():
    with pytest.raises(PlanRefused, match=r"node 'tiny' \(300 MiB\) cannot hold even one layer with the embedding: "
                                          r"it needs 502 MiB \(weights 61 \+ KV 0 \+ runtime 442\): "
                                          r"short 202 MiB") as info:
        plan(SMOL, nodes("tiny:300MiB", "big:8GiB"), max_context=256, max_sessions=1)
    assert info.value.node == "tiny"
    assert info.value.fixes == []  # nothing but memory helps a first node that cannot hold the embedding
    assert "give nodes more memory" in str(info.value)


def test_faster_node_gets_more_layers():
    even = plan(SMOL, nodes("a:8GiB", "b:8GiB"), max_context=1024)
    fast = plan(SMOL, nodes("a:8GiB:1", "b:8GiB:2:GPU"), max_context=1024)
    assert fast.layers == "0:12,12:30" and even.layers == "0:19,19:30"
    assert fast.stages[1].node.device == "GPU"
    assert fast.bottleneck.cost == pytest.approx(13.0)  # (18 layers + the head's 8) / 2
    measured = plan(SMOL, nodes("a:8GiB:0.4ms", "b:8GiB:0.2ms"), max_context=1024)  # same ratio, measured
    assert measured.layers == fast.layers
    assert [s.ms_per_token for s in measured.stages] == pytest.approx([12 * 0.4, 26 * 0.2])
    slow_first = plan(SMOL, nodes("a:8GiB:3", "b:8GiB:1"), max_context=1024)
    assert slow_first.stages[0].end - slow_first.stages[0].start > 19  # the fast first node takes more than 19


def test_kv_cache_is_counted():
    fleet = nodes("a:1GiB", "b:1GiB")
    short = plan(SMOL, fleet, max_context=512, max_sessions=4)
    assert short.stages[0].kv_bytes == 512 * 4 * 19 * KV_PER_LAYER_TOKEN
    with pytest.raises(PlanRefused, match="--max-context 5376"):
        plan(SMOL, fleet, max_context=8192, max_sessions=4)
    roomy = plan(SMOL, nodes("a:1GiB", "b:2GiB"), max_context=8192, max_sessions=4)
    assert roomy.stages[1].end - roomy.stages[1].start > 11  # memory, not speed, moves layers to the larger node


def test_bad_settings_are_refused():
    for kwargs, msg in [({"max_context": 9000}, "1..8192"), ({"max_sessions": 0}, "at least 1"),
                        ({"weights": "int2"}, "unknown weight format")]:
        with pytest.raises(ValueError, match=msg):
            plan(SMOL, nodes("a:8GiB"), **kwargs)
    with pytest.raises(ValueError, match="measured ms per layer"):
        plan(SMOL, nodes("a:8GiB:0.3ms", "b:8GiB:2"))
    with pytest.raises(ValueError, match="31 nodes"):
        plan(SMOL, [Node(f"n{i}", 1 << 30) for i in range(31)])
    with pytest.raises(ValueError, match="must differ"):
        plan(SMOL, nodes("a:8GiB", "a:8GiB"))


def test_split_with_speeds_and_memory_caps_is_optimal():
    """Against every split of small pipelines: the bottleneck is the least possible, caps are kept."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(300):
        layers, stages = rng.randint(1, 12), rng.randint(1, 4)
        stages = min(stages, layers)
        head = rng.uniform(0, 6)
        speeds = [rng.choice([0.5, 1, 2, rng.uniform(0.2, 4)]) for _ in range(stages)]
        caps = [rng.randint(1, layers) for _ in range(stages)]

        def cost(ranges):  # noqa: ANN001, ANN202
            return max(((b - a) + (head if i == stages - 1 else 0)) / speeds[i] for i, (a, b) in enumerate(ranges))

        splits = [list(zip((0, *cuts), (*cuts, layers)))
                  for cuts in itertools.combinations(range(1, layers), stages - 1)]
        allowed = [r for r in splits if all(b - a <= caps[i] for i, (a, b) in enumerate(r))]
        if not allowed:
            with pytest.raises(ValueError, match="cannot hold"):
                balanced_split(layers, stages, 1.0, head, speeds, caps)
            continue
        got = balanced_split(layers, stages, 1.0, head, speeds, caps)
        assert got in allowed and cost(got) == pytest.approx(min(cost(r) for r in allowed))


def test_node_specs_and_sizes():
    assert parse_size("8GiB") == parse_size("8G") == 8 << 30 and parse_size("8GB") == 8 * 10**9
    assert parse_size("512MiB") == 512 << 20 and parse_size("1.5g") == 3 << 29
    assert parse_node("pc1:16GiB:2:gpu") == Node("pc1", 16 << 30, 2.0, "GPU")
    assert parse_node("pc2:6G:0.31ms") == Node("pc2", 6 << 30, ms_per_layer=0.31)
    assert parse_node("pc3:6G::NPU") == Node("pc3", 6 << 30, device="NPU")
    for bad, msg in [("pc1", "NAME:MEM"), ("pc1:8", "needs a unit"), ("pc1:8GiB:fast", "could not convert"),
                     ("pc1:8GiB:1:TPU", "not CPU, GPU or NPU"), ("pc1:8GiB:-1", "positive"), (":8GiB", "non-empty")]:
        with pytest.raises(ValueError, match=msg):
            parse_node(bad)


def test_node_files(tmp_path):
    """JSON (list or {"nodes": [...]}), JSON Lines of fleet-worker --profile --json records, TOML; a profile
    taken on a stage with the LM head has the head's share taken out."""
    profile = {"name": "pc1", "device": "CPU", "memory_bytes": 8 << 30, "ms_per_layer": 0.5, "ms_per_token": 9.5,
               "layers": 19, "lm_head": False}
    whole = {**profile, "name": "pc2", "ms_per_layer": 0.5, "ms_per_token": 19.0, "layers": 30, "lm_head": True}
    (tmp_path / "a.json").write_text(json.dumps(profile) + "\n" + json.dumps(whole) + "\n")
    got = read_nodes(tmp_path / "a.json", SMOL.head_layers)
    assert got == [Node("pc1", 8 << 30, ms_per_layer=0.5), Node("pc2", 8 << 30, ms_per_layer=0.5)]  # 19 / (30 + 8)
    (tmp_path / "b.json").write_text(json.dumps({"nodes": [{"name": "x", "memory": "2GiB", "speed": 3}]}))
    assert read_nodes(tmp_path / "b.json", 8.0) == [Node("x", 2 << 30, 3.0)]
    (tmp_path / "c.toml").write_text('[[nodes]]\nname = "x"\nmemory = "2GiB"\ndevice = "gpu"\n'
                                     '[[nodes]]\nname = "y"\nmemory_bytes = 1024\n')
    assert read_nodes(tmp_path / "c.toml", 8.0) == [Node("x", 2 << 30, device="GPU"), Node("y", 1024)]
    (tmp_path / "d.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="node record 'x': no memory_bytes or memory"):
        read_nodes(tmp_path / "d.json", 8.0)
    (tmp_path / "e.json").write_text("not json")
    with pytest.raises(ValueError, match="neither JSON nor JSON Lines"):
        read_nodes(tmp_path / "e.json", 8.0)


def test_plan_file_round_trip_and_device_record(tmp_path):
    p = plan(SMOL, nodes("a:8GiB:1:GPU", "b:8GiB:2"), max_context=1024)
    (tmp_path / "plan.json").write_text(p.to_json())
    planned = read_plan(tmp_path / "plan.json")
    assert (planned.layers, planned.devices, planned.weights, planned.kv_cache_precision) == \
        (p.layers, ("GPU", "CPU"), "fp16", "f16")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG))
    check_source(planned, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 24}))
    with pytest.raises(ValueError, match="another model .*num_layers"):
        check_source(planned, tmp_path / "hf")

    raw = json.loads(p.to_json())
    raw["layers"] = "0:10,10:30"
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="not a usable plan"):
        read_plan(tmp_path / "bad.json")

    build = tmp_path / "build"
    build.mkdir()
    make(build)  # a 2-stage manifest, format 2
    record_devices(build, ("CPU", "CPU"))
    assert load_manifest(build).manifest.format == 2
    record_devices(build, ("GPU", "CPU"))
    manifest = load_manifest(build).manifest
    assert manifest.format == DEVICES_FORMAT and [s.device for s in manifest.stages] == ["GPU", "CPU"]


def test_plan_cli(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "plan.json"
    assert compiler_main(["plan", str(tmp_path / "hf"), "--node", "slow:4GiB:1:GPU", "--node", "fast:4GiB:2",
                          "--max-context", "1024", "--max-sessions", "2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "    0  slow         GPU      0:12" in text and "    1  fast         CPU     12:30" in text
    assert "fleet-worker --shard 1 --model BUILD --device CPU --max-context 1024 --kv-budget-mb 27" in text
    assert read_plan(out).layers == "0:12,12:30"

    assert compiler_main(["plan", str(tmp_path / "hf"), "--node", "a:1GiB", "--node", "b:1GiB"]) == 2
    err = capsys.readouterr().err
    assert "node 'a' (1,024 MiB)" in err and "short 255 MiB" in err and "--weights int8" in err

    assert compiler_main(["build", str(tmp_path / "hf"), "--plan", str(out), "--shards", "3", "-o",
                          str(tmp_path / "b")]) == 2
    assert "--plan sets the layer ranges" in capsys.readouterr().err
    assert compiler_main(["build", str(tmp_path / "hf"), "--plan", str(out), "--weights", "int4", "-o",
                          str(tmp_path / "b")]) == 2
    assert "--weights int4 differs from the plan's fp16" in capsys.readouterr().err


def test_moe_dims_count_every_expert_for_memory_and_the_chosen_for_speed():
    """Qwen3-30B-A3B's config: the fp16 weights counted are every expert's (30.5B parameters, as published),
    the per-token layer reads only its 8 chosen experts'."""
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
              "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False}
    dims = ModelDims.from_config(config, "Qwen3-30B-A3B")
    assert dims.intermediate_size == 8 * 768
    assert dims.parameters == pytest.approx(30.53e9, rel=0.002)
    assert weight_bytes(dims, resolve("fp16", 0), 48, True, True) == pytest.approx(2 * dims.parameters, rel=1e-4)
    assert dims.num_layers * dims.layer_params + 2 * dims.head_params == pytest.approx(3.3e9, rel=0.03)  # active


def test_sliding_window_layers_count_only_what_a_worker_reserves():
    """Gemma-3-1B's dimensions at 32K tokens: its 4 global layers count every token, its 22 local ones the
    2 x held_max slots a worker reserves for them (fleet_common/sliding_kv.py), about a fifth of the KV."""
    from fleet_common.sliding_kv import SlidingKV

    config = dict(model_type="gemma3_text", num_hidden_layers=26, hidden_size=1152, intermediate_size=6912,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                  max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6)
    dims = ModelDims.from_config(config, "gemma-3-1b")
    local = 2 * SlidingKV(512, frozenset()).held_max
    assert sum(dims.sliding_layers) == 22 and dims.local_slots == local
    assert [i for i, x in enumerate(dims.sliding_layers) if not x] == [5, 11, 17, 23]
    one = plan(dims, nodes("a:64GiB"), max_context=32768, max_sessions=1)
    slot = 1 * 256 * 2 * 2  # KV heads x head dim x K and V x f16
    assert one.stages[0].kv_bytes == (4 * 32768 + 22 * local) * slot
    full = plan(dataclasses.replace(dims, sliding_layers=()), nodes("a:64GiB"), max_context=32768, max_sessions=1)
    assert full.stages[0].kv_bytes == 26 * 32768 * slot > 4 * one.stages[0].kv_bytes


def test_each_stage_counts_the_kv_of_its_own_sliding_and_global_layers(tmp_path):
    """Split over two PCs (the second also holds the 262K-token head), each stage's KV is its own layers':
    [0, 19) holds the global layers 5, 11 and 17, [19, 26) only 23 (not the model's mean per layer times 19
    and 7); the plan survives its file (the per-layer flags as a JSON list)."""
    from fleet_common.sliding_kv import SlidingKV

    config = dict(model_type="gemma3_text", num_hidden_layers=26, hidden_size=1152, intermediate_size=6912,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                  max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6)
    dims = ModelDims.from_config(config, "gemma-3-1b")
    local, slot = 2 * SlidingKV(512, frozenset()).held_max, 256 * 2 * 2
    two = plan(dims, nodes("a:8GiB", "b:8GiB"), max_context=32768, max_sessions=1)
    for stage in two.stages:
        globals_ = sum(not dims.sliding_layers[j] for j in range(stage.start, stage.end))
        assert stage.kv_bytes == (globals_ * 32768 + (stage.end - stage.start - globals_) * local) * slot
    assert [(s.start, s.end) for s in two.stages] == [(0, 19), (19, 26)]
    (tmp_path / "plan.json").write_text(two.to_json())
    assert read_plan(tmp_path / "plan.json").dims == dims
