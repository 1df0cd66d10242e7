"""GGUF files of more architectures built straight into stages, their blocks kept, against transformers in f32
on the same file through its own GGUF loader (``from_pretrained(gguf_file=...)``: its dequantization, its
un-permutation, no code of ours).

Tiny random models written as llama.cpp's converter writes them (``test_gguf.write_tiny_gguf``: Q8_0, Q4_0 and
Q4_1 matrices through ``gguf.quants``, Q4_K and Q6_K blocks, an F16 matrix, F32 norms and biases, the demo's
tokenizer cut to its first 2048 tokens), each built by ``fleet-compiler build FILE.gguf --layers`` into 3 and 2
stages:

* mistral: GGUF architecture ``llama`` (llama.cpp converts ``MistralForCausalLM`` with ``LlamaModel``: Q/K rows
  permuted, no sliding-window key), head_dim 32 != hidden / heads = 16 (as Mistral-Nemo), written as
  ``llama.attention.key_length`` and ``llama.rope.dimension_count``. transformers loads the file as a llama
  (its Mistral path, taken only when ``general.name`` is exactly "mistral", fails with gguf-py 0.19); its
  weights then go into transformers' ``MistralForCausalLM`` (``as_mistral``).
* qwen2: q/k/v biases, tied head (no ``output.weight``), rows not permuted.
* qwen3: per-head q/k RMSNorm, head_dim 32 from ``qwen3.attention.key_length``. transformers 5.5's GGUF loader
  does not read that key for qwen3 (``GGUF_CONFIG_MAPPING["qwen3"]`` has no ``attention.key_length``), so it
  would keep ``Qwen3Config``'s default head_dim 128 and refuse the weights' shapes: the reference is loaded with
  ``head_dim`` given as a config override, read from the file by gguf-py; config and weights are otherwise
  transformers' own.
* llama3: ``rope_freqs.weight`` as llama.cpp computes it for Llama 3.1's scaling (``LlamaModel.
  generate_extra_tensors``: factor 8, low 1, high 4, original context 64 here). transformers' GGUF loader skips
  that tensor, so the reference config gets the ``llama3`` rope scaling it came from and transformers'
  ``_compute_llama3_parameters`` computes the frequencies: two implementations of one scaling.

Logits at every position of a 64-token sequence fed as a prefill and decode steps with rejected slots
(``test_architectures.chained_logits``), f32. Measured max |error| (the same for 3 and 2 stages): mistral 1.5e-5,
qwen2 1.2e-5, qwen3 2.1e-5, llama3 1.6e-5 on logits |max| 5.2-6.2; ``ATOL`` is ~5x the worst, and the smallest
top-2 gap of a reference (7.2e-4, mistral) is far above two logits' errors, so equal argmax is no near-tie.
Faults are far above it: the llama3 build against a reference without the scaling is off by 8.3.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler.gguf_read import read_gguf_file
from .test_architectures import SEQ, chained_logits
from .test_gguf import HEADS, HIDDEN, build, demo_gguf, transformers_logits, write_tiny_gguf  # noqa: F401

pytestmark = pytest.mark.integration

ATOL = 1e-4
VOCAB = 2048  # the demo tokenizer's first tokens (write_tiny_gguf vocab=): a small file parses in milliseconds
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPE_THETA = 10000.0  # write_tiny_gguf's rope.freq_base


def llama3_rope_freqs(head_dim: int) -> np.ndarray:
    """``rope_freqs.weight`` [head_dim / 2] f32 as llama.cpp's converter writes it for ``LLAMA3`` (convert_hf_to_gguf
    ``LlamaModel.generate_extra_tensors``): per frequency the divisor 1 (short wavelengths), ``factor`` (long) or
    1 / ((1 - s) / factor + s) between."""
    freqs = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = LLAMA3["factor"], LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"]
    old = LLAMA3["original_max_position_embeddings"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


CASES = {  # name -> (GGUF general.architecture, write_tiny_gguf options, head_dim)
    "mistral": ("llama", dict(head_dim=32, model_name="Mistral-Nemo-Tiny"), 32),
    "qwen2": ("qwen2", dict(tied=True), HIDDEN // HEADS),
    "qwen3": ("qwen3", dict(head_dim=32), 32),
    "llama3": ("llama", dict(rope_freqs=llama3_rope_freqs(HIDDEN // HEADS)), HIDDEN // HEADS),
}
LAYERS = {3: "0:1,1:3,3:4", 2: "0:2,2:4"}


class Zoo:
    """The module's GGUF files and transformers' logits on them, each made once, on first use."""

    def __init__(self, root: Path, demo: Path) -> None:
        self.root, self.demo = root, demo
        rng = np.random.default_rng(5)
        self.ids, self.garbage = rng.integers(0, VOCAB, SEQ), rng.integers(0, VOCAB, 16)

    @cache  # noqa: B019 - one Zoo per module
    def gguf(self, case: str) -> Path:
        arch, options, _ = CASES[case]
        path = self.root / case / f"{case}.gguf"
        path.parent.mkdir(parents=True)
        write_tiny_gguf(path, self.demo, arch=arch, vocab=VOCAB, **options)
        return path

    @cache  # noqa: B019
    def reference_logits(self, case: str) -> np.ndarray:
        import torch
        from transformers import AutoModelForCausalLM

        path = self.gguf(case)
        overrides = {}  # config fields transformers' GGUF loader does not read (module docstring)
        if case == "qwen3":
            overrides["head_dim"] = int(read_gguf_file(str(path)).fields["qwen3.attention.key_length"].contents())
        if case == "llama3":
            overrides["rope_parameters"] = {"rope_type": "llama3", "rope_theta": ROPE_THETA, **LLAMA3}
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     **overrides).eval()
        if case == "mistral":
            model = as_mistral(model)
        assert type(model).__name__ == {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[case]
        return transformers_logits(model, self.ids)


def as_mistral(llama):  # noqa: ANN001, ANN201 - transformers models
    """transformers' ``MistralForCausalLM`` with the weights of ``llama`` (transformers' load of a llama-architecture
    GGUF; its own Mistral path, taken when ``general.name`` is exactly "mistral", fails with gguf-py 0.19:
    "Unknown gguf model_type: mistral in gguf-py"). No sliding window, as llama.cpp runs Mistral files."""
    from transformers import MistralConfig, MistralForCausalLM

    c = llama.config
    config = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           max_position_embeddings=c.max_position_embeddings, rope_parameters=c.rope_parameters,
                           tie_word_embeddings=c.tie_word_embeddings, sliding_window=None)
    model = MistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_gguf) -> Zoo:  # noqa: F811 - demo_gguf is a fixture
    return Zoo(tmp_path_factory.mktemp("gguf-architectures"), demo_gguf)


def expected_kinds(case: str) -> dict[str, int]:
    """Tensors per stored form over all stages of a build of ``case`` (write_tiny_gguf's types: per layer q, o,
    up Q4_1, k, gate Q4_0, v Q8_0, down Q8_0 / Q8_0 / Q4_K / Q6_K, layer 1's up F16; a Q8_0 embedding, a Q4_1
    head unless tied, where the last stage holds the embedding a second time as its head)."""
    tied = case == "qwen2"
    extra_f32 = {"qwen2": 3 * 4, "qwen3": 2 * 4}.get(case, 0)  # q/k/v biases, q/k norms
    return {"Q8_0": 1 + 4 + 2 + tied, "Q4_0": 8, "Q4_1": 11 + (not tied), "Q4_K": 1, "Q6_K": 1, "f16": 1,
            "f32": 2 * 4 + 1 + extra_f32}


@pytest.mark.parametrize("stages", [3, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_stages_match_transformers(case, stages, zoo, tmp_path):
    """The build keeps the file's blocks (``expected_kinds``; nothing dequantized), records the head size, and its
    chained stages give transformers' f32 logits within ``ATOL``, with the same argmax everywhere."""
    _, _, head_dim = CASES[case]
    manifest = build(zoo.gguf(case), tmp_path / "build", "--layers", LAYERS[stages])
    assert len(manifest["stages"]) == stages
    assert manifest["architecture"]["head_dim"] == head_dim
    assert manifest["architecture"]["model_type"] == ("llama" if case in ("mistral", "llama3") else case)
    kinds: dict[str, int] = {}
    for stage in manifest["stages"]:
        assert stage["weights"] == "gguf" and stage["compression"]["dequantized_to_f16"] == {}, stage
        for kind, n in stage["compression"]["tensors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert kinds == expected_kinds(case), kinds
    got = chained_logits(tmp_path / "build", zoo.ids, zoo.garbage)
    expected = zoo.reference_logits(case)
    err = np.abs(got - expected).max()
    assert err < ATOL, f"{case}, {stages} stages: max |error| {err:.3g} (logits |max| {np.abs(expected).max():.3g})"
    assert (got.argmax(-1) == expected.argmax(-1)).all()
