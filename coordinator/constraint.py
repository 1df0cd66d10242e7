"""Grammar-constrained decoding: what a request's output must match, as per-position allowed-token masks.

A request's ``Constraint`` (a JSON schema, a Lark grammar or a regex; ``response_format``, a required tool
call, Ollama's ``format``) is compiled once by llguidance (https://github.com/guidance-ai/llguidance: an
Earley parser over the tokenizer's trie, no torch) into a ``Matcher`` that follows the request's output
tokens. Before every step the coordinator computes the allowed-token bitmask of each position the step
returns candidates for, and the last stage applies it to the logits before its top-k and log-softmax
(``fleet_common.runtime.top_candidates``): every candidate that comes back is valid, and the logprobs are
those of the constrained distribution. A verify step's masks follow the drafts (position i's mask is the
grammar's state after drafts[:i]) and drafts are drawn under the same masks, so speculative sampling
(Leviathan et al. 2023) stays lossless with respect to constrained plain decoding.

Masks are llguidance's (and xgrammar's) layout: [positions, ceil(V / 32)] int32, bit j of word i set when
token 32 i + j is allowed, V the model's logits width.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest

# JSON the model writes under a schema: compact separators (llguidance's default), so a small model
# cannot spend its tokens on whitespace; the schema's own formats and bounds apply
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match.

    ``kind``: "json_schema" (``text`` a JSON schema), "lark" (``text`` a Lark grammar in llguidance's
    dialect, which may embed ``%json {schema}``), or "regex"; ``field``: the request field that asked for
    it (errors name it).
    """

    kind: str
    text: str
    field: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "response_format") -> Constraint:
        """Output that is one JSON value valid under ``schema`` (``{"type": "object"}``: any object)."""
        return cls("json_schema", json.dumps(schema), field)

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint. Raises ``InvalidRequest`` naming
        ``field`` when the schema or grammar does not compile."""
        import llguidance

        try:
            match self.kind:
                case "json_schema":
                    return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
                case "lark":
                    return llguidance.LLMatcher.grammar_from_lark(self.text)
                case "regex":
                    return llguidance.LLMatcher.grammar_from_regex(self.text)
        except ValueError as exc:
            raise InvalidRequest(f"{self.field}: the {self.kind.replace('_', ' ')} does not compile: {exc}",
                                 param=self.field) from None
        raise ValueError(f"unknown constraint kind {self.kind!r}")
