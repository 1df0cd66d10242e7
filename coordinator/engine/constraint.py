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
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidRequest

# JSON the model writes under a schema: compact separators (llguidance's default), so a small model
# cannot spend its tokens on whitespace; the schema's own formats and bounds apply
JSON_OPTIONS = {"whitespace_flexible": False}

MAX_SCHEMA_DEPTH = 256
"""Nesting a JSON schema may have, counting its objects and arrays and each local ``$ref`` followed to its
target (a cycle, a recursive schema, ends the count). llguidance compiles a chain of ``$ref``s by
recursion: 2,500 of them (a 60 KB schema) overflowed its stack and killed the coordinator (SIGSEGV)."""

MAX_SCHEMA_PROPERTIES = 5000
"""Object properties a JSON schema may declare in all (OpenAI's limit for structured outputs). llguidance's
compile time grows with the square of an object's optional properties (on 2 cores: 1,000 in 0.3 s, 4,000
in 9 s, 10,000 in 128 s)."""

MAX_OBJECT_PROPERTIES = 1000
"""Properties one object of a JSON schema may declare (see ``MAX_SCHEMA_PROPERTIES``)."""


def _ref_target(root: object, ref: str) -> object:
    """The part of ``root`` a local ``$ref`` (``#``, ``#/$defs/a``: a JSON pointer, RFC 6901) points to, or
    None for any other reference (llguidance refuses those itself)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(root: object, node: object) -> list:
    """The objects and arrays directly inside ``node``, and the target of its local ``$ref``."""
    if isinstance(node, dict):
        kids = list(node.values())
        if isinstance(ref := node.get("$ref"), str):
            kids.append(_ref_target(root, ref))
    else:
        kids = list(node) if isinstance(node, list) else []
    return [k for k in kids if isinstance(k, (dict, list))]


def check_schema_size(schema: object, field: str, what: str = "", budget: int = MAX_SCHEMA_PROPERTIES) -> int:
    """The properties ``schema`` declares. Raises ``InvalidRequest`` naming ``field`` (its message opening
    with ``what``, by default ``field``) when ``schema`` nests deeper than ``MAX_SCHEMA_DEPTH`` (following
    local ``$ref``s) or declares more properties than ``MAX_OBJECT_PROPERTIES`` in one object or ``budget``
    in all (several schemas share ``MAX_SCHEMA_PROPERTIES``): what llguidance cannot compile safely or in
    bounded time. Iterative (no Python recursion) and linear in the schema's size."""
    what = what or field
    depth: dict[int, int] = {}  # id(node) -> the longest nesting from it down (a cycle back counts 0)
    on_path: set[int] = set()
    properties = 0
    stack: list[list] = [[schema, None]]  # [node, an iterator over its children once expanded]
    while stack:
        entry = stack[-1]
        node = entry[0]
        if entry[1] is None:
            entry[1] = iter(_children(schema, node))
            on_path.add(id(node))
            if isinstance(node, dict) and isinstance(props := node.get("properties"), dict):
                properties += len(props)
                if len(props) > MAX_OBJECT_PROPERTIES or properties > budget:
                    raise InvalidRequest(f"{what}: the schema declares more properties than fleet compiles "
                                         f"({MAX_OBJECT_PROPERTIES} in one object, {MAX_SCHEMA_PROPERTIES} in all)",
                                         param=field)
        child = next((k for k in entry[1] if id(k) not in depth and id(k) not in on_path), None)
        if child is not None:
            stack.append([child, None])
        else:
            stack.pop()
            on_path.discard(id(node))
            depth[id(node)] = 1 + max((depth.get(id(k), 0) for k in _children(schema, node)), default=0)
        if len(stack) > MAX_SCHEMA_DEPTH or depth.get(id(node), 0) > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(f"{what}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (following its "
                                 f"$refs), more than fleet compiles", param=field)
    return properties


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match.

    ``kind``: "json_schema" (``text`` a JSON schema), "lark" (``text`` a Lark grammar in llguidance's
    dialect, which may embed ``%json {schema}``), or "regex"; ``field``: the request field that asked for
    it (errors name it); ``label``: what errors call it ("the parameters of 'f'"; default: its kind).
    """

    kind: str
    text: str
    field: str = "response_format"
    label: str = ""

    @property
    def what(self) -> str:
        """What errors call it: ``label``, else "the json schema", "the lark", "the regex"."""
        return self.label or "the " + self.kind.replace("_", " ")

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "response_format", label: str = "") -> Constraint:
        """Output that is one JSON value valid under ``schema`` (``{"type": "object"}``: any object). Raises
        ``InvalidRequest`` naming ``field`` for a schema too deep or too large to compile (``check_schema_size``)."""
        if isinstance(schema, bool):  # JSON Schema's true: any value; false: none (llguidance takes objects only)
            if not schema:
                raise InvalidRequest(f"{field}: the schema false allows no value", param=field)
            schema = {}
        check_schema_size(schema, field)
        return cls("json_schema", json.dumps(schema), field, label)

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
            raise InvalidRequest(f"{self.field}: {self.what} does not compile: {exc}",
                                 param=self.field) from None
        raise ValueError(f"unknown constraint kind {self.kind!r}")


def mask_words(vocab_size: int) -> int:
    """Int32 words of one position's allowed-token bitmask for ``vocab_size`` logits."""
    return (vocab_size + 31) // 32


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bitmask ``mask`` [..., ceil(V / 32)] int32 unpacked to booleans [..., V]."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


class GrammarError(InvalidRequest):
    """A request's grammar allows no continuation of its output so far (a schema that leads nowhere past a
    point, ``{"properties": {"a": {"$ref": "#/properties/a"}}}``, or a mask over llguidance's per-step
    limits): that request fails, as a bad request naming its field; the others go on."""


class Matcher:
    """One request's grammar state, following its output tokens (llguidance's ``LLMatcher``).

    ``field``: the request field the constraint came from (``GrammarError`` names it). Not thread-safe:
    the step loop and the draft model's thread take turns (a request is either being drafted or stepped,
    never both)."""

    def __init__(self, matcher, vocab_size: int, field: str = "response_format") -> None:  # noqa: ANN001 - llguidance.LLMatcher
        self._m = matcher
        self.field = field
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.mask_ms = 0.0  # time spent computing masks, for the bench and the response's report
        self.masks_computed = 0

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"{self.field}: the grammar allows no continuation of the output so far "
                               f"({_reason(self._m)})",
                               param=self.field)

    def fill(self, out: np.ndarray) -> None:
        """Write the current position's bitmask into ``out`` [ceil(V / 32)] int32 (C-contiguous). Raises
        ``GrammarError`` when the grammar allows nothing here."""
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self.mask_ms += (time.perf_counter() - t0) * 1000
        self.masks_computed += 1
        self._check()

    def masks(self, draft: list[int]) -> tuple[int, np.ndarray]:
        """The bitmasks of a step that feeds ``[newest, *draft[:n]]``: (n, masks [n + 1, ceil(V / 32)] int32),
        row i the grammar's state after ``draft[:i]``, ``n`` the drafts it allows (all of a draft drawn
        under the masks; a prompt-lookup draft is cut before its first refused token). The state is left
        as it was."""
        out = np.empty((len(draft) + 1, self.words), dtype=np.int32)
        consumed = 0
        try:
            for i in range(len(draft) + 1):
                self.fill(out[i])
                if i == len(draft):
                    break
                token = int(draft[i])
                if not (0 <= token < self.vocab_size and (int(out[i, token >> 5]) >> (token & 31)) & 1):
                    break  # checked first: consuming a token the grammar refuses breaks the state for good
                self._m.consume_token(token)
                consumed += 1
        finally:
            if consumed:
                self._m.rollback(consumed)
        return consumed, out[:consumed + 1]

    def consume(self, token: int) -> None:
        """Advance past a decided output token. Raises ``RuntimeError`` if the grammar does not allow it
        (the last stage masked it out, so this is a bug)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"the grammar does not allow token {token}: {self._m.get_error()}")

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens (a draft model's proposal)."""
        if count:
            self._m.rollback(count)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (llguidance's fast-forward tokens: the bytes
        every allowed continuation starts with, tokenized; ``{"name":`` of a schema's first key). The step
        loop sends them as point-mass drafts, so they cost one step together, and verification keeps the
        output exactly that of plain decoding (a draft the model would not have chosen is rejected)."""
        return self._m.compute_ff_tokens()[:limit] if limit > 0 else []

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and allows nothing but the end of sequence."""
        return self._m.is_stopped()


class Grammars:
    """Compiles a model's constraints: llguidance's view of its tokenizer (built once, on first use: ~0.5 s
    for a 49,152-token vocabulary) and a ``Matcher`` per request.

    ``tokenizer_json()``: the build's tokenizer.json text (asked for once); ``vocab_size``: the model's
    logits width (V); ``eos_ids``: the tokens that end a sequence (allowed where the grammar is complete)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: set[int]) -> None:
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):  # noqa: ANN201 - llguidance.LLTokenizer
        """llguidance's tokenizer (made on first call; thread-safe)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._json(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids)
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh grammar state for ``constraint`` (blocking: ~1 ms for a small schema, up to ~1 s for a
        huge one; call it off the event loop, once ``grammar_check.GrammarChecker`` passed it: a schema
        can take exponential time and memory to compile). Raises ``InvalidRequest`` naming the
        constraint's field when it does not compile."""
        return Matcher(compile_matcher(self.tokenizer(), constraint), self.vocab_size, constraint.field)


def _reason(matcher) -> str:  # noqa: ANN001 - llguidance.LLMatcher
    """The matcher's error without llguidance's dump of its state (which may quote the whole grammar)."""
    return matcher.get_error().split("<state>")[0].strip()


def compile_matcher(tokenizer, constraint: Constraint):  # noqa: ANN001, ANN201 - llguidance's LLTokenizer, LLMatcher
    """llguidance's ``LLMatcher`` for ``constraint`` over ``tokenizer``, its first mask computed. Blocking,
    unbounded in time and memory for a hostile schema: the coordinator calls it once the grammar passed
    ``grammar_check``. Raises ``InvalidRequest`` naming the constraint's field when it does not compile
    or allows no first token."""
    import llguidance

    what = constraint.what
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
    if not matcher.is_error():  # a grammar that allows no first token ({"$ref": "#"}) breaks at its first mask
        matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidRequest(f"{constraint.field}: {what} allows no output ({_reason(matcher)})",
                                 param=constraint.field)
    if matcher.is_error():
        raise InvalidRequest(f"{constraint.field}: {what} does not compile: {_reason(matcher)}",
                             param=constraint.field)
    return matcher
