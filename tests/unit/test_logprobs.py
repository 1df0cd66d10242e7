"""Logprob records (coordinator/engine/logprobs.py): which candidates each token's record takes, what goes
out with which text, and the raw bytes of tokens, checked against HF tokenizers' own encoding."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from coordinator.engine.logprobs import (UNKNOWN_LOGPROB, LogprobLog, TokenBytes, bytes_to_unicode, chat_logprobs,
                                  completion_logprobs)
from tests.conftest import MODELS

IDS = np.array([7, 3, 9], dtype=np.int32)
LPS = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))


def test_records_follow_the_positions_of_a_step():
    log = LogprobLog(2)
    log.offer(IDS, LPS, 0)  # a verify step: three positions, two tokens accepted
    log.offer(IDS[::-1].copy(), LPS[::-1].copy(), 1)
    log.offer(IDS, LPS, 2)
    log.record(7, 0)
    log.record(3, 4)  # from the second position's candidates (top in the order the stage gave them)
    assert [r.token for r in log.records] == [7, 3]
    assert log.records[0].logprob == pytest.approx(np.log(0.6)) and log.records[0].top[0][0] == 7
    assert log.records[1].top == ((9, pytest.approx(np.log(0.1))), (3, pytest.approx(np.log(0.3))))
    log.offer(IDS, LPS, 0)  # a new step drops what the last one left
    log.record(42, 6)  # not a candidate
    assert log.records[2].logprob == UNKNOWN_LOGPROB


def test_take_and_cut_by_text_offset():
    log = LogprobLog(0)
    for offset in (0, 3, 3, 5, 9):  # two tokens share a character (offset 3)
        log.offer(IDS, LPS, 0)
        log.record(7, offset)
    assert [r.offset for r in log.take(4)] == [0, 3, 3]
    assert log.take(4) == ()
    log.cut(5)  # a stop string starting at character 5
    assert [r.offset for r in log.take()] == []
    assert len(log.records) == 3 and all(r.top == () for r in log.records)


@pytest.fixture(scope="module")
def demo_vocab():
    path = MODELS / "SmolLM2-135M-Instruct" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the demo model is fetched by the integration tests")
    tok = Tokenizer.from_file(str(path))
    return tok, TokenBytes(tok)


@pytest.mark.parametrize("text", ["héllo wörld", "北京欢迎你 👍🏽", "tabs\tand\nlines", "<|im_end|> after"])
def test_byte_level_tokens_spell_the_text(demo_vocab, text):
    tok, vocab = demo_vocab
    assert vocab.byte_level
    ids = tok.encode(text, add_special_tokens=False).ids
    assert b"".join(vocab.bytes_of(i) for i in ids) == text.encode("utf-8")
    for i in ids:
        raw = vocab.bytes_of(i)
        shown = vocab.text_of(i)
        try:
            assert shown == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert shown == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_byte_alphabet_is_the_tokenizers_librarys():
    alphabet = bytes_to_unicode()
    assert sorted(alphabet) == list(range(256))
    assert sorted(alphabet.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def test_sentencepiece_byte_fallback_tokens():
    """A Llama-style vocabulary (``▁`` for spaces, ``<0xNN>`` byte tokens): the bytes agree with what
    HF tokenizers' own decoder makes of the tokens."""
    pieces = ["<unk>", "▁hi", "▁there", "<0xE6>", "<0x97>", "<0xA5>", "x"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    vocab = TokenBytes(tok)
    assert not vocab.byte_level
    assert vocab.bytes_of(3) == b"\xe6" and vocab.text_of(3) == "bytes:\\xe6"
    ids = [1, 2, 3, 4, 5, 6]
    assert b"".join(vocab.bytes_of(i) for i in ids).decode("utf-8") == tok.decode(ids) == " hi there日x"


def test_api_shapes():
    log = LogprobLog(2)
    log.offer(np.array([72, 73], dtype=np.int32), np.array([-0.1, -2.5], dtype=np.float32), 0)
    log.record(72, 0)

    class Vocab:  # token id -> its byte (ASCII)
        def bytes_of(self, i: int) -> bytes:
            return bytes([i])

        def text_of(self, i: int) -> str:
            return chr(i)

    chat = chat_logprobs(log.records, Vocab(), 1)
    assert chat["content"] == [{"token": "H", "logprob": pytest.approx(-0.1), "bytes": [72],
                                "top_logprobs": [{"token": "H", "logprob": pytest.approx(-0.1), "bytes": [72]}]}]
    legacy = completion_logprobs(log.records, Vocab(), 2)
    assert legacy == {"tokens": ["H"], "token_logprobs": [pytest.approx(-0.1)],
                      "top_logprobs": [{"H": pytest.approx(-0.1), "I": pytest.approx(-2.5)}], "text_offset": [0]}
