"""Grammar-constrained decoding's pure parts: the last stage's masked top-k, a batched step's masks, and the
request's grammar state (llguidance over the demo's real tokenizer) as the step loop and the draft use it.
Through real workers: tests/integration/test_structured.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.engine.constraint import Constraint, Grammars, allowed_tokens, mask_words
from coordinator.errors import InvalidRequest
from coordinator.engine.group import BatchGroup, Chunk, Member
from coordinator.engine.output import OutputProcessor
from coordinator.engine.request import FinishReason, Request, SamplingParams
from coordinator.engine.speculative import StepCostsByLoad
from coordinator.tokenizer import ChatTokenizer
from fleet_common.runtime import top_candidates, unpack_token_mask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def pack(allowed: np.ndarray) -> np.ndarray:
    """Booleans [N, V] packed as llguidance does: [N, ceil(V / 32)] int32, bit j of word i = token 32 i + j."""
    n, v = allowed.shape
    padded = np.zeros((n, mask_words(v) * 32), dtype=bool)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def test_the_mask_layout_round_trips():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 1000)) < 0.1
    mask = pack(allowed)
    assert mask.shape == (3, 32) and mask.dtype == np.int32
    np.testing.assert_array_equal(unpack_token_mask(mask, 1000), allowed)
    np.testing.assert_array_equal(allowed_tokens(mask, 1000), allowed)


def test_masked_top_k_returns_only_allowed_tokens_with_the_constrained_logprobs():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 500)).astype(np.float32)
    allowed = np.zeros((2, 500), dtype=bool)
    allowed[0, [3, 7, 11, 400]] = True
    allowed[1, 250:] = True
    ids, logprobs = top_candidates(logits, 6, allowed)
    assert set(ids[0, :4]) == {3, 7, 11, 400} and np.all(np.isneginf(logprobs[0, 4:]))  # 4 allowed: the rest -inf
    assert np.all(ids[1] >= 250)
    for row in range(2):  # log-softmax over the allowed tokens only
        kept = logits[row][allowed[row]]
        lse = np.log(np.exp(kept - kept.max()).sum()) + kept.max()
        best = int(ids[row, 0])
        assert logprobs[row, 0] == pytest.approx(logits[row, best] - lse, abs=1e-5)
        assert best == int(np.flatnonzero(allowed[row])[np.argmax(kept)])
    plain_ids, _ = top_candidates(logits, 6)
    np.testing.assert_array_equal(top_candidates(logits, 6, np.ones_like(allowed))[0], plain_ids)


def test_a_batched_step_carries_each_rows_masks_in_its_positions():
    group = BatchGroup(None, slack=4, max_rows=4, compact_share=0.5, compact_min_slots=64)
    members = [Member(f"s{i}", 64, 4) for i in range(3)]
    group.rows = group.members = members
    group.length = 4
    words = 4
    verify = np.arange(3 * words, dtype=np.int32).reshape(3, words)  # a 2-draft verify under a grammar
    plain = np.full((1, words), 5, dtype=np.int32)
    chunks = [Chunk([1, 2, 3], 4, 3, 1, verify), Chunk([1], 4, 1, 1, None), Chunk([9], 4, 1, 1, plain)]
    plan = group.step_plan(chunks)
    mask = plan.token_mask.reshape(3, 3, words)
    np.testing.assert_array_equal(mask[0], verify)
    assert np.all(mask[1] == -1)  # no grammar: every token
    assert np.all(mask[2, :2] == -1) and np.array_equal(mask[2, 2:], plain)  # the short chunk's last position
    assert group.step_plan([Chunk([1], 4, 1, 1), Chunk([1], 4, 1, 1), Chunk([1], 4, 1, 1)]).token_mask is None


@pytest.fixture(scope="module")
def grammars(demo_hf) -> Grammars:
    tokenizer = ChatTokenizer(demo_hf)
    return Grammars(tokenizer.tokenizer.to_str, 49152, {2})


@pytest.fixture(scope="module")
def chat_tokenizer(demo_hf) -> ChatTokenizer:
    return ChatTokenizer(demo_hf)


def test_a_verify_steps_masks_follow_the_drafts_and_leave_the_state(grammars, chat_tokenizer):
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    text = '{"name":"ab","n":42}'
    ids = chat_tokenizer.encode(text)
    allowed, masks = matcher.masks(ids[:4])
    assert allowed == 4 and masks.shape == (5, mask_words(49152))
    for i in range(4):
        assert allowed_tokens(masks[i:i + 1], 49152)[0, ids[i]]  # each draft allowed where it stands
    again = matcher.masks([])  # the state did not move
    assert again[0] == 0
    np.testing.assert_array_equal(again[1][0], masks[0])
    assert not allowed_tokens(masks[:1], 49152)[0, chat_tokenizer.encode("hello")[0]]
    # a prompt-lookup draft is cut before its first refused token, the state left as it was
    allowed, cut = matcher.masks(ids[:2] + chat_tokenizer.encode("[1]"))  # '{"' 'name' then no key goes on with '['
    assert allowed == 2 and cut.shape[0] == 3
    np.testing.assert_array_equal(cut, masks[:3])
    assert matcher.masks(chat_tokenizer.encode("[1]"))[0] == 0
    np.testing.assert_array_equal(matcher.masks([])[1][0], masks[0])
    for t in ids:
        matcher.consume(t)
    assert matcher.stopped  # the object is complete: only the end of sequence may follow
    end = allowed_tokens(matcher.masks([])[1], 49152)[0]
    assert end[2] and end.sum() == 1


def test_the_output_processor_ends_a_request_whose_grammar_is_complete(grammars, chat_tokenizer):
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0,
                                                     constraint=Constraint.json_schema(SCHEMA)))
    request.grammar = grammars.matcher(request.params.constraint)
    output = OutputProcessor(request, chat_tokenizer, {2}, StepCostsByLoad(lambda: 1), 4, None, False)
    ids = chat_tokenizer.encode('{"name":"ab","n":7}')
    delta = output.take(ids)
    assert request.finish_reason is FinishReason.STOP and json.loads(delta.text) == {"name": "ab", "n": 7}
    assert request.output_ids == ids


@pytest.mark.parametrize("constraint, message", [
    (Constraint("lark", "start: nothing_here"), "unknown name"),
    (Constraint("regex", "a(b"), "regex"),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(grammars, constraint, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        grammars.matcher(constraint)
    assert caught.value.param == "response_format" and caught.value.status == 400


def test_compile_errors_keep_their_reason_and_json_schemas_true_and_false(grammars):
    """A multi-line compile error keeps its reason (it was cut to 'regex parse error:'); JSON Schema's
    ``true`` is any value (llguidance takes only objects: 'Expecting object schema'), ``false`` refused."""
    with pytest.raises(InvalidRequest, match="unclosed group"):
        grammars.matcher(Constraint.json_schema({"type": "string", "pattern": "(("}))
    assert grammars.matcher(Constraint.json_schema(True)).masks([])[1].any()
    with pytest.raises(InvalidRequest, match="allows no value"):
        Constraint.json_schema(False)
    with pytest.raises(InvalidRequest, match="allows no output") as caught:  # no first token: a 400 at once
        grammars.matcher(Constraint.json_schema({"$ref": "#"}))
    assert "<state>" not in str(caught.value)


def test_json_schemas_unknown_fields_are_refused_by_name():
    for spec, words in (({"extra": 1}, "json_schema.extra"), ({"strict": "yes"}, "strict must be true or false")):
        with pytest.raises(InvalidRequest, match=words) as caught:
            chat_request(response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object"}, **spec}}).refuse_unsupported()
        assert caught.value.param == "response_format"


def chat_request(**fields):  # noqa: ANN201 - ChatCompletionRequest
    from coordinator.api.openai_schema import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)


def test_other_servers_constrained_outputs_are_honoured_and_their_samplers_refused_by_name(grammars, chat_tokenizer):
    """vLLM's guided_json / guided_regex / guided_choice and llama.cpp's json_schema become the request's
    constraint (clients written for them would otherwise get unconstrained text that looks like success);
    their samplers and grammars fleet lacks are a 400 naming them, unless set to what changes nothing."""
    choice = chat_request(guided_choice=["yes", 'a "b"']).output_constraint()
    matcher = grammars.matcher(choice)
    for t in chat_tokenizer.encode('a "b"'):
        matcher.consume(t)
    assert matcher.stopped
    assert chat_request(guided_json='{"type": "object"}').output_constraint() == Constraint.json_schema(
        {"type": "object"}, "guided_json")
    assert chat_request(json_schema={"type": "string"}).output_constraint().field == "json_schema"
    assert chat_request(guided_regex="[0-9]+").output_constraint() == Constraint("regex", "[0-9]+", "guided_regex")
    chat_request(min_p=0.0, mirostat=0, grammar="").refuse_unsupported()  # their "off" values pass
    for fields, param in [({"min_p": 0.05}, "min_p"), ({"grammar": "root ::= \"a\""}, "grammar"),
                          ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
                          ({"response_format": {"type": "json_object"}, "json_schema": {}}, "json_schema"),
                          ({"guided_json": "{not json"}, "guided_json")]:
        with pytest.raises(InvalidRequest) as caught:
            chat_request(**fields).refuse_unsupported()
        assert caught.value.param == param, (fields, caught.value.message)
