"""Speculative sampling on real (tiny) models is distribution-preserving.

Two tiny random Llama models (vocab 48) are exported with the fleet exporter: the target, and a
different draft. Over many seeded samples, the first two tokens emitted by one speculative step
(the coordinator's ``DraftSession.propose`` -> target verify window -> ``verify``) are compared with
the exact target distribution by a chi-square goodness-of-fit test; breaking the residual on
purpose (resampling from p instead of max(0, p - q)) must fail the same test.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from coordinator import speculative
from coordinator.draft import DraftSession
from coordinator.sampling import target_distribution
from fleet_common.runtime import KVSession, compile_ir, run_chunk, top_candidates

pytestmark = pytest.mark.integration

VOCAB = 48
PROMPT = [3, 17, 5, 40, 22]
TEMPERATURE = 1.0
SAMPLES = 3000


def tiny_model(seed: int, path: Path, head_scale: float = 6.0) -> Path:
    """A 2-layer random Llama whose LM head is scaled up, so its next-token distributions are far from
    uniform (with seeds 0 and 1: acceptance sum(min(p, q)) ~0.56, TV(p, residual) ~0.33, so a wrong
    residual shifts the first token's distribution by TV ~0.15)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from compiler.build import save_whole_model

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path.parent / f"hf-{seed}")
    return save_whole_model(path.parent / f"hf-{seed}", path, "f32")


class Target:
    """The target as the fleet runs it: a stateful whole model returning top-k logprobs per position."""

    def __init__(self, xml: Path) -> None:
        self.compiled, _, _ = compile_ir(xml, threads=1, inference_precision="f32")
        self.kv = KVSession("t", self.compiled.create_infer_request(), 64)

    def reset(self) -> None:
        self.kv.reset()

    def step(self, tokens: list[int], position: int) -> list:
        """Feed ``tokens``; the target distributions at each of their positions."""
        x = np.asarray([tokens], dtype=np.int64)
        logits, _ = run_chunk(self.kv, "input_ids", x, self.kv.length, position, [],
                              np.arange(len(tokens), dtype=np.int64))
        ids, logprobs = top_candidates(logits[0], VOCAB)
        return [target_distribution(ids[i], logprobs[i], TEMPERATURE, 1.0) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Target, DraftSession]:
    tmp = tmp_path_factory.mktemp("tiny")
    target = Target(tiny_model(0, tmp / "target.xml"))
    draft_compiled, _, _ = compile_ir(tiny_model(1, tmp / "draft.xml"), threads=1, inference_precision="f32")
    draft = DraftSession(KVSession("d", draft_compiled.create_infer_request(), 64), 256, VOCAB, 0.5, 64)
    return target, draft


def exact_two_tokens(target: Target) -> tuple[np.ndarray, np.ndarray]:
    """p(first) [V] and the marginal of the second token sum_a p(a) p(. | a) [V]."""
    target.reset()
    p0 = target.step(PROMPT, 0)[-1]
    first = np.zeros(VOCAB)
    first[p0.ids] = p0.probs
    second = np.zeros(VOCAB)
    for a in range(VOCAB):
        if first[a] > 0:
            target.reset()
            pa = target.step([*PROMPT, a], 0)[-1]
            second[pa.ids] += first[a] * pa.probs
    return first, second


def speculative_samples(target: Target, draft: DraftSession, k: int) -> np.ndarray:
    """[SAMPLES, 2] first two tokens emitted after PROMPT with K drafts, as the engine does it."""
    n = len(PROMPT)
    out = np.zeros((SAMPLES, 2), dtype=np.int64)
    target.reset()
    target.step(PROMPT[:-1], 0)
    snapshot = [s.state.data.copy() for s in target.kv.request.query_state()]
    for seed in range(SAMPLES):
        for state, data in zip(target.kv.request.query_state(), snapshot):  # back to the prompt's KV
            state.state = ov.Tensor(data.copy())
        target.kv.length = n - 1
        draft.kv.reset()
        draft.n, draft.pending = 0, []
        tokens, qs = draft.propose(PROMPT, k, TEMPERATURE, 1.0, lambda pos: np.random.default_rng([seed, pos, 1]))
        ps = target.step([PROMPT[-1], *tokens], n - 1)
        emitted = speculative.verify(tokens, qs, ps, [np.random.default_rng([seed, n + i]) for i in range(k + 1)])
        if len(emitted) == 1:  # the next token by plain decoding, as the engine's following step would
            target.kv.visible[0, n:target.kv.length] = 0
            emitted.append(target.step([emitted[0]], n)[-1].sample(np.random.default_rng([seed, n + 1])))
        out[seed] = emitted[:2]
    return out


def chi_square_limit(dof: int, z: float = 3.72) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.72 is p = 1e-4 (one-sided)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic of ``samples`` against ``probs`` (rare cells pooled) and its degrees of freedom."""
    counts = np.bincount(samples, minlength=VOCAB).astype(float)
    expected = probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "broken-residual-caught"])
def test_speculative_sampling_matches_the_target(models, broken, monkeypatch):
    target, draft = models
    first, second = exact_two_tokens(target)
    if broken:
        monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    samples = speculative_samples(target, draft, k=2)
    results = [chi_square(samples[:, i], probs) for i, probs in enumerate((first, second))]
    fits = [stat < chi_square_limit(dof) for stat, dof in results]
    print(f"broken={broken}: (chi-square, dof) of tokens 1 and 2: {results}, "
          f"limits {[round(chi_square_limit(d), 1) for _, d in results]}")
    if broken:
        assert not all(fits), f"a wrong residual went unnoticed: {results}"
    else:
        assert all(fits), f"speculative sampling drifted from the target: {results}"
