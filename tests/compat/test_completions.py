"""Legacy completions (``/v1/completions``) as Continue, LiteLLM's text-completion route and
``vllm bench serve`` send them: a raw prompt (string or token ids), streaming, stop, max_tokens,
and clear refusals of what fleet does not implement."""

from __future__ import annotations

import openai
import pytest

from tests.compat.conftest import assert_error, read_stream

pytestmark = pytest.mark.integration

COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is"


def test_completion_shape(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id and isinstance(r.created, int) and r.model == model
    (choice,) = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    u = r.usage
    assert 0 < u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_prompt_is_raw_not_chat(http, model):
    """The prompt is not run through the chat template: a 5-word prompt is a few tokens, where the
    same words as a chat message are wrapped in the template's system and role markup."""
    raw = http.post(COMPLETIONS, json={"model": model, "prompt": PROMPT, "max_tokens": 1}).json()
    chat = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": PROMPT}]}).json()
    assert raw["usage"]["prompt_tokens"] <= len(PROMPT.split()) + 2 < chat["usage"]["prompt_tokens"]


def test_token_id_prompt_equals_its_text(http, model):
    """A prompt of token ids (``vllm bench serve``, Continue) continues as the text they spell does."""
    first = http.post(COMPLETIONS, json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()
    ids = (first.get("fleet") or {}).get("completion_token_ids")
    if ids is None:
        pytest.skip("the server does not report completion token ids (fleet's extension)")
    text = first["choices"][0]["text"]
    by_ids = http.post(COMPLETIONS, json={"model": model, "prompt": ids, "max_tokens": 5, "temperature": 0})
    by_text = http.post(COMPLETIONS, json={"model": model, "prompt": text, "max_tokens": 5, "temperature": 0})
    assert by_ids.status_code == 200, by_ids.text
    assert by_ids.json()["usage"]["prompt_tokens"] == len(ids)
    if by_text.json()["usage"]["prompt_tokens"] == len(ids):  # the text tokenizes back to the same ids
        assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]
    one = http.post(COMPLETIONS, json={"model": model, "prompt": [ids], "max_tokens": 5, "temperature": 0})
    assert one.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]  # a list of one prompt


def test_stream_equals_non_stream(http, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = http.post(COMPLETIONS, json=body).json()
    s = read_stream(http, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    assert s.content_type.startswith("text/event-stream") and s.done
    assert len({c["id"] for c in s.chunks}) == 1 and all(c["object"] == "text_completion" for c in s.chunks)
    *pieces, last = s.chunks
    assert last["choices"] == [] and last["usage"] == full["usage"]
    assert "".join(c["choices"][0]["text"] for c in pieces) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in pieces if c["choices"][0]["finish_reason"]] == \
        [full["choices"][0]["finish_reason"]]


def test_stop_and_max_tokens(client, model):
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=40, temperature=0, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text and " 5" in r.choices[0].text
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=40, temperature=0,
                                            stop=[" 7"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=40, temperature=0, stop=[" 7"]).choices[0].text


def test_seeded_sampling_repeats(http, model):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
            "seed": 1234}
    texts = {http.post(COMPLETIONS, json=body).json()["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1
    # and the temperature and the seed are honoured: greedy, or another seed, answers otherwise
    (text,) = texts
    assert http.post(COMPLETIONS, json={**body, "temperature": 0}).json()["choices"][0]["text"] != text
    assert http.post(COMPLETIONS, json={**body, "seed": 4321}).json()["choices"][0]["text"] != text


REFUSED = [
    ({"prompt": ["one prompt", "another prompt"]}, "prompt"),
    ({"echo": True}, "echo"),
    ({"suffix": "the end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"n": 2}, "n"),
    ({"logprobs": 10_000}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [-5]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_refusals_name_the_field(http, client, model, extra, param):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, **extra}
    assert_error(http.post(COMPLETIONS, json=body), 400, param)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**body)
