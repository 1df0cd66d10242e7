"""A request's state from its prompt tokens to its finish: sampling parameters, output, timings,
speculation counts and logprob records; the text deltas it streams."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from .constraint import Constraint, Matcher
from .logprobs import LogprobLog, TokenLogprob
from .sampling import Penalties, SparseDist, penalized_distribution


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    REPLAN_WAIT = "replan_wait"  # placed nowhere yet: the fleet re-plans over the workers left (fleet/replan.py)
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client went away


class FinishReason(str, enum.Enum):
    """OpenAI ``finish_reason`` values."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context limit reached


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks, fixed-length runs)
    top_k: int = 0  # sample among this many best candidates (0 = all the last stage returns)
    penalties: Penalties = field(default_factory=Penalties)
    logprobs: int | None = None  # None: none; N: each token's logprob and its N best candidates' (logprobs.py)
    constraint: Constraint | None = None  # what the output must match (grammar-constrained decoding, constraint.py)


@dataclass
class Request:
    """One generation request; token lists change only through its methods."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # of those, accepted by the target
    verify_steps: int = 0  # decode steps that carried drafts
    draft_ms: float = 0.0  # time spent proposing drafts
    verify_ms: float = 0.0  # wall time of the steps that verified drafts
    compactions: int = 0  # KV compactions (one state rewrite per stage each)
    batch_max: int = 0  # most sessions that shared one of its decode steps (its batch group's size)
    failovers: int = 0  # times it moved to replica workers after a stage failed
    forced_tokens: int = 0  # output tokens its grammar forced, sent as drafts and accepted (constraint.py)
    output_counts: dict[int, int] = field(default_factory=dict)  # times each token was generated (penalties)
    prefilled: int = 0  # prompt tokens on the stages so far (streamed as prefill progress)
    cached_tokens: int = 0  # prompt tokens whose KV a retained session gave (prefix cache), not prefilled
    cache_scope: str = ""  # whose retained KV it may reuse: its API key's digest ("" without keys)
    logprobs: LogprobLog | None = None  # one record per output token, when params.logprobs asks for them
    grammar: Matcher | None = None  # the state of params.constraint, following the output (the engine compiles it)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = LogprobLog(self.params.logprobs)

    def target(self, ids: np.ndarray, logprobs: np.ndarray, ahead: list[int] = ()) -> SparseDist:  # noqa: B006
        """What to sample the next token from, given the last stage's candidates for it: after the
        penalties over the output so far plus ``ahead`` (drafts before this position in a verify step).
        With logprobs asked for, the candidates are kept for the token decided here: the ``len(ahead)``-th
        of its step, which ``append`` takes them for."""
        p, counts = self.params, self.output_counts
        if self.grammar is not None and not np.isfinite(logprobs[-1]):  # fewer allowed tokens than candidates
            keep = np.isfinite(logprobs)
            ids, logprobs = ids[keep], logprobs[keep]
        if self.logprobs is not None:
            self.logprobs.offer(ids, logprobs, len(ahead))
        if p.penalties.active and ahead:
            counts = dict(counts)
            for token in ahead:
                counts[token] = counts.get(token, 0) + 1
        seen = self._prompt_set() if p.penalties.repetition != 1.0 else frozenset()
        return penalized_distribution(ids, logprobs, p.temperature, p.top_p, p.penalties, counts, seen, p.top_k)

    def _prompt_set(self) -> frozenset[int]:
        if not hasattr(self, "_prompt_tokens"):
            self._prompt_tokens = frozenset(self.prompt_ids)
        return self._prompt_tokens

    def record_verify(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """Count one decode step that verified ``drafted`` drafts, ``accepted`` of them accepted."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms

    def speculation_stats(self) -> dict:
        """Acceptance metrics of this request (empty counts when it did not speculate)."""
        return {
            "drafted_tokens": self.drafted,
            "verify_steps": self.verify_steps,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # tokens emitted per verify step: accepted drafts + the target's own token
            "mean_accepted_length": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "compactions": self.compactions,
            "batch_max": self.batch_max,
            "failovers": self.failovers,
            "forced_tokens": self.forced_tokens,
        }

    def append(self, token: int, offset: int = 0) -> None:
        """Add an output token; ``offset``: the characters of completion text before its own."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.append(token)
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        if self.logprobs is not None:
            self.logprobs.record(token, offset)

    def take_logprobs(self, upto: int | None = None) -> tuple[TokenLogprob, ...]:
        """The logprob records not yet taken of tokens whose text starts before character ``upto``
        (None: all), for the TextDelta carrying that text; () when none were asked for."""
        return () if self.logprobs is None else self.logprobs.take(upto)

    def finish(self, reason: FinishReason) -> None:
        self.status, self.finish_reason, self.finished_at = RequestStatus.FINISHED, reason, time.perf_counter()

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_at is None else (self.first_token_at - self.created) * 1000

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first per second of decoding (1 / TPOT)."""
        if self.first_token_at is None or self.finished_at is None or len(self.output_ids) < 2:
            return None
        return (len(self.output_ids) - 1) / max(self.finished_at - self.first_token_at, 1e-9)


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text; ``finish_reason`` is set on the last one."""

    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text starts in ``text`` (when asked for)


def position_generators(seed: int | None):  # noqa: ANN202
    """(target's, draft's) generator makers: one generator per logical position, seeded by (seed, position),
    so a seeded run is reproducible, with point-mass drafts (greedy, ngram) whatever the draft lengths were
    (see speculative.verify); the draft's draws are independent of the target's. No seed: a random one."""
    seed = (seed if seed is not None else int(np.random.SeedSequence().entropy)) % 2**64

    def rng_at(position: int) -> np.random.Generator:
        return _LazyGenerator((seed, position))

    def draft_rng_at(position: int) -> np.random.Generator:
        return _LazyGenerator((seed, position, 1))
    return rng_at, draft_rng_at


class _LazyGenerator:
    """``np.random.default_rng(key)``, made on first use: a greedy step never draws, and making a
    Generator costs ~20 us, on every token (issue 17)."""

    __slots__ = ("_key", "_rng")

    def __init__(self, key: tuple[int, ...]) -> None:
        self._key, self._rng = key, None

    def __getattr__(self, name: str):  # noqa: ANN204
        if self._rng is None:
            self._rng = np.random.default_rng(list(self._key))
        return getattr(self._rng, name)
