"""Token log-probabilities for the API's ``logprobs`` fields, from the candidates the last stage returns.

Which distribution: the model's own, the log-softmax over the full vocabulary of the last stage's
logits, before temperature, top-p, top-k and the penalties (as vLLM's default ``raw_logprobs`` mode
and OpenAI's API report them). So a token sampled at temperature 1.5 reports the logprob the model
gave it, and the same prompt reports the same numbers whatever the sampling settings. Only the
candidates the last stage returns are known (``sample_top_k`` of them, 1 for a greedy request that
asks for none): ``top_logprobs`` cannot ask for more.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# what a token outside the known candidates reports (JSON has no -inf; vLLM's choice of stand-in)
UNKNOWN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the best candidates at its position.

    ``token`` the id generated; ``logprob`` its natural-log probability under the model (float, <= 0);
    ``top`` the ``n`` best candidates as (id, logprob), best first; ``offset`` the characters of the
    completion text before this token's own text (tokens ending inside a character share its offset).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int


def token_logprob(token: int, ids: np.ndarray, logprobs: np.ndarray, n: int, offset: int) -> TokenLogprob:
    """``token``'s record from the last stage's candidates at its position: ``ids`` [k] int32 best
    first, ``logprobs`` [k] float32 (log-softmax over the full vocabulary); the ``n`` best go in ``top``.
    A token outside the candidates (cannot happen when it was sampled from them) gets ``UNKNOWN_LOGPROB``."""
    hit = np.flatnonzero(ids == token)
    value = float(logprobs[hit[0]]) if hit.size else UNKNOWN_LOGPROB
    top = tuple((int(i), float(lp)) for i, lp in zip(ids[:n], logprobs[:n], strict=True))
    return TokenLogprob(int(token), value, top, offset)


class LogprobLog:
    """A request's logprob records, one per output token, and which went out already.

    ``offer`` keeps the candidates of the ``position``-th token a step decides (0 starts a new step);
    ``record`` makes the record of the next token appended from them, in order."""

    def __init__(self, n: int) -> None:
        self.n = n  # top candidates per record
        self.records: list[TokenLogprob] = []
        self._offered: list[tuple[np.ndarray, np.ndarray]] = []
        self._sent = 0

    def offer(self, ids: np.ndarray, logprobs: np.ndarray, position: int) -> None:
        if position == 0:
            self._offered.clear()
        self._offered.append((ids, logprobs))

    def record(self, token: int, offset: int) -> None:
        ids, logprobs = self._offered.pop(0)
        self.records.append(token_logprob(token, ids, logprobs, self.n, offset))

    def _first_from(self, at: int) -> int:
        return next((i for i in range(self._sent, len(self.records)) if self.records[i].offset >= at),
                    len(self.records))

    def take(self, upto: int | None = None) -> tuple[TokenLogprob, ...]:
        """The records not taken yet of tokens whose text starts before character ``upto`` (None: all)."""
        end = len(self.records) if upto is None else self._first_from(upto)
        taken, self._sent = tuple(self.records[self._sent:end]), end
        return taken

    def cut(self, at: int) -> None:
        """Drop the records of tokens whose text starts at or after character ``at`` (a stop string's)."""
        del self.records[self._first_from(at):]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (byte -> the printable character standing for it in the vocabulary),
    as HF tokenizers' ``ByteLevel`` pre-tokenizer and decoder use (openai/gpt-2 ``encoder.py``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class TokenBytes:
    """The raw bytes each token id stands for, and the string the API shows for it.

    Byte-level vocabularies (GPT-2, Llama 3, Qwen, SmolLM: ``ByteLevel`` decoder) map each character of
    a token back to its byte; SentencePiece vocabularies spell bytes as ``<0xNN>`` and spaces as ``▁``.
    Added (special) tokens are their own UTF-8 text. ``tokenizer`` is an HF ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer) -> None:  # noqa: ANN001 - tokenizers.Tokenizer
        self._tok = tokenizer
        kinds = _component_types(json.loads(tokenizer.to_str()))
        self.byte_level = "ByteLevel" in kinds
        self._unbyte = {c: b for b, c in bytes_to_unicode().items()}
        self._added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    @lru_cache(maxsize=65536)  # noqa: B019 - one instance per engine, lives as long as it
    def bytes_of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text (b"" for an unknown id)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self._added:
            return piece.encode("utf-8")
        if self.byte_level:
            if all(c in self._unbyte for c in piece):
                return bytes(self._unbyte[c] for c in piece)
            return piece.encode("utf-8")
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text_of(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 characters shows as ``bytes:\\xNN...``
        (OpenAI's spelling), its raw bytes going in the ``bytes`` field."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _component_types(config: dict) -> set[str]:
    """Every ``type`` named in tokenizer.json's pre-tokenizer and decoder (sequences included)."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(config.get("decoder"))
    walk(config.get("pre_tokenizer"))
    return found


def chat_logprobs(records: list[TokenLogprob], vocab: TokenBytes, n: int) -> dict:
    """The chat completion choice's ``logprobs`` object: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}] x n}]}`` (OpenAI's ``ChatCompletionTokenLogprob``)."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": vocab.text_of(token), "logprob": logprob, "bytes": list(vocab.bytes_of(token))}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(i, lp) for i, lp in r.top[:n]]}
                        for r in records], "refusal": None}


def completion_logprobs(records: list[TokenLogprob], vocab: TokenBytes, n: int) -> dict:
    """The legacy completion choice's ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one {token text: logprob} dict of the ``n`` best per token) and ``text_offset``
    (each token's first character in the completion text)."""
    return {"tokens": [vocab.text_of(r.token) for r in records],
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{vocab.text_of(i): lp for i, lp in r.top[:n]} for r in records],
            "text_offset": [r.offset for r in records]}
