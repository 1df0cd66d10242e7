"""Choosing the next token from what the last stage returns (top-k ids + full-vocabulary logprobs)."""

from __future__ import annotations

import numpy as np


def choose_token(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_p: float,
                 rng: np.random.Generator) -> int:
    """Pick one token.

    ``ids`` [k] int32 best first and ``logprobs`` [k] float32 for one position. ``temperature`` 0
    is greedy (``ids[0]``). Otherwise sample from softmax(logprobs / temperature) restricted to the
    k candidates, then to the smallest prefix whose mass reaches ``top_p`` (nucleus sampling,
    Holtzman et al. 2020). Deterministic for a given ``rng`` state.
    """
    if temperature <= 0.0 or len(ids) == 1:
        return int(ids[0])
    scaled = logprobs.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        probs = probs[:keep] / probs[:keep].sum()
    return int(ids[rng.choice(len(probs), p=probs)])
