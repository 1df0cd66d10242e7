"""A request's output processor: from the last stage's candidates to tokens and text, with no I/O.

Per request it applies the penalties, samples (or verifies drafts, lossless speculative sampling),
chooses how many drafts the next step carries, finds the end (end of sequence, a stop string,
``max_tokens``), detokenizes incrementally and cuts the text into deltas, with logprob records.
The step loop (``loop.py``) feeds it each step's ``StepOutput``; what it returns goes to the client.
"""

from __future__ import annotations

from .pipeline import StepOutput
from .request import FinishReason, Request, TextDelta, position_generators
from .sampling import SparseDist
from .speculative import AdaptiveK, StepCostsByLoad, verify
from ..tokenizer import ChatTokenizer, IncrementalDetokenizer


FORCED_MAX = 16  # forced tokens one step carries at most (a tool call's syntax and name, a schema's keys)


class OutputProcessor:
    """Turns one request's step results into tokens and text deltas.

    ``eos_ids``: end-of-sequence token ids; ``costs``: the fleet's measured step and draft costs (for
    adaptive K, ``speculative.AdaptiveK``); ``k_max``/``k_fixed``: the draft length bound and a fixed K
    (None: adaptive); ``drafting``: whether this request may speculate at all.
    """

    def __init__(self, request: Request, tokenizer: ChatTokenizer, eos_ids: set[int], costs: StepCostsByLoad,
                 k_max: int, k_fixed: int | None, drafting: bool) -> None:
        self.request = request
        self.eos_ids = eos_ids
        self.rng_at, self.draft_rng_at = position_generators(request.params.seed)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text, self.sent = "", 0
        self.hold = max((len(x) for x in request.params.stop), default=1) - 1
        self.policy = AdaptiveK(costs, k_max, fixed=k_fixed)
        self.drafting = drafting

    @property
    def finished(self) -> bool:
        return self.request.finish_reason is not None

    def first(self, out: StepOutput) -> list[int]:
        """The first output token, sampled from the prefill's candidates for the prompt's last position."""
        request = self.request
        return [request.target(out.top_ids[-1], out.top_logprobs[-1]).sample(self.rng_at(len(request.prompt_ids)))]

    def decide(self, out: StepOutput, logical: int) -> list[int]:
        """The token a plain step decided (``logical``: tokens visible at the stages before it)."""
        return [self.request.target(out.top_ids[-1], out.top_logprobs[-1]).sample(self.rng_at(logical + 1))]

    def verify(self, out: StepOutput, draft: list[int], qs: list[SparseDist], logical: int, draft_ms: float,
               verify_ms: float, forced: bool = False) -> list[int]:
        """The tokens a step that carried ``draft`` (drawn from ``qs``) decided: the accepted drafts, then
        the target's own token (Leviathan et al. 2023, Chen et al. 2023); counts the acceptance (``forced``:
        the grammar's forced tokens, counted apart: they say nothing of the draft's acceptance)."""
        request = self.request
        # the penalized targets: position i's penalties count the drafts before it (its context if accepted)
        targets = [request.target(out.top_ids[i], out.top_logprobs[i], draft[:i]) for i in range(len(draft) + 1)]
        decided = verify(draft, qs, targets, [self.rng_at(logical + 1 + i) for i in range(len(draft) + 1)])
        accepted = len(decided) - 1
        if forced:
            request.forced_tokens += accepted
            return decided
        request.record_verify(len(draft), accepted, draft_ms, verify_ms)
        self.policy.observe(len(draft), accepted)
        return decided

    def forced_draft(self) -> list[int]:
        """The tokens the request's grammar forces next, up to ``FORCED_MAX`` and the tokens left ([] without
        a grammar): the next step's drafts, whatever K the draft's policy would choose."""
        grammar, request = self.request.grammar, self.request
        if grammar is None:
            return []
        return grammar.forced(min(FORCED_MAX, request.params.max_tokens - len(request.output_ids)))

    def next_k(self) -> int:
        """Drafts the next step should carry (0: a plain step)."""
        if not self.drafting:
            return 0
        return min(self.policy.choose(), self.request.params.max_tokens - len(self.request.output_ids))

    def take(self, decided: list[int]) -> TextDelta | None:
        """Append the ``decided`` tokens until the request finishes (end of sequence, a stop string,
        ``max_tokens``); the delta to send now (text no stop string can still claim; the rest with the
        finish reason once finished), or None when there is nothing new to send."""
        request, params = self.request, self.request.params
        text = self.text
        for token in decided:
            if token in self.eos_ids and not params.ignore_eos:
                request.finish(FinishReason.STOP)
                break
            request.append(token, len(text))
            text += self.detok.push(token)
            if request.grammar is not None:
                request.grammar.consume(token)
            if params.stop:
                cut = min((i for i in (text.find(x, max(0, self.sent - self.hold)) for x in params.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    request.finish(FinishReason.STOP)
                    if request.logprobs is not None:
                        request.logprobs.cut(cut)
                    text = text[:cut]
                    break
            if request.grammar is not None and request.grammar.stopped:
                request.finish(FinishReason.STOP)  # only the end of sequence may follow: no step for it
                break
            if len(request.output_ids) >= params.max_tokens:
                request.finish(FinishReason.LENGTH)
                break
        self.text = text
        if request.finish_reason is not None:
            delta = TextDelta(text[self.sent:], request.finish_reason, request.take_logprobs())
            self.sent = len(text)
            return delta
        safe = len(text) - self.hold if params.stop else len(text)
        if safe <= self.sent:
            return None
        delta = TextDelta(text[self.sent:safe], logprobs=request.take_logprobs(safe))
        self.sent = safe
        return delta
