"""Every architecture the torch-free stage builder makes (compiler/arch.py) computes what transformers
computes: tiny random llama (``rope_scaling`` ``llama3``), llama_relu (ReGLU: ``hidden_act`` relu; its logits only, as
its graph is llama's but the MLP), mistral, qwen2 (q/k/v biases, tied head),
qwen3 (q/k RMSNorm, ``head_dim`` != hidden / heads), phi3 (fused ``qkv_proj``/``gate_up_proj``, sliding
window) and phi4mini (a ``Phi3Config`` shaped as Phi-4-mini: LongRoPE at 4x the original context, partial
rotary 0.75, tied head), qwen3moe (Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense by
``mlp_only_layers``) and qwen3moe_raw (top-2 weights as the softmax gives them, ``decoder_sparse_step`` 2: layers 1
and 3 sparse) models, 4 layers with grouped KV heads (4 query heads, 2 KV heads), made by transformers here and saved as safetensors in bf16 and in f32, then built
by ``compiler.build.build`` into 1, 2 and 3 stages.

* Logits: the stages chained in this process (OpenVINO CPU, f32 inference and f32 KV, one thread)
  over a 64-token sequence fed as a 40-token prefill and then chunks of 1-8 tokens, some followed by
  rejected "draft" tokens whose slots the next chunk hides (so past > 0, the physical-slot mask and
  logical positions that trail the physical slots are all exercised), against transformers' f32
  forward of the 64 tokens.
* Greedy: 32 tokens through a real 2-stage fleet (worker processes and coordinator) against
  transformers' greedy loop on the same prompt ids.
* ``fleet-compiler inspect``: every stage of each 2-stage build fuses stateful SDPA.
* Router: the experts each MoE layer's TopK picks for every token of the 64 are transformers' router's.

The reference sees exactly the weights a build stores: builds store fp16, so transformers loads the
saved folder in f32 and rounds every parameter to fp16 and back (``p.copy_(p.half().float())``). For
the bf16 source that is the bf16 weights upcast to f32 (bf16 -> fp16 is exact in fp16's normal range;
only the few weights below 6.1e-5 land on fp16 subnormals); for the f32 source it is the rounding the
build does. The logits then differ only by f32 arithmetic order (fused kernels against PyTorch's).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import BIN, Fleet, chat

pytestmark = pytest.mark.integration

VOCAB, MAX_POSITIONS, SEED = 49152, 128, 0  # the demo tokenizer's vocabulary (its chat template renders prompts)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # < max_position_embeddings: frequencies do change
ROTARY = int(COMMON["hidden_size"] // COMMON["num_attention_heads"] * 0.75)  # Phi-4-mini's partial rotary: 12 of 16
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 1.9, 2.6, 4.1, 7.5][:ROTARY // 2],  # per frequency, as Phi-4-mini's rise
            "long_factor": [1.0, 2.0, 5.0, 11.0, 23.0, 41.0][:ROTARY // 2]}  # unused: the build serves <= original
ARCHS = {  # name -> (transformers config class name, options on top of COMMON)
    "llama": ("LlamaConfig", dict(rope_scaling=LLAMA3_SCALING)),
    # ReGLU (hidden_act relu: ReluLLaMA, ProSparse, MiniCPM-S, the sparse FFN's models): llama's graph but the MLP
    "llama_relu": ("LlamaConfig", dict(hidden_act="relu")),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=96)),  # the build serves 96 (> 64 + 32 tokens)
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v biases always; tied as Qwen2.5-0.5B/1.5B
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # 4 x 32 query dims != 64 hidden
    "phi3": ("Phi3Config", dict(sliding_window=96)),  # fused qkv/gate_up; Phi-3-mini-4k's window (2047) cuts context
    # Phi-4-mini's shape: LongRoPE (4x the original context: attention factor 1.13), partial rotary 0.75, tied head
    "phi4mini": ("Phi3Config", dict(rope_parameters=LONGROPE, max_position_embeddings=4 * MAX_POSITIONS,
                                    original_max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True)),
    # Qwen3-MoE: qwen3's attention; 8 experts of 32, top-2; layer 1 dense (the MLP of intermediate_size)
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3moe_raw": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=False)),
}
MODEL_TYPE = {"phi4mini": "phi3", "qwen3moe": "qwen3_moe", "qwen3moe_raw": "qwen3_moe", "llama_relu": "llama"}
MLP_ONLY = ("llama_relu",)  # another MLP in llama's graph: its logits are tested, not again its fleet or fusion
MOE = {"qwen3moe": (0, 2, 3), "qwen3moe_raw": (1, 3)}  # -> its sparse layers  # names that are not their model_type
TIED = ("qwen2", "phi4mini")
DTYPES = ("bf16", "f32")
WEIGHT_STD = 0.15  # ~8x transformers' 0.02: logits of std ~1.2 and |max| ~6.5, not all near zero
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
STAGE_SPECS = {1: dict(shards=1), 2: dict(shards=2), 3: dict(layers="0:1,1:3,3:4")}  # 2 shards -> 0:3,3:4

SEQ = 64
# (tokens of the sequence, rejected draft tokens after them): the first is the prefill; each chunk's
# rejected tokens get the next logical positions and are hidden by the chunk after it, which reuses them
STEPS = ((40, 2), (1, 0), (1, 0), (3, 1), (1, 0), (5, 0), (1, 1), (1, 0), (2, 3), (1, 0), (8, 0))
assert sum(n for n, _ in STEPS) == SEQ and STEPS[-1][1] == 0
ATOL = 1e-4  # on logits of std ~1.2, |max| ~6.5: see test_stage_logits_match_transformers for why
NEW_TOKENS = 32
PROMPT = "What is the capital of France?"


def make_tiny_model(arch: str, folder: Path, demo_hf: Path) -> dict[str, Path]:
    """A random ``arch`` model saved as ``folder/<arch>-f32`` and ``folder/<arch>-bf16`` (same weights,
    the demo tokenizer and chat template beside them); returns {dtype: folder}.

    Weights ~N(0, WEIGHT_STD); norm weights 1 + N(0, 0.2) and biases N(0, 0.5), so that neither is the
    identity transformers initializes them to (ones, zeros) and the builder must really apply them."""
    import torch
    import transformers

    name, options = ARCHS[arch]
    config = getattr(transformers, name)(**{**COMMON, **options})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, WEIGHT_STD)
            elif "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p))
    out = {}
    for dtype in ("f32", "bf16"):  # f32 first: Module.to() converts in place
        path = folder / f"{arch}-{dtype}"
        model.to(torch.float32 if dtype == "f32" else torch.bfloat16).save_pretrained(path)
        for file in TOKENIZER:
            shutil.copy(demo_hf / file, path / file)
        out[dtype] = path
    return out


def reference_model(src: Path):  # noqa: ANN201 - a transformers model
    """transformers' model of ``src`` in f32 (eager attention), every weight rounded to fp16 and back:
    exactly the values a build stores."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation of ``prompt`` (KV cache on; never stops at end-of-sequence)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens: list[int] = []
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == new_tokens:
                return tokens
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def chained_logits(build: Path, ids: np.ndarray, garbage: np.ndarray) -> np.ndarray:
    """Logits [len(ids), V] of ``ids`` through every stage of ``build`` chained in this process (f32),
    fed in ``STEPS``; each step's rejected tokens come from ``garbage`` and are hidden by the next step."""
    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import KVSession, compile_ir, run_chunk

    stages = load_manifest(build).manifest.stages
    sessions = [KVSession(f"stage-{s.index}", compile_ir(build / s.xml, threads=1, inference_precision="f32")[0]
                          .create_infer_request(), MAX_POSITIONS) for s in stages]
    out, pos, hide = [], 0, []
    for n, rejected in STEPS:
        x = np.concatenate([ids[pos:pos + n], garbage[:rejected]])[None].astype(np.int64)
        for i, session in enumerate(sessions):
            last = i == len(sessions) - 1
            x, _ = run_chunk(session, "input_ids" if i == 0 else "hidden_states", x, session.length, pos, hide,
                             np.arange(n, dtype=np.int64) if last else None)
        out.append(x[0])
        slot = sessions[0].length  # physical slots used so far: logical positions trail them
        hide = list(range(slot - rejected, slot))
        pos += n
    assert sessions[0].length == SEQ + sum(r for _, r in STEPS)
    return np.concatenate(out)


class Zoo:
    """The module's tiny models, references and builds, each made once, on first use."""

    def __init__(self, root: Path, demo_hf: Path) -> None:
        self.root, self.demo_hf = root, demo_hf
        rng = np.random.default_rng(SEED)
        self.ids = rng.integers(3, VOCAB, SEQ)
        self.garbage = rng.integers(3, VOCAB, 8)

    @cache  # noqa: B019 - one Zoo per module
    def sources(self, arch: str) -> dict[str, Path]:
        return make_tiny_model(arch, self.root / "hf", self.demo_hf)

    @cache  # noqa: B019
    def reference(self, arch: str, dtype: str):  # noqa: ANN201
        return reference_model(self.sources(arch)[dtype])

    @cache  # noqa: B019
    def reference_logits(self, arch: str, dtype: str) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.reference(arch, dtype)(torch.from_numpy(self.ids)[None]).logits[0].numpy()

    @cache  # noqa: B019
    def build(self, arch: str, dtype: str, stages: int) -> Path:
        from compiler.build import build

        out = self.root / "builds" / f"{arch}-{dtype}-{stages}"
        build(self.sources(arch)[dtype], out, **STAGE_SPECS[stages])
        return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("architectures"), demo_hf)


def test_tiny_models_exercise_each_switch(zoo):
    """The tiny models have what their architecture is tested for: llama3-scaled RoPE frequencies (as
    the builder computes them and as transformers does), qwen2's biases and tied head (no lm_head
    tensor saved), qwen3's head_dim, mistral's and phi3's context cut to the sliding window, phi3's fused
    qkv_proj/gate_up_proj (split by the source), Phi-4-mini's LongRoPE short factors and attention factor
    (as transformers computes them) with 12 of 16 dims rotated, GQA everywhere."""
    from compiler.arch import ModelConfig
    from compiler.rope import rope_inv_freq
    from compiler.source import open_source
    from compiler.weights import SafetensorsWeights

    for arch in ARCHS:
        src = zoo.sources(arch)["bf16"]
        cfg = ModelConfig.from_folder(src)
        context = 96 if arch in ("mistral", "phi3") else MAX_POSITIONS  # past its sliding window not exact
        assert (cfg.model_type, cfg.num_layers, cfg.kv_groups, cfg.max_context) == \
            (MODEL_TYPE.get(arch, arch), 4, 2, context)
        rotary = zoo.reference(arch, "bf16").model.rotary_emb
        np.testing.assert_allclose(cfg.inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
        assert cfg.rotary_dim == (ROTARY if arch == "phi4mini" else cfg.head_dim)
        names = set(SafetensorsWeights(src).tensors)
        tied = arch in TIED
        assert ("lm_head.weight" in names) != tied and cfg.tie_word_embeddings == tied
        fused = "model.layers.0.self_attn.qkv_proj.weight" in names
        assert fused == cfg.fused == arch.startswith("phi") == ("model.layers.0.mlp.gate_up_proj.weight" in names)
        if fused:  # the source presents the fused weights' rows under the Llama names
            split = open_source(src, zoo.root).weights
            assert "model.layers.0.self_attn.qkv_proj.weight" not in split.tensors
            assert split.shape("model.layers.3.self_attn.k_proj.weight") == (2 * cfg.head_dim, cfg.hidden_size)
            assert split.shape("model.layers.3.mlp.up_proj.weight") == (cfg.intermediate_size, cfg.hidden_size)
        assert cfg.qkv_bias == (arch == "qwen2") and ("model.layers.0.self_attn.q_proj.bias" in names) == cfg.qkv_bias
        assert cfg.moe_layers == MOE.get(arch, ())
        assert cfg.mlp_act == ("relu" if arch == "llama_relu" else "silu")
        assert cfg.qk_norm == arch.startswith("qwen3") and ("model.layers.0.self_attn.q_norm.weight" in names) == cfg.qk_norm
    llama = ModelConfig.from_folder(zoo.sources("llama")["bf16"])
    default = rope_inv_freq({"rope_theta": 10000.0}, llama.head_dim)
    assert (np.abs(np.asarray(llama.inv_freq) / default - 1) > 0.1).sum() >= 4  # most frequencies scaled
    assert ModelConfig.from_folder(zoo.sources("qwen3")["bf16"]).head_dim * 4 != COMMON["hidden_size"]
    phi4 = ModelConfig.from_folder(zoo.sources("phi4mini")["bf16"])
    plain = rope_inv_freq({"rope_theta": 10000.0, "model_type": "phi3", "partial_rotary_factor": 0.75}, phi4.head_dim)
    np.testing.assert_allclose(np.asarray(phi4.inv_freq) * LONGROPE["short_factor"], plain, rtol=1e-6)
    assert phi4.rope_scale > 1.1  # sqrt(1 + ln 4 / ln 128)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_stage_logits_match_transformers(arch, dtype, stages, zoo):
    """Logits at all 64 positions, through the chained stages with rejected slots in between, are
    transformers' f32 logits within ``ATOL`` = 1e-4, and the argmax is the same at every position.

    Measured max |error| (bf16 / f32 source; the same for 1, 2 and 3 stages, as chaining f32 hidden
    states adds nothing): llama 1.3e-5 / 1.2e-5, mistral 1.2e-5 / 1.4e-5, qwen2 7.1e-6 / 7.9e-6, qwen3
    8.5e-6 / 8.8e-6, phi3 1.5e-5 / 1.1e-5, phi4mini 1.3e-5 / 1.3e-5, qwen3moe 4.8e-6 / 4.7e-6, qwen3moe_raw
    9.5e-6 / 7.9e-6 (2 stages; their smallest top-2 gap 2.1e-3). That is f32 rounding (eps 6e-8) accumulated over 4 layers of sums taken in another
    order (oneDNN's GEMMs and fused SDPA against PyTorch's eager ops); ``ATOL`` is ~7x the worst. Real
    faults are far above it: dropping the llama3 scaling moves the logits by 8.9, zeroing qwen2's q bias
    by 5.5, qwen3's k-norm weights set to 1 by 2.1, phi4mini without LongRoPE's attention factor by 7.4, leaving the rejected slots visible by 4-8, and a
    reference that does not round the f32 source's weights to fp16 is off by 0.016-0.022, so the
    tolerance even resolves fp16 rounding. The smallest top-2 gap of a reference is 9.3e-5 (mistral bf16),
    ~4x what the errors of two logits could close there (2 x 1.2e-5): argmax equality is no near-tie."""
    expected = zoo.reference_logits(arch, dtype)
    build = zoo.build(arch, dtype, stages)
    assert len(json.loads((build / "manifest.json").read_text())["stages"]) == stages
    got = chained_logits(build, zoo.ids, zoo.garbage)
    assert got.shape == expected.shape == (SEQ, VOCAB)
    err = np.abs(got - expected).max(axis=-1)
    assert err.max() < ATOL, f"{arch} {dtype} {stages} stage(s): max |error| {err.max():.3g} at position " \
                             f"{int(err.argmax())} (logits |max| {np.abs(expected).max():.3g})"
    wrong = np.flatnonzero(got.argmax(-1) != expected.argmax(-1))
    top2 = np.sort(expected[wrong], axis=-1)[:, -2:]  # a near-tie (gap ~ATOL) would be no bug: say which
    assert not wrong.size, f"argmax differs at positions {wrong.tolist()}, reference top-2 gaps " \
                           f"{(top2[:, 1] - top2[:, 0]).tolist()}"


def fleet_greedy(build: Path, tmp_path: Path, prompt: str, tokens: int) -> tuple[int, list[int]]:
    """A real 2-stage fleet of ``build`` (worker processes in f32, a coordinator): its prompt tokens and its
    ``tokens`` greedy token ids for the chat ``prompt``."""
    fleet = Fleet(build, tmp_path, peers=True)
    try:
        r = chat(fleet.url, prompt, max_tokens=tokens, ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
    finally:
        fleet.stop()
    return body["usage"]["prompt_tokens"], body["fleet"]["completion_token_ids"]


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch not in MLP_ONLY])
def test_fleet_greedy_matches_transformers(arch, zoo, tmp_path):
    """A real 2-stage fleet (worker processes in f32, coordinator) of the bf16 build answers the chat
    prompt with transformers' greedy tokens, id for id."""
    from coordinator.tokenizer import ChatTokenizer

    build = zoo.build(arch, "bf16", 2)
    prompt = ChatTokenizer(build).encode_chat([{"role": "user", "content": PROMPT}])
    assert len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference(arch, "bf16"), prompt, NEW_TOKENS)
    assert fleet_greedy(build, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch not in MLP_ONLY])
def test_inspect_reports_fused_attention(arch, zoo):
    """``fleet-compiler inspect`` finds one fused stateful SDPA per layer on both stages of each 2-stage build."""
    out = subprocess.run([str(BIN / "fleet-compiler"), "inspect", str(zoo.build(arch, "bf16", 2))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(row.endswith("ok") for row in rows), out.stdout
    assert "inspect: OK" in out.stdout


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_router_picks_match_transformers(arch, zoo):
    """The experts each sparse layer's TopK picks (the graph's own TopK outputs, exposed as extra outputs of
    the whole model as one stage, bf16 source, f32 inference) are, for every one of the 64 tokens, the top-k
    of transformers' router probabilities (``output_router_logits``); each layer picks 7 or 8 of its 8."""
    import openvino as ov
    import torch

    from compiler.arch import ModelConfig
    from compiler.export import StageSpec, export_stage
    from compiler.weights import SafetensorsWeights

    src = zoo.sources(arch)["bf16"]
    cfg = ModelConfig.from_folder(src)
    model = export_stage(cfg, SafetensorsWeights(src), StageSpec(0, 0, cfg.num_layers, cfg.num_layers))
    topks = [node for node in model.get_ordered_ops() if node.get_type_name() == "TopK"]
    assert len(topks) == len(cfg.moe_layers)
    model.add_outputs([node.output(1) for node in topks])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    ids = zoo.ids[None].astype(np.int64)
    out = compiled.create_infer_request().infer({"input_ids": ids, "attention_mask": np.ones_like(ids),
                                                 "position_ids": np.arange(SEQ)[None], "beam_idx": np.zeros(1, np.int32),
                                                 "logits_index": np.arange(SEQ)})
    got = [np.sort(out[compiled.outputs[1 + i]], axis=-1) for i in range(len(topks))]  # [SEQ, k] per layer
    with torch.no_grad():
        router = zoo.reference(arch, "bf16")(torch.from_numpy(zoo.ids)[None], output_router_logits=True).router_logits
    assert len(router) == len(cfg.moe_layers)
    for layer, picked, probs in zip(cfg.moe_layers, got, router):
        expected = np.sort(torch.topk(probs.float(), cfg.experts_per_token, dim=-1).indices.numpy(), axis=-1)
        wrong = np.flatnonzero((picked != expected).any(-1))
        assert not wrong.size, f"{arch} layer {layer}: other experts at positions {wrong.tolist()}"
        assert len(np.unique(picked)) >= cfg.num_experts - 1  # (qwen3moe's layer 0 never picks expert 3)
