"""Mixture-of-Experts GGUF files (issue 28 item 3): ``qwen3moe`` and Mixtral (GGUF ``llama`` with experts) built
straight into stages, against transformers in f32.

Tiny random models made by transformers (f32, 4 layers, 8 experts of 32, top-2 renormalised: ``Qwen3MoeForCausalLM``
with q/k norms and head_dim 32, every layer sparse as llama.cpp builds qwen3moe; ``MixtralForCausalLM``), written
as llama.cpp's converter writes them (convert_hf_to_gguf.py ``Qwen3MoeModel`` / ``LlamaModel``; names from gguf-py's
tensor_mapping): each layer's experts stacked into ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and
``ffn_down_exps`` [E, H, I] (numpy order), the router ``blk.N.ffn_gate_inp`` [E, H] F32, ``{arch}.expert_count``,
``.expert_used_count`` (and qwen3moe's ``.expert_feed_forward_length``); the llama file's Q/K rows permuted
(``permute``). Attention matrices Q8_0 / Q4_0 / Q4_1, experts (``EXPERT_KINDS``) Q4_0, Q4_1, Q8_0 (qwen3moe) and
Q8_0, Q5_1, F16 (mixtral): gguf-py ``gguf.quants``. A third, "qwen3moe-mxfp4", has its attention matrices, head
and experts in MXFP4 (gpt-oss's type). Every CPU stage multiplies the experts with fleet's ``GgufMoeMatMul`` over
the file's ``ffn_*_exps`` bytes (compiler/experts.py), the dense matrices with ``GgufMatMul``.

The reference is transformers' model of the HF config with every weight the file's value as gguf-py dequantizes it
(Q/K rows put back by this module's own inverse of the permutation): the build keeps every block as the file's
bytes (the F16 experts too).

* 1 stage, in this process: the whole model's logits at every one of 64 positions (f32 inference) and the experts
  each layer's TopK picks for every token, against transformers' logits and the top-2 of its router
  (``output_router_logits``). Measured max |error|: qwen3moe 3.6e-6, mixtral 6.6e-6 (its HF folder 6.9e-6) on
  logits |max| 5.3-6.0; ``ATOL`` is ~14x the worst. Faults are far above it (qwen3moe): the experts rounded to
  fp16 instead of kept in their blocks move the logits by 1.9e-3, top-2 weights not renormalised by 1.4. Each layer picks 4 to 8 of its 8 experts over the 64 tokens, every expert is picked
  in some layer.
* 2 stages through a real fleet (worker processes in f32, coordinator): transformers' greedy tokens, id for id;
  each expert constant of that build is the file's ``ffn_*_exps`` tensor byte for byte, no GatherMatmul is left.
* A file whose expert_count contradicts its stacked tensors is refused naming the tensor and the metadata.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from .test_architectures import COMMON, MAX_POSITIONS, PROMPT, SEED, SEQ, TOKENIZER, WEIGHT_STD, fleet_greedy, hf_greedy
from .test_gguf import add_demo_tokenizer, build, demo_gguf, demo_vocabulary, save_gguf  # noqa: F401

pytestmark = pytest.mark.integration

ATOL = 1e-4
VOCAB = 2048  # the demo tokenizer's first tokens and the merges among them (test_gguf.write_tiny_gguf's vocab=)
NEW_TOKENS = 16
EXPERTS, TOP_K, WIDTH = 8, 2, 32
MODELS = {  # name -> (transformers config class, options on top of test_architectures.COMMON, GGUF architecture)
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        moe_intermediate_size=WIDTH, norm_topk_prob=True), "qwen3moe"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=WIDTH,
                                      rope_theta=10000.0), "llama"),
}
KINDS = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "token_embd": "Q8_0",
         "output": "Q4_1"}
EXPERT_KINDS = {  # stacked experts' types: i4, u4 with offsets (the zero-point form), i8; i8, u8 with offsets, F16
    "qwen3moe": {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"},
    "mixtral": {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q5_1", "ffn_down_exps": "F16"},
}
ATTENTION = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
             "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
EXPERT_NAMES = {"qwen3moe": ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
                "mixtral": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"})}


def make_moe_model(name: str, folder: Path, demo_hf: Path) -> Path:
    """A random ``name`` model (``MODELS``) saved in f32 as ``folder/name`` with the demo tokenizer; weights
    ~N(0, WEIGHT_STD), norms 1 + N(0, 0.2) (test_architectures.make_tiny_model's rule)."""
    import torch
    import transformers

    cls, options, _ = MODELS[name]
    config = getattr(transformers, cls)(**{**COMMON, "vocab_size": VOCAB, **options})
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else WEIGHT_STD * torch.randn_like(p))
    path = folder / name
    model.save_pretrained(path)
    for file in TOKENIZER:
        shutil.copy(demo_hf / file, path / file)
    return path


def write_moe_gguf(hf: Path, path: Path, demo: Path, expert_count: int | None = None, legacy: bool = False,
                   mxfp4: bool = False) -> None:
    """The f32 HF folder ``hf`` as llama.cpp's converter writes it (module docstring); ``expert_count`` written
    instead of the true one when given (a broken file); with ``legacy`` one tensor per expert,
    ``blk.N.ffn_gate.E.weight``, as converters wrote Mixtral before stacking; with ``mxfp4`` every matrix but the
    embedding (and the F32 router) MXFP4."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf / "config.json").read_text())
    name = config["model_type"].replace("qwen3_moe", "qwen3moe")
    arch = MODELS[name][2]
    tensors = load_file(str(hf / "model.safetensors"))
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_expert_count(expert_count or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    tokens, merges, types, template = demo_vocabulary(str(demo))
    tokens, types, kept = tokens[:VOCAB], types[:VOCAB], set(tokens[:VOCAB])
    merges = [m for m in merges if (pair := m.split(" "))[0] in kept and pair[1] in kept and "".join(pair) in kept]
    add_demo_tokenizer(writer, (tokens, merges, types, template))

    def add(gguf_name: str, w: np.ndarray, kind: str = "F32") -> None:
        if mxfp4 and kind != "F32" and gguf_name != "token_embd.weight":
            kind = "MXFP4"
        if kind == "F32":
            writer.add_tensor(gguf_name, w.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(gguf_name, w.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], KINDS["token_embd"])
    add("output_norm.weight", tensors["model.norm.weight"])
    add("output.weight", tensors["lm_head.weight"], KINDS["output"])
    module, experts = EXPERT_NAMES[name]
    for i in range(layers):
        p = f"model.layers.{i}."
        for role, hf_name in ATTENTION.items():
            w = tensors.get(f"{p}self_attn.{hf_name}.weight")
            if w is None:
                continue
            if arch == "llama" and role in ("attn_q", "attn_k"):  # LlamaModel.permute
                w = permute(w, heads if role == "attn_q" else kv_heads)
            add(f"blk.{i}.{role}.weight", w, KINDS.get(role, "F32"))
        for role, hf_name in NORMS.items():
            add(f"blk.{i}.{role}.weight", tensors[f"{p}{hf_name}.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", tensors[f"{p}{module}.gate.weight"])
        for role, hf_name in experts.items():  # torch.stack(datas, dim=0), as the converter merges them
            each = [tensors[f"{p}{module}.experts.{e}.{hf_name}.weight"] for e in range(EXPERTS)]
            if legacy:
                for e, w in enumerate(each):
                    add(f"blk.{i}.{role[:-5]}.{e}.weight", w, EXPERT_KINDS[name][role])
            else:
                add(f"blk.{i}.{role}.weight", np.stack(each), EXPERT_KINDS[name][role])
    save_gguf(writer)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``): rows [heads, 2, D/2] to
    [heads, D/2, 2], interleaving each head's two rotary halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's Q/K row permutation: rows [heads, D/2, 2] back to [heads, 2, D/2]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reference(hf: Path, path: Path):  # noqa: ANN201 - a transformers model
    """transformers' model of ``hf``'s config in f32 (eager attention), its weights the GGUF's as gguf-py dequantizes
    them (module docstring). transformers 5 holds a layer's experts as
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj`` [E, H, I]."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    llama = read_gguf_file(str(path)).fields["general.architecture"].contents() == "llama"
    values = {}
    for t in read_gguf_file(str(path)).tensors:
        w = np.array(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type)), np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if llama and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute(w, config.num_attention_heads if "attn_q" in t.name else config.num_key_value_heads)
        values[t.name] = w
    for i in range(config.num_hidden_layers):  # the older layout's experts, stacked as the newer file has them
        for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            if f"blk.{i}.{role}.weight" not in values:
                values[f"blk.{i}.{role}.weight"] = np.stack([values[f"blk.{i}.{role[:-5]}.{e}.weight"]
                                                             for e in range(EXPERTS)])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    roles = {f"self_attn.{v}.weight": k for k, v in ATTENTION.items()} | {f"{v}.weight": k for k, v in NORMS.items()}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for pname, p in params.items():
            if pname in top:
                w = values[top[pname]]
            else:
                _, _, i, rest = pname.split(".", 3)
                b = f"blk.{i}."
                if rest == "mlp.gate.weight":
                    w = values[b + "ffn_gate_inp.weight"]
                elif rest == "mlp.experts.gate_up_proj":
                    w = np.concatenate([values[b + "ffn_gate_exps.weight"], values[b + "ffn_up_exps.weight"]], axis=1)
                elif rest == "mlp.experts.down_proj":
                    w = values[b + "ffn_down_exps.weight"]
                else:
                    w = values[f"{b}{roles[rest]}.weight"]
            p.copy_(torch.from_numpy(w.reshape(p.shape)))
    return model


class Zoo:
    """The module's models, GGUF files and references, each made once, on first use."""

    def __init__(self, root: Path, demo_hf: Path, demo: Path) -> None:
        self.root, self.demo_hf, self.demo = root, demo_hf, demo
        self.ids = np.random.default_rng(11).integers(3, VOCAB, SEQ)

    @cache  # noqa: B019 - one Zoo per module
    def hf(self, name: str) -> Path:
        return make_moe_model(name, self.root / "hf", self.demo_hf)

    @cache  # noqa: B019
    def gguf(self, case: str) -> Path:
        """The GGUF of ``case``: a ``MODELS`` name, or "mixtral-legacy" (one tensor per expert)."""
        path = self.root / case / f"{case}.gguf"
        path.parent.mkdir(parents=True)
        write_moe_gguf(self.hf(case.split("-")[0]), path, self.demo, legacy=case.endswith("-legacy"),
                       mxfp4=case.endswith("-mxfp4"))
        return path

    @cache  # noqa: B019
    def reference(self, case: str):  # noqa: ANN201 - a transformers model
        return gguf_reference(self.hf(case.split("-")[0]), self.gguf(case))

    @cache  # noqa: B019
    def build(self, case: str) -> tuple[Path, dict]:
        """The GGUF of ``case`` built by ``fleet-compiler build --layers 0:2,2:4`` (both stages on the CPU): its
        folder and manifest."""
        out = self.root / case / "build"
        return out, build(self.gguf(case), out, "--layers", "0:2,2:4")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf, demo_gguf) -> Zoo:  # noqa: F811 - demo_gguf is a fixture
    return Zoo(tmp_path_factory.mktemp("gguf-moe"), demo_hf, demo_gguf)


def check_one_stage(name: str, cfg, weights, reference, ids: np.ndarray, keep_blocks: bool) -> Counter:  # noqa: ANN001
    """The whole model of ``cfg`` as one CPU stage of fleet's kernels from ``weights`` (f32 inference) against the
    transformers model ``reference`` on ``ids``: every layer's three expert matrices ``GgufMoeMatMul`` nodes (no
    OpenVINO expert form: no Tile of the tokens over the experts, no GatherMatmul), logits at every position within
    ``ATOL`` with the same argmax, and each layer's TopK picks, for every token, the top-k of transformers' router
    (``output_router_logits``); every expert is picked somewhere, so each one's blocks are checked. Returns the
    element types the compiled model's FullyConnected and GatherMatmul nodes hold their weights in, ``Counter`` of
    (layer type, type name)."""
    import torch

    from compiler.export import StageSpec, export_stage
    from fleet_common.runtime import compile_config

    from fleet_common.runtime import kernels_at, stage_core

    # a CPU stage: a GGUF's dense matrices for fleet's kernels, an HF folder's too (its fp16 build)
    model = export_stage(cfg, weights, StageSpec(0, 0, cfg.num_layers, cfg.num_layers), keep_blocks=keep_blocks,
                         kernels=True)
    topks = [node for node in model.get_ordered_ops() if node.get_type_name() == "TopK"]
    assert len(topks) == cfg.num_layers
    ops = Counter(node.get_type_name() for node in model.get_ordered_ops())
    assert ops["GgufMoeMatMul"] == 3 * cfg.num_layers and not ops["Tile"], f"{name}: {ops}"
    model.add_outputs([node.output(1) for node in topks])
    # f32 as a stage runs it: fleet's kernels exact, the dynamic quantization of activations off
    compiled = stage_core().compile_model(kernels_at(model, "f32"), "CPU",
                                          compile_config(threads=1, inference_precision="f32"))
    kinds = Counter(n.get_rt_info()["layerType"].astype(str) for n in compiled.get_runtime_model().get_ordered_ops())
    assert not kinds["GatherMatmul"], f"{name}: {kinds}"
    batch = ids[None].astype(np.int64)
    out = compiled.create_infer_request().infer({"input_ids": batch, "attention_mask": np.ones_like(batch),
                                                 "position_ids": np.arange(SEQ)[None], "beam_idx": np.zeros(1, np.int32),
                                                 "logits_index": np.arange(SEQ)})
    with torch.no_grad():
        ref = reference(torch.from_numpy(ids)[None], output_router_logits=True)
    expected, got = ref.logits[0].numpy(), out[compiled.outputs[0]][0]
    err = np.abs(got - expected).max()
    assert err < ATOL, f"{name}: max |error| {err:.3g} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    assert len(ref.router_logits) == cfg.num_layers
    used: set[int] = set()
    for layer, probs in enumerate(ref.router_logits):
        picked = np.sort(out[compiled.outputs[1 + layer]], axis=-1)  # [SEQ, k]
        want = np.sort(torch.topk(probs.float(), TOP_K, dim=-1).indices.numpy(), axis=-1)
        wrong = np.flatnonzero((picked != want).any(-1))
        assert not wrong.size, f"{name} layer {layer}: other experts at positions {wrong.tolist()}"
        used.update(np.unique(picked).tolist())
    assert used == set(range(EXPERTS))
    return Counter((kind, node.input(1).get_source_output().get_element_type().get_type_name())
                   for node in compiled.get_runtime_model().get_ordered_ops()
                   if (kind := node.get_rt_info()["layerType"].astype(str)) in ("FullyConnected", "GatherMatmul"))


@pytest.mark.parametrize("case", [*MODELS, "mixtral-legacy", "qwen3moe-mxfp4"])
def test_moe_gguf_logits_and_router_picks_match_transformers(case, zoo):
    """The GGUF's config is the HF folder's (experts, top-k, expert width, sparse layers, renormalised), and the
    whole model as one stage (every block kept, the experts' for ``GgufMoeMatMul``) gives transformers' logits on
    the file's values and its router's picks (``check_one_stage``); also for a Mixtral file of one tensor per
    expert, and for a qwen3moe file in MXFP4, all of whose matrices fleet's kernels multiply (the router F32, the
    one FullyConnected a layer)."""
    from compiler.arch import ModelConfig
    from compiler.source import open_source


    name = case.split("-")[0]
    names = {t.name for t in read_gguf_file(str(zoo.gguf(case))).tensors}
    assert ("blk.3.ffn_down.7.weight" in names) == case.endswith("-legacy") != ("blk.3.ffn_down_exps.weight" in names)
    source = open_source(zoo.gguf(case), zoo.root / "work" / case)
    cfg, hf = source.config, ModelConfig.from_folder(zoo.hf(name))
    assert cfg.model_type == hf.model_type == {"qwen3moe": "qwen3_moe", "mixtral": "mixtral"}[name]
    assert (cfg.moe_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.norm_topk_prob) == \
        (hf.moe_layers, hf.num_experts, hf.experts_per_token, hf.moe_intermediate_size, hf.norm_topk_prob) == \
        ((0, 1, 2, 3), EXPERTS, TOP_K, WIDTH, True)
    assert cfg.head_dim == hf.head_dim and cfg.qk_norm == (name == "qwen3moe")
    weights = check_one_stage(case, cfg, source.weights, zoo.reference(case), zoo.ids, keep_blocks=True)
    if case.endswith("-mxfp4"):  # q, k, v, o, the experts and the head are fleet's kernels'; the router's f32 (F32)
        assert weights == {("FullyConnected", "f32"): cfg.num_layers}, weights


def test_mixtral_hf_folder_matches_transformers(zoo):
    """An HF Mixtral folder (``block_sparse_moe.gate``, ``experts.{e}.w1/w2/w3`` as transformers saves them) builds:
    as one stage, transformers' logits (every weight rounded to fp16, as the build stores them) and router picks."""
    from compiler.arch import ModelConfig
    from compiler.weights import SafetensorsWeights

    from .test_architectures import reference_model

    src = zoo.hf("mixtral")
    cfg = ModelConfig.from_folder(src)
    assert (cfg.model_type, cfg.moe_layers, cfg.moe_intermediate_size, cfg.norm_topk_prob) == \
        ("mixtral", (0, 1, 2, 3), WIDTH, True)
    check_one_stage("mixtral (HF)", cfg, SafetensorsWeights(src), reference_model(src), zoo.ids, keep_blocks=False)


@pytest.mark.parametrize("name", list(MODELS))
def test_moe_gguf_fleet_greedy_matches_transformers(name, zoo, tmp_path):
    """A 2-stage build of the GGUF (``fleet-compiler build``) records every expert kept in its type, nothing
    dequantized; a real fleet of it (worker processes in f32, coordinator) answers the chat prompt with
    transformers' greedy tokens on the file's values, id for id."""
    from coordinator.tokenizer import ChatTokenizer

    out, manifest = zoo.build(name)
    assert manifest["architecture"]["model_type"] == {"qwen3moe": "qwen3_moe", "mixtral": "mixtral"}[name]
    for stage in manifest["stages"]:
        compression = stage["compression"]
        assert compression["dequantized_to_f16"] == {}, compression
        kinds = {kind: n for kind, n in compression["tensors"].items() if kind not in ("f32", "Q4_1")}
        want = {"Q8_0": 2 * 2 + (stage["index"] == 0), "Q4_0": 2}  # 2 layers a stage: q, v, k; the embedding
        for kind in EXPERT_KINDS[name].values():  # 8 experts a matrix a layer
            want[kind.replace("F16", "f16")] = want.get(kind.replace("F16", "f16"), 0) + 2 * EXPERTS
        assert kinds == {k: n for k, n in want.items() if k != "Q4_1"}, compression
    prompt = ChatTokenizer(out).encode_chat([{"role": "user", "content": PROMPT}])
    assert len(prompt) + NEW_TOKENS <= MAX_POSITIONS
    expected = hf_greedy(zoo.reference(name), prompt, NEW_TOKENS)
    assert fleet_greedy(out, tmp_path, PROMPT, NEW_TOKENS) == (len(prompt), expected)


@pytest.mark.parametrize("name", list(MODELS))
def test_moe_cpu_stages_multiply_the_experts_bytes_as_they_lie(name, zoo):
    """A CPU build of the GGUF multiplies each layer's experts with fleet's ``GgufMoeMatMul``: three a layer (gate,
    up, down), each over a u8 constant whose bytes in the stage's ``.bin`` are the file's ``ffn_*_exps`` tensor
    (sha256), in its type (Q4_0, Q4_1, Q8_0; Q8_0, Q5_1, F16); no OpenVINO expert form is left (no Tile of the
    tokens over the experts in the IR, no GatherMatmul in the compiled stage); each manifest entry names the
    kernels' version."""
    from fleet_common.kernels import KERNELS_VERSION
    from fleet_common.runtime import compile_ir

    from .gguf_bytes import assert_experts_are_gguf_bytes

    out, manifest = zoo.build(name)
    assert [stage["kernels"] for stage in manifest["stages"]] == [KERNELS_VERSION] * 2
    assert assert_experts_are_gguf_bytes(out, zoo.gguf(name)) == 3 * 4
    for stage in manifest["stages"]:
        xml = (out / stage["xml"]).read_text()
        assert xml.count('type="GgufMoeMatMul"') == 3 * 2 and 'type="Tile"' not in xml, stage["xml"]
        compiled = compile_ir(out / stage["xml"], threads=1)[0]
        runtime = compiled.get_runtime_model().get_ordered_ops()
        kinds = Counter(n.get_rt_info()["layerType"].astype(str) for n in runtime)
        assert not kinds["GatherMatmul"], kinds
        print(stage["xml"], dict(kinds))


def test_moe_gguf_whose_expert_count_contradicts_its_tensors_is_refused(zoo, tmp_path):
    """A qwen3moe file saying 4 experts whose stacked tensors hold 8 is one error naming the file, the tensor, its
    shape and the metadata, before any weight is read."""
    from compiler.source import open_source
    from compiler.weights import WeightsError

    path = tmp_path / "broken.gguf"
    write_moe_gguf(zoo.hf("qwen3moe"), path, zoo.demo, expert_count=4)
    with pytest.raises(WeightsError, match=rf"^{path}: tensor blk\.0\.ffn_gate_inp\.weight has shape \[8, 64\], but "
                                           r"the metadata \(expert_count 4, .*\) gives \[4, 64\]"):
        open_source(path, tmp_path / "work")
