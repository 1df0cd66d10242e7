"""Logprobs shapes, streamed and not: chat's ``logprobs.content`` (OpenAI's ChatCompletionTokenLogprob,
as the exo dashboard and evals read it) and legacy completions' parallel lists."""

from __future__ import annotations

import math

import pytest

from tests.compat.conftest import EXTERNAL, read_stream

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _check_entry(entry: dict) -> None:
    assert isinstance(entry["token"], str) and isinstance(entry["logprob"], float) and entry["logprob"] <= 0.0
    assert isinstance(entry["bytes"], list) and all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
    try:
        whole = bytes(entry["bytes"]).decode("utf-8")
    except UnicodeDecodeError:
        return  # part of a character: the raw bytes are in ``bytes``
    assert entry["token"] == whole, entry


def _joined_bytes_spell(text: str, content: list[dict]) -> None:
    """The tokens' bytes spell the text (llama.cpp's test: concatenated tokens equal the output), but
    for a character cut off by max_tokens at the end."""
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.startswith(text.encode("utf-8")) and len(joined) - len(text.encode("utf-8")) < 4, (joined, text)


def test_chat_logprobs(http, client, model):
    body = {"model": model, "messages": ASK, "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    r = http.post(CHAT, json=body).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for entry in content:
        _check_entry(entry)
        top = entry["top_logprobs"]
        assert len(top) == 3
        for alt in top:
            _check_entry(alt)
        assert [a["logprob"] for a in top] == sorted((a["logprob"] for a in top), reverse=True)
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy took the best
        assert sum(math.exp(a["logprob"]) for a in top) <= 1.0 + 1e-4
    _joined_bytes_spell(choice["message"]["content"], content)
    parsed = client.chat.completions.create(**body).choices[0].logprobs.content  # the client's types parse it
    assert [(t.token, len(t.top_logprobs)) for t in parsed] == [(e["token"], 3) for e in content]
    # logprobs without top_logprobs: the chosen tokens only
    bare = http.post(CHAT, json={**body, "top_logprobs": None}).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in bare] == [e["token"] for e in content] and all(e["top_logprobs"] == [] for e in bare)
    # not asked for: null
    off = http.post(CHAT, json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert off["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed_equal_non_streamed(http, model):
    body = {"model": model, "messages": ASK, "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 2}
    full = http.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    s = read_stream(http, CHAT, body)
    streamed, text = [], ""
    for chunk in s.chunks:
        choice = chunk["choices"][0]
        text += choice["delta"].get("content") or ""
        if choice["delta"].get("content"):
            assert choice["logprobs"] is not None and choice["logprobs"]["content"], chunk
        streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in full]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in full], abs=1e-4)
    _joined_bytes_spell(text, streamed)


def test_logprobs_are_the_models_not_the_samplers(http, model):
    """fleet reports the model's log-softmax before temperature (as vLLM and OpenAI do): the same
    tokens get the same logprobs whether sampled hot (top_k 1 forces them) or greedily."""
    body = {"model": model, "messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    greedy = http.post(CHAT, json={**body, "temperature": 0}).json()["choices"][0]["logprobs"]["content"]
    hot = http.post(CHAT, json={**body, "temperature": 1.8, "top_k": 1, "seed": 7}).json()
    hot = hot["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in hot] == [e["token"] for e in greedy]
    assert [e["logprob"] for e in hot] == pytest.approx([e["logprob"] for e in greedy], abs=1e-4)


def test_partial_characters_carry_raw_bytes(http, model):
    """A token ending inside a multi-byte character shows its raw bytes in ``bytes``."""
    messages = [{"role": "user", "content": "Write the Japanese word for Japan in kanji: 日本. Repeat: 日本語"}]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 12, "logprobs": True}
    r = http.post(CHAT, json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    for entry in content:
        _check_entry(entry)
    _joined_bytes_spell(r["choices"][0]["message"]["content"], content)
    if not EXTERNAL:  # the demo model's answer is Japanese, and its byte-level tokens split the characters
        split = [e for e in content if len(e["bytes"]) < 3 and e["bytes"] and e["bytes"][0] >= 0x80]
        assert split, content


def test_completion_logprobs(http, client, model):
    body = {"model": model, "prompt": "Red, orange, yellow,", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    r = http.post(COMPLETIONS, json=body).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert isinstance(logprob, float) and logprob <= 0.0 and len(top) == 2
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the best candidate
    parsed = client.completions.create(**body).choices[0].logprobs
    assert parsed.tokens == lp["tokens"] and parsed.text_offset == lp["text_offset"]
    s = read_stream(http, COMPLETIONS, body)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in s.chunks:
        part = chunk["choices"][0]["logprobs"]
        if chunk["choices"][0]["text"]:
            assert part is not None, chunk
        for key in streamed:
            streamed[key] += (part or {}).get(key, [])
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
