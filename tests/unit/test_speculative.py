"""Speculative verification is lossless: greedy exactly, sampling in distribution (and a broken
residual is caught by the same check)."""

import numpy as np
import pytest

from coordinator.engine import speculative
from coordinator.engine.sampling import SparseDist, target_distribution
from coordinator.engine.speculative import AdaptiveK, StepCosts, StepCostsByLoad, expected_tokens, ngram_draft, verify

VOCAB = 6


def dist(probs) -> SparseDist:
    probs = np.asarray(probs, dtype=np.float64)
    return SparseDist(np.arange(len(probs)), probs / probs.sum())


def test_greedy_accepts_the_matching_prefix_then_corrects():
    targets = [SparseDist.point(t) for t in (5, 7, 9, 11)]
    drafts = [SparseDist.point(t) for t in (5, 7, 8)]
    assert verify([5, 7, 8], drafts, targets, [np.random.default_rng(0)] * 4) == [5, 7, 9]
    assert verify([5, 7, 9], [SparseDist.point(t) for t in (5, 7, 9)], targets, [np.random.default_rng(0)] * 4) == [5, 7, 9, 11]
    assert verify([4, 7, 9], drafts, targets, [np.random.default_rng(0)] * 4) == [5]


def test_target_distribution_matches_plain_sampling():
    ids = np.array([7, 3, 9, 1])
    logprobs = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert target_distribution(ids, logprobs, 0.0, 1.0).ids.tolist() == [7]
    d = target_distribution(ids, logprobs, 1.0, 0.8)
    assert d.ids.tolist() == [7, 3] and np.allclose(d.probs, [0.625, 0.375])


def first_two_tokens(draw, n: int, seed: int = 0) -> np.ndarray:
    """Empirical joint distribution [VOCAB, VOCAB] of the first two emitted tokens."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(n):
        a, b = draw(rng)
        counts[a, b] += 1
    return counts / n


# the target p: position 0 has p0; after token a, position 1 has p1[a]
P0 = dist([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
P1 = [dist(np.roll([0.4, 0.3, 0.1, 0.1, 0.05, 0.05], a)) for a in range(VOCAB)]
Q0 = dist([0.1, 0.4, 0.1, 0.3, 0.05, 0.05])  # a deliberately different draft
Q1 = [dist(np.roll([0.1, 0.1, 0.5, 0.1, 0.1, 0.1], a)) for a in range(VOCAB)]
EXACT = np.array([[P0.probs[a] * P1[a].probs[b] for b in range(VOCAB)] for a in range(VOCAB)])


def speculative_pair(rng):
    """Draft two tokens from q, verify them against p, emit until two tokens exist."""
    d0 = Q0.sample(rng)
    d1 = Q1[d0].sample(rng)
    # the target distribution after position 1 does not matter for the first two tokens
    out = verify([d0, d1], [Q0, Q1[d0]], [P0, P1[d0], P0], [rng] * 3)
    if len(out) == 1:  # rejected at position 0: the next token comes from p given the corrected one
        out.append(P1[out[0]].sample(rng))
    return out[0], out[1]


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


N = 40_000
BOUND = 0.02  # TV of N samples over 36 cells from their own distribution is ~0.01 here


def test_speculative_sampling_preserves_the_target_distribution():
    assert total_variation(first_two_tokens(speculative_pair, N), EXACT) < BOUND


def test_the_check_catches_a_wrong_residual(monkeypatch):
    # resampling from p instead of max(0, p - q) on rejection is the classic bug: it must fail the bound
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    assert total_variation(first_two_tokens(speculative_pair, N), EXACT) > BOUND


def test_verify_checks_lengths():
    with pytest.raises(ValueError, match="2 drafts need"):
        verify([1, 2], [P0, P0], [P0, P0], [np.random.default_rng(0)] * 3)


def test_point_mass_drafts_emit_exactly_what_plain_sampling_would():
    """Prompt-lookup drafts: with per-position rngs, speculation changes nothing in a seeded run."""
    targets = [P1[a] for a in range(4)]
    for seed in range(200):
        plain = [targets[i].sample(np.random.default_rng([seed, i])) for i in range(4)]
        for draft in ([plain[0], plain[1], 5], [2, 2, 2], plain[:3]):
            rngs = [np.random.default_rng([seed, i]) for i in range(4)]
            out = verify(draft, [SparseDist.point(t) for t in draft], targets, rngs)
            assert out == plain[:len(out)]


def test_ngram_draft():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3]
    assert ngram_draft(tokens, 3) == [4, 9, 1]  # "1 2 3" seen before, followed by 4 9 1
    assert ngram_draft(tokens, 1) == [4]
    assert ngram_draft([5, 6, 7], 4) == []
    assert ngram_draft([8, 8, 8], 2) == [8]  # latest earlier match of "8 8" is at 0, followed by one 8



def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def costs(per_token: float, fixed: float) -> StepCosts:
    c = StepCosts()
    for n in range(1, 10):
        c.observe(n, fixed + per_token * n)
    return c


def trained(policy: AdaptiveK, accept_rate: float, steps: int = 60) -> AdaptiveK:
    rng = np.random.default_rng(0)
    for _ in range(steps):
        k = max(policy.choose(), 1)
        accepted = 0
        while accepted < k and rng.random() < accept_rate:
            accepted += 1
        policy.observe(k, accepted)
    return policy


def test_good_drafts_draft_long_poor_drafts_stop():
    flat = costs(per_token=0.001, fixed=0.030)  # verify windows nearly free (docs/design-engine.md)
    assert trained(AdaptiveK(flat, 8), 0.9).choose() >= 6
    assert trained(AdaptiveK(flat, 8), 0.05).choose() == 0


def test_slow_links_draft_more():
    fast_link = costs(per_token=0.006, fixed=0.010)
    slow_link = costs(per_token=0.006, fixed=0.110)  # +100 ms of network per step
    k_fast = trained(AdaptiveK(fast_link, 8), 0.6).choose()
    k_slow = trained(AdaptiveK(slow_link, 8), 0.6).choose()
    assert k_slow > k_fast


def test_fixed_k_and_cold_start():
    assert AdaptiveK(StepCosts(), 8, fixed=3).choose() == 3
    assert AdaptiveK(StepCosts(), 8).choose() == 0  # no plain step measured yet


def test_costly_draft_drafts_less_than_free_draft():
    """A draft model as slow per token as a pipeline step cannot pay for itself on a fast link, but
    does on a slow one; prompt lookup (free) keeps drafting on the fast link."""
    fast = costs(per_token=0.001, fixed=0.025)
    slow = costs(per_token=0.001, fixed=0.150)
    for c in (fast, slow):
        c.observe_draft(4, 4 * 0.025)
    assert trained(AdaptiveK(fast, 8), 0.75).choose() == 0
    assert trained(AdaptiveK(slow, 8), 0.75).choose() >= 3
    assert trained(AdaptiveK(costs(per_token=0.001, fixed=0.025), 8), 0.75).choose() >= 3


def test_would_draft_says_whether_the_draft_should_prefill_now():
    """The engine prefills the draft beside the stages only when drafting pays on the measured costs:
    not before any step was measured, not for a draft as slow as a step on a fast link; yes on a slow
    link or with K pinned. Asking counts no probe."""
    assert not AdaptiveK(StepCosts(), 8).would_draft()
    assert AdaptiveK(StepCosts(), 8, fixed=2).would_draft()
    assert not AdaptiveK(StepCosts(), 8, fixed=0).would_draft()
    fast, slow = costs(per_token=0.001, fixed=0.025), costs(per_token=0.001, fixed=0.150)
    for c in (fast, slow):
        c.observe_draft(4, 4 * 0.025)
    assert AdaptiveK(slow, 8).would_draft()
    policy = AdaptiveK(fast, 8)
    for _ in range(100):
        assert not policy.would_draft()
    fresh = AdaptiveK(fast, 8)  # the asking counted no probe: its probes come when a fresh policy's do
    assert [policy.choose() for _ in range(40)] == [fresh.choose() for _ in range(40)]


def test_probes_only_where_some_context_could_pay():
    """Below break-even, plain decoding probes K = 1 every 16 steps (then 32, ...) so a changed context
    can win drafting back; but not where the draft loses even if every draft were accepted (a draft
    as slow per token as a step on a fast link: each probe would cost a draft prefill for nothing)."""
    fast = costs(per_token=0.001, fixed=0.025)
    fast.observe_draft(4, 4 * 0.025)
    assert [AdaptiveK(fast, 8).choose() for _ in range(300)] == [0] * 300
    slow = costs(per_token=0.001, fixed=0.150)
    slow.observe_draft(4, 4 * 0.025)
    policy = AdaptiveK(slow, 8, prior=(0.1, 10.0))  # a poor draft so far: plain decoding, with probes
    assert [policy.choose() for _ in range(16)] == [0] * 15 + [1]


def test_step_costs_follow_a_changed_link():
    """After the link slows down (+100 ms per step), the estimate follows within a few steps, even
    though every step since had the same length, and the policy drafts at least as long as before."""
    c = costs(per_token=0.002, fixed=0.020)
    assert abs(c.estimate(5) - (0.020 + 0.002 * 5)) < 1e-3
    k_fast = trained(AdaptiveK(c, 8), 0.8).choose()
    for _ in range(20):
        c.observe(5, 0.120 + 0.002 * 5)
    assert abs(c.estimate(5) - 0.130) < 5e-3
    assert trained(AdaptiveK(c, 8), 0.8).choose() > k_fast


def test_step_costs_are_kept_apart_by_load():
    """Steps of two interleaved users cost twice a lone user's, and a draft sharing cores with busy
    stages costs more: each load keeps its own estimate, so a lone request does not start from the
    busy fleet's costs (and draft into them)."""
    load = [1]
    by_load = StepCostsByLoad(lambda: load[0], max_load=4)
    for _ in range(20):
        by_load.observe(1, 0.015)
    by_load.observe_draft(1, 0.013)
    load[0] = 2
    assert by_load.estimate(1) is None and by_load.draft_seconds_per_token == 0.0
    for _ in range(20):
        by_load.observe(1, 0.030)
    by_load.observe_draft(1, 0.040)
    load[0] = 9  # counted as max_load: a fresh estimate, not load 2's
    assert by_load.estimate(1) is None
    load[0] = 1
    assert abs(by_load.estimate(1) - 0.015) < 1e-9 and abs(by_load.draft_seconds_per_token - 0.013) < 1e-9
    load[0] = 2
    assert abs(by_load.estimate(1) - 0.030) < 1e-9 and abs(by_load.draft_seconds_per_token - 0.040) < 1e-9
    assert AdaptiveK(by_load, 8).choose() == 0  # a draft dearer than a step: plain decoding at load 2
