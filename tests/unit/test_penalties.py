"""Repetition penalties on the last stage's candidates, and the model's sampling defaults (issue 20, item 7)."""

import json
from types import SimpleNamespace

import numpy as np

from coordinator.api.openai_schema import ChatCompletionRequest, resolve_sampling
from coordinator.engine.sampling import Penalties, generation_defaults, penalize, penalized_distribution

IDS = np.array([7, 3, 9], dtype=np.int64)
LOGPROBS = np.array([-0.5, -1.0, -3.0], dtype=np.float32)


def test_no_penalties_change_nothing():
    plain = penalized_distribution(IDS, LOGPROBS, 0.7, 0.9, Penalties(), {7: 5})
    assert not Penalties().active
    assert plain.ids.tolist() == [7, 3] and plain.probs.sum() == 1.0


def test_openai_frequency_and_presence_penalties():
    ids, scores = penalize(IDS, LOGPROBS, Penalties(frequency=0.4, presence=0.3), {7: 2, 9: 1})
    expected = {7: -0.5 - 0.4 * 2 - 0.3, 3: -1.0, 9: -3.0 - 0.4 - 0.3}
    assert ids.tolist() == [3, 7, 9]  # best first again
    assert np.allclose(scores, [expected[int(t)] for t in ids])


def test_repetition_penalty_scales_repeated_candidates_of_prompt_and_output():
    ids, scores = penalize(IDS, LOGPROBS, Penalties(repetition=2.0), {9: 1}, seen={7})
    assert dict(zip(ids.tolist(), scores.tolist())) == {7: -1.0, 3: -1.0, 9: -6.0}
    pos_ids, pos = penalize(np.array([1, 2]), np.array([4.0, -2.0]), Penalties(repetition=2.0), {}, seen={1, 2})
    assert dict(zip(pos_ids.tolist(), pos.tolist())) == {1: 2.0, 2: -4.0}  # positive divided, negative multiplied


def test_greedy_with_a_penalty_moves_off_the_repeated_token():
    d = penalized_distribution(IDS, LOGPROBS, 0.0, 1.0, Penalties(frequency=1.0), {7: 1})
    assert d.ids.tolist() == [3] and d.probs.tolist() == [1.0]


def test_top_k_cuts_after_the_penalties():
    d = penalized_distribution(IDS, LOGPROBS, 1.0, 1.0, Penalties(presence=5.0), {7: 1}, top_k=1)
    assert d.ids.tolist() == [3]


def test_generation_defaults_read_only_what_the_file_holds(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 200}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                             "repetition_penalty": 1.1, "max_tokens": 200}


def _engine(defaults: dict) -> SimpleNamespace:
    return SimpleNamespace(generation_defaults=defaults, settings=SimpleNamespace(max_tokens_default=512))


def test_model_defaults_fill_silent_fields_and_explicit_fields_win():
    engine = _engine({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 200})
    silent = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params, used = resolve_sampling(silent, engine)
    assert (params.temperature, params.top_p, params.max_tokens, params.penalties.repetition) == (0.6, 0.9, 200, 1.1)
    assert set(used["from_model"]) == {"temperature", "top_p", "repetition_penalty", "max_tokens"}
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=7,
                                     frequency_penalty=0.5, presence_penalty=0.25)
    params, used = resolve_sampling(explicit, engine)
    assert (params.temperature, params.max_tokens) == (0.0, 7)
    assert params.penalties == Penalties(0.5, 0.25, 1.1)
    assert "temperature" not in used["from_model"] and used["temperature"] == 0.0


def test_without_model_defaults_openai_defaults_apply():
    params, used = resolve_sampling(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), _engine({}))
    assert (params.temperature, params.top_p, params.max_tokens, params.penalties.active) == (1.0, 1.0, 512, False)
    assert used["from_model"] == []


def test_verify_targets_count_the_drafts_before_their_position():
    """In a verify step, position i's target is penalized for the drafts before it (its context if they are
    accepted): the same distribution plain decoding would sample from there."""
    from coordinator.engine.request import Request, SamplingParams

    request = Request("r", [1, 2], SamplingParams(max_tokens=8, temperature=0.0, penalties=Penalties(frequency=1.0)))
    assert request.target(IDS, LOGPROBS).ids.tolist() == [7]
    assert request.target(IDS, LOGPROBS, [7]).ids.tolist() == [3]
    request.append(7)
    assert request.target(IDS, LOGPROBS).ids.tolist() == [3]
    assert request.output_counts == {7: 1}
