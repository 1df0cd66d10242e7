"""Speculative decoding, the pure parts: draft proposals and lossless verification.

Verification follows speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling"): draft token x is accepted with probability min(1, p(x) / q(x)); on the first rejection
the token is drawn from the normalized residual max(0, p - q); when every draft is accepted one
bonus token is drawn from the target's next distribution. The output then has exactly the target's
distribution. Greedy decoding is the special case where p and q are point masses.

Distributions here are sparse (``SparseDist``): the target's comes from the last stage's top-k
candidates after temperature and top-p, the very distribution plain decoding samples from, so
speculation is lossless with respect to non-speculative decoding.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from .sampling import SparseDist


def residual(p: SparseDist, q: SparseDist) -> SparseDist:
    """normalize(max(0, p - q)); ``p`` itself when the residual has no mass (p <= q everywhere)."""
    mass = np.maximum(p.probs - np.array([q.prob(int(t)) for t in p.ids]), 0.0)
    total = mass.sum()
    if total <= 1e-12:
        return p
    keep = mass > 0
    return SparseDist(p.ids[keep], mass[keep] / total)


def verify(draft_tokens: Sequence[int], draft_dists: Sequence[SparseDist], target_dists: Sequence[SparseDist],
           rngs: Sequence[np.random.Generator]) -> list[int]:
    """Accept a prefix of the drafts and add one token: the tokens to emit, 1..K+1 of them.

    ``draft_tokens`` [K] were proposed from ``draft_dists`` [K] (q); ``target_dists`` [K+1] (p) are the
    target's distributions at each draft position plus the one after the last draft; ``rngs`` [K+1]
    one generator per position (the engine seeds them by (seed, position), so a seeded run does not
    depend on K). A point-mass draft (prompt lookup) is verified by drawing y ~ p and accepting iff
    y == x: accepted with probability p(x), and a rejected y is distributed as the residual, so this
    is speculative sampling that emits exactly the tokens plain sampling would with the same rngs.
    Raises ``ValueError`` when the lengths do not line up.
    """
    k = len(draft_tokens)
    if len(draft_dists) != k or len(target_dists) != k + 1 or len(rngs) != k + 1:
        raise ValueError(f"{k} drafts need {k} draft, {k + 1} target distributions and {k + 1} rngs, "
                         f"got {len(draft_dists)}, {len(target_dists)} and {len(rngs)}")
    out: list[int] = []
    for token, q, p, rng in zip(draft_tokens, draft_dists, target_dists, rngs):
        if len(q.ids) == 1:
            y = p.sample(rng)
            out.append(y)
            if y != int(token):
                return out
            continue
        px, qx = p.prob(token), q.prob(token)
        if qx > 0.0 and rng.random() < min(1.0, px / qx):
            out.append(int(token))
            continue
        out.append(residual(p, q).sample(rng))
        return out
    out.append(target_dists[k].sample(rngs[k]))
    return out


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt-lookup drafting (Saxena 2023): find the latest earlier occurrence of the context's last
    n tokens (longest n first, ``max_ngram`` down to ``min_ngram``) and propose the up to ``k`` tokens
    that followed it. Returns [] when nothing matches. Its draft distribution is a point mass.
    """
    n_tokens = len(tokens)
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = arr[n_tokens - n:]
        # candidate starts j with arr[j:j+n] == tail and j + n < n_tokens (something follows)
        for j in range(n_tokens - n - 1, -1, -1):
            if np.array_equal(arr[j:j + n], tail):
                return arr[j + n: j + n + k].tolist()
    return []


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens emitted by one verify step with ``k`` drafts when each draft is accepted
    independently with probability ``acceptance``: (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class StepCosts:
    """Measured wall time (seconds) of one pipeline step as a function of its chunk length L, modelled
    as ``fixed + per_token (L - 1)``. ``fixed`` (network hops, per-step overheads) follows the link
    quickly (moving average, ``smoothing``). ``per_token`` (compute per extra token, a property of
    the stages) is fitted by least squares over the last ``window`` steps, and only when their lengths
    vary: a run of equal-length steps says nothing about it, so a link that slows down during such a
    run shows up in ``fixed`` alone. Shared by all sessions: it describes the fleet and its links,
    not a session. Also keeps the draft's cost per proposed token.
    """

    def __init__(self, smoothing: float = 0.2, window: int = 16) -> None:
        self.smoothing = smoothing
        self.fixed: float | None = None
        self.per_token: float | None = None
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.draft_seconds_per_token = 0.0  # proposing one draft token (0 for prompt lookup)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """Record the time the draft took to propose ``tokens`` tokens."""
        if tokens > 0:
            per = seconds / tokens
            old = self.draft_seconds_per_token
            self.draft_seconds_per_token = per if old == 0.0 else old + self.smoothing * (per - old)

    def observe(self, length: int, seconds: float) -> None:
        """Record one step of ``length`` tokens that took ``seconds``."""
        self._recent.append((length - 1, seconds))
        lengths = [r[0] for r in self._recent]
        # a variance >= 1 needs lengths 2 apart; checked first, the numpy below costs ~30 us a step
        if max(lengths) - min(lengths) >= 2 and (x := np.array(lengths, dtype=np.float64)).var() >= 1.0:
            t = np.array([r[1] for r in self._recent])
            slope = max(0.0, float(((x - x.mean()) * (t - t.mean())).sum() / ((x - x.mean()) ** 2).sum()))
            self.per_token = slope if self.per_token is None else self.per_token + self.smoothing * (slope - self.per_token)
        fixed = seconds - (length - 1) * (self.per_token or 0.0)
        self.fixed = fixed if self.fixed is None else self.fixed + self.smoothing * (fixed - self.fixed)

    def estimate(self, length: int) -> float | None:
        """Seconds for a step of ``length`` tokens, or None before any step was measured. Before
        lengths varied, each extra token is assumed to add 5% (optimistic, so K gets tried)."""
        if self.fixed is None:
            return None
        per_token = self.per_token if self.per_token is not None else 0.05 * self.fixed
        return max(self.fixed + per_token * (length - 1), 1e-6)


class StepCostsByLoad:
    """``StepCosts`` kept apart by load: how many requests were decoding at once (``load()``, 1 to
    ``max_load``; more count as ``max_load``). Each observation and estimate uses the current load's.

    Steps and drafts cost differently at different loads: with two users interleaved on two stages a
    step waits behind the other user's, and a draft model sharing cores with the stages runs slower
    while both are busy (``bench/wan/sweep.py``: 13 ms per draft token at 1 user, 35-69 at 2, with
    everything on 2 cores). One shared estimate mixed the two, so each request began from the other
    load's costs. Same interface as ``StepCosts``.
    """

    def __init__(self, load: Callable[[], int], max_load: int = 4) -> None:
        self._load, self.max_load = load, max_load
        self._costs: dict[int, StepCosts] = {}

    def current(self) -> StepCosts:
        """The costs at the current load."""
        key = max(1, min(self._load(), self.max_load))
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = StepCosts()
        return costs

    def observe(self, length: int, seconds: float) -> None:
        self.current().observe(length, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self.current().observe_draft(tokens, seconds)

    def estimate(self, length: int) -> float | None:
        return self.current().estimate(length)

    @property
    def draft_seconds_per_token(self) -> float:
        return self.current().draft_seconds_per_token


class AdaptiveK:
    """Chooses a session's draft length K to maximize expected tokens per second.

    The acceptance rate is a decayed Beta estimate from this session's verify outcomes; step costs
    and the draft's cost per token come from the shared ``StepCosts``. A step with K drafts costs
    K draft tokens plus one pipeline step of K+1 tokens. A slow link makes every step cost about the same, so longer
    drafts pay; a poor draft lowers the acceptance rate and K falls, to 0 (plain decoding) when
    drafting does not pay. ``fixed`` pins K (``--spec-k``).

    Drafting must promise ``min_gain`` times plain decoding's tokens per second: the model leaves out
    the draft call's own costs (its thread hop, catching up on tokens it has not seen, sampling) and,
    in a batch group, the other members waiting for a drafting one. Without the margin a draft at
    break-even drafted on half the steps at 0 ms per hop and ran at 0.94x plain decoding
    (bench/wan/sweep.py, a self-int8 draft as costly per token as 0.75 of the model).
    """

    min_gain = 1.15

    def __init__(self, costs: StepCosts | StepCostsByLoad, k_max: int, fixed: int | None = None, prior: tuple[float, float] = (3.0, 2.0),
                 decay: float = 0.9, probe_every: int = 16) -> None:
        self.costs = costs
        self.k_max = k_max
        self.fixed = fixed
        self.accepted, self.rejected = prior
        self.decay = decay
        self.probe_every = probe_every
        self._probe_interval = probe_every
        self._since_draft = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int) -> None:
        """Record one verify step: ``accepted`` of ``drafted`` drafts (stops at the first rejection)."""
        if drafted == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if accepted < drafted else 0)

    def _best(self, acceptance: float | None = None) -> int | None:
        """The K of the highest expected tokens per second on the measured costs at ``acceptance``
        (default: this session's estimate); None before any step was measured."""
        base = self.costs.estimate(1)
        if base is None:
            return None
        acceptance = self.acceptance if acceptance is None else acceptance
        best_k, best_rate = 0, self.min_gain / base
        for k in range(1, self.k_max + 1):
            cost = self.costs.estimate(k + 1) + k * self.costs.draft_seconds_per_token
            rate = expected_tokens(acceptance, k) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def would_draft(self) -> bool:
        """Whether drafting pays now (K pinned > 0, or the measured costs favour K > 0; not before any
        step was measured). No probe is counted."""
        if self.fixed is not None:
            return self.fixed > 0
        return bool(self._best())

    def choose(self) -> int:
        """K for the next step (0 = plain decoding)."""
        if self.fixed is not None:
            return self.fixed
        best_k = self._best()
        if best_k is None:
            return 0  # measure a plain step first
        if best_k == 0:
            # drafting looks unprofitable; probe now and then so a changed context can win it back,
            # less often each time a probe does not (16, 32, ... 256 steps), but only if some
            # context could: not when the draft's cost loses even if every draft were accepted
            # (a draft as slow as a step on a fast link; a probe there costs a draft prefill too)
            if not self._best(acceptance=1.0):
                return 0
            self._since_draft += 1
            if self._since_draft >= self._probe_interval:
                self._since_draft = 0
                self._probe_interval = min(2 * self._probe_interval, 16 * self.probe_every)
                return 1
        else:
            self._since_draft = 0
            self._probe_interval = self.probe_every
        return best_k
