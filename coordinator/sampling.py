"""Choosing the next token from what the last stage returns (top-k ids + full-vocabulary logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids; every other id has probability 0.

    ``ids`` [k] int64 (distinct), ``probs`` [k] float64 summing to 1.
    """

    ids: np.ndarray
    probs: np.ndarray

    @classmethod
    def point(cls, token: int) -> SparseDist:
        """All mass on ``token`` (greedy targets, prompt-lookup drafts)."""
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    def prob(self, token: int) -> float:
        """Probability of ``token`` (0.0 outside the support)."""
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        """Inverse-CDF draw over the ids in ascending order: canonical, so rounding-level changes in
        the candidates' ranking (e.g. a 1-token step vs a verify window) do not change the draw.
        A point mass returns its id without drawing (greedy uses no randomness)."""
        if len(self.ids) == 1:
            return int(self.ids[0])
        order = np.argsort(self.ids, kind="stable")
        return int(self.ids[order[rng.choice(len(order), p=self.probs[order])]])


def target_distribution(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_p: float) -> SparseDist:
    """What plain decoding samples from, for one position.

    ``ids`` [k] best first and ``logprobs`` [k] (log-softmax over the full vocabulary). Temperature 0
    gives the point mass on ``ids[0]`` (greedy). Otherwise softmax(logprobs / temperature) over the k
    candidates, cut to the smallest prefix whose mass reaches ``top_p`` (nucleus sampling, Holtzman
    et al. 2020) and renormalized.
    """
    if temperature <= 0.0 or len(ids) == 1:
        return SparseDist.point(int(ids[0]))
    scaled = logprobs.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p - 1e-9) + 1)  # tolerate rounding at the cut
        probs = probs[:keep] / probs[:keep].sum()
    return SparseDist(ids[: len(probs)].astype(np.int64), probs)


def choose_token(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_p: float,
                 rng: np.random.Generator) -> int:
    """Pick one token from ``target_distribution(ids, logprobs, temperature, top_p)``.

    Temperature 0 is greedy (``ids[0]``, no randomness used). Deterministic for a given ``rng`` state.
    """
    return target_distribution(ids, logprobs, temperature, top_p).sample(rng)
