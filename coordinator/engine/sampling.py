"""Choosing the next token from what the last stage returns (top-k ids + full-vocabulary logprobs), with
the request's penalties; and what a request silent on sampling gets: the model's own defaults
(generation_config.json), and the fallback chat clients send for a model without them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# generation_config.json fields fleet takes as the model's defaults, and the request field each one fills
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


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
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = logprobs.astype(np.float64) / temperature
        if not np.isfinite(scaled.max()):  # a temperature so small (1e-320) that the scores overflow:
            # scaled from the best one, they go to -inf but the best (0), the limit of softmax as T -> 0
            scaled = (logprobs.astype(np.float64) - logprobs.max()) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p - 1e-9) + 1)  # tolerate rounding at the cut
        probs = probs[:keep] / probs[:keep].sum()
    return SparseDist(ids[: len(probs)].astype(np.int64), probs)


@dataclass(frozen=True)
class Penalties:
    """Repetition penalties of one request (OpenAI's ``frequency_penalty``/``presence_penalty``, HF's
    ``repetition_penalty``); the default applies none."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        """Whether any penalty changes the scores."""
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0


def penalize(ids: np.ndarray, logprobs: np.ndarray, penalties: Penalties, output_counts: dict[int, int],
             seen: set[int] | frozenset[int] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (``ids`` [k], ``logprobs`` [k]) with ``penalties`` applied, best first again.

    OpenAI: score[t] -= frequency * count[t] + presence * (count[t] > 0), ``output_counts`` counting the
    tokens generated so far (exact: a shift, the candidates' scores need no normalization). HF/CTRL
    (Keskar et al. 2019): a token in ``seen`` (prompt + output) has a positive score divided by
    ``repetition``, a negative one multiplied. The last stage returns log-softmax scores (always <= 0),
    not raw logits, so a repeated candidate's score is multiplied: the same direction as HF's, on a
    scale that does not depend on the logits' arbitrary offset. Only the k candidates are scored.
    """
    scores = logprobs.astype(np.float64)
    counts = np.array([output_counts.get(int(t), 0) for t in ids], dtype=np.float64)
    scores = scores - penalties.frequency * counts - penalties.presence * (counts > 0)
    if penalties.repetition != 1.0:
        repeated = np.array([int(t) in seen or int(t) in output_counts for t in ids], dtype=bool)
        scores = np.where(repeated & (scores > 0), scores / penalties.repetition, scores)
        scores = np.where(repeated & (scores <= 0), scores * penalties.repetition, scores)
    order = np.argsort(-scores, kind="stable")
    return ids[order], scores[order]


def penalized_distribution(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_p: float,
                           penalties: Penalties, output_counts: dict[int, int],
                           seen: set[int] | frozenset[int] = frozenset(), top_k: int = 0) -> SparseDist:
    """``target_distribution`` of the candidates after ``penalties`` (none when inactive: exactly the
    plain one), then cut to the ``top_k`` best (0 = all; as transformers: penalties before top-k)."""
    if penalties.active:
        ids, logprobs = penalize(ids, logprobs, penalties, output_counts, seen)
    if top_k > 0:
        ids, logprobs = ids[:top_k], logprobs[:top_k]
    return target_distribution(ids, logprobs, temperature, top_p)


FALLBACK_SAMPLING = {"temperature": 0.0, "frequency_penalty": 0.3}
"""What a chat client (fleet-chat, the chat page) sends when its user sets no sampling field and the model's
generation_config.json holds no sampling defaults: greedy (answers stay deterministic) with OpenAI's frequency
penalty at 0.3. Tried on the demo model (max_tokens 512): plain greedy loops on "Write a short poem about the
sea." to the cap ("A world where the sea is a place, a place where the sea is a place, ..."), 0.3 ends it after
160 tokens; short answers ("Hi!", "What is the capital of France?") are unchanged. repetition_penalty (scaled
here on log-probabilities, the last stage sends no raw logits) still looped at 1.3; temperature 0.7 wandered
("Le Grand Paris, Le Havre is the capital of France.")."""


def fallback_sampling(defaults: dict) -> dict[str, float]:
    """The model card's ``fallback_sampling`` (``GET /v1/models``): ``FALLBACK_SAMPLING`` when the model's
    ``defaults`` (``generation_defaults``) hold neither a temperature nor a repetition penalty, else {} (the
    model's own defaults apply). A chat client sends these fields when its user sets no sampling field."""
    return {} if {"temperature", "repetition_penalty"} & set(defaults) else dict(FALLBACK_SAMPLING)


def generation_defaults(folder: Path) -> dict[str, float | int]:
    """The model's own sampling defaults from ``folder/generation_config.json``, keyed by request field
    (``max_new_tokens`` as ``max_tokens``): only the fields it holds, sanity-checked; {} without the file.
    ``do_sample: false`` is transformers' library default, not a recommendation, and is not taken."""
    path = Path(folder) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); no model sampling defaults", path, exc)
        return {}
    out: dict[str, float | int] = {}
    for name, field in GENERATION_DEFAULTS.items():
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return out
