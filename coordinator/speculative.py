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

from collections.abc import Sequence

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
           rng: np.random.Generator) -> list[int]:
    """Accept a prefix of the drafts and add one token: the tokens to emit, 1..K+1 of them.

    ``draft_tokens`` [K] were proposed from ``draft_dists`` [K] (q); ``target_dists`` [K+1] (p) are the
    target's distributions at each draft position plus the one after the last draft.
    Raises ``ValueError`` when the lengths do not line up.
    """
    k = len(draft_tokens)
    if len(draft_dists) != k or len(target_dists) != k + 1:
        raise ValueError(f"{k} drafts need {k} draft and {k + 1} target distributions, "
                         f"got {len(draft_dists)} and {len(target_dists)}")
    out: list[int] = []
    for token, q, p in zip(draft_tokens, draft_dists, target_dists):
        px, qx = p.prob(token), q.prob(token)
        if qx > 0.0 and rng.random() < min(1.0, px / qx):
            out.append(int(token))
            continue
        out.append(residual(p, q).sample(rng))
        return out
    out.append(target_dists[k].sample(rng))
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
