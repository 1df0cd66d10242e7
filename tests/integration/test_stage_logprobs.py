"""At ``--inference-precision f32 --threads 1`` a 2-stage fleet's last stage reports the same top-5
logprobs as the 1-stage build, bit for bit, over a prefill and decode steps (docs/precision.md: f32
gives the same answers whatever the shapes; here, whatever the cut between stages). Both sides are
real fleets (workers as processes, gRPC on loopback, the real coordinator's ``logprobs`` fields), so
the comparison covers the hidden states on the wire between the stages and the last stage's top-k."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import Fleet, chat

pytestmark = pytest.mark.integration

PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.")
NEW_TOKENS = 6  # the prefill's token and five decode steps
TOP = 5


def top_logprobs(url: str) -> dict[str, tuple[list[int], np.ndarray, np.ndarray]]:
    """Per prompt: (the completion's token ids, its top candidates' texts [NEW_TOKENS, TOP] best first, their
    logprobs [NEW_TOKENS, TOP] float64) from a greedy completion with ``logprobs``; the API's JSON floats are
    the last stage's float32 values, so they compare exactly."""
    out = {}
    for prompt in PROMPTS:
        r = chat(url, prompt, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP)
        assert r.status_code == 200, r.text
        records = r.json()["choices"][0]["logprobs"]["content"]
        assert len(records) == NEW_TOKENS and all(len(t["top_logprobs"]) == TOP for t in records), records
        tokens = np.array([[c["token"] for c in t["top_logprobs"]] for t in records])
        logprobs = np.array([[c["logprob"] for c in t["top_logprobs"]] for t in records])
        out[prompt] = (r.json()["fleet"]["completion_token_ids"], tokens, logprobs)
    return out


def test_two_stages_give_the_one_stage_builds_top_logprobs_bit_for_bit(build_1, build_2, tmp_path):
    got = {}
    for build, name in ((build_1, "1-stage"), (build_2, "2-stage")):
        (tmp_path / name).mkdir()
        fleet = Fleet(build, tmp_path / name, peers=True)  # workers: --inference-precision f32 --threads 1
        try:
            got[name] = top_logprobs(fleet.url)
        finally:
            fleet.stop()
    for prompt in PROMPTS:
        (ids1, top1, lp1), (ids2, top2, lp2) = got["1-stage"][prompt], got["2-stage"][prompt]
        assert ids1 == ids2, f"{prompt!r}: greedy tokens {ids1} vs {ids2}"
        assert np.array_equal(top1, top2), f"{prompt!r}: top-{TOP} candidates differ:\n{top1}\n{top2}"
        assert np.all(np.diff(lp1, axis=1) <= 0) and np.all(lp1 < 0), lp1  # best first, real log-probabilities
        assert np.array_equal(lp1, lp2), (f"{prompt!r}: top-{TOP} logprobs differ by up to "
                                          f"{np.abs(lp1 - lp2).max():.3e}:\n{lp1}\n{lp2}")
