// What the chat page sends (coordinator/api/static/request.js): the sampling fallback comes from /v1/models.
import assert from "node:assert/strict";
import { test } from "node:test";
import { modelInfo, requestBody, samplingFields, samplingHint } from "../../coordinator/api/static/request.js";

const UNSET = { system: "", temperature: "", maxTokens: "" };
const FALLBACK = { temperature: 0, frequency_penalty: 0.3 };

test("a model without sampling defaults gets the coordinator's fallback_sampling", () => {
  const model = modelInfo({ id: "smol", generation_defaults: {}, fallback_sampling: FALLBACK });
  assert.deepEqual(model, { id: "smol", defaults: {}, fallback: FALLBACK });
  assert.deepEqual(samplingFields(UNSET, model), FALLBACK);
  assert.match(samplingHint(UNSET, model), /^Sends temperature 0, frequency_penalty 0.3; .*fallback/);
});

test("without fallback_sampling nothing is added: no penalty of the page's own", () => {
  for (const card of [{ id: "m" }, { id: "m", fallback_sampling: null }, { id: "m", fallback_sampling: "greedy" },
    { id: "m", fallback_sampling: { temperature: "0", frequency_penalty: null } }, null, "x"]) {
    const model = modelInfo(card);
    assert.equal(model.fallback, null, JSON.stringify(card));
    assert.deepEqual(samplingFields(UNSET, model), {});
    assert.equal(samplingHint(UNSET, model), "Sends nothing; the rest: the coordinator's defaults.");
  }
});

test("the coordinator decides: an empty fallback (a model with defaults of its own) adds nothing", () => {
  const model = modelInfo({ id: "m", generation_defaults: { temperature: 0.6 }, fallback_sampling: {} });
  assert.deepEqual(samplingFields(UNSET, model), {});
  assert.equal(samplingHint(UNSET, model), "Sends nothing; the rest: the model's defaults.");
});

test("the user's temperature replaces the fallback; max tokens goes with either", () => {
  const model = modelInfo({ id: "m", fallback_sampling: FALLBACK });
  assert.deepEqual(samplingFields({ ...UNSET, temperature: "0" }, model), { temperature: 0 });
  assert.deepEqual(samplingFields({ ...UNSET, temperature: "0.7", maxTokens: "64" }, model),
    { temperature: 0.7, max_tokens: 64 });
  assert.deepEqual(samplingFields({ ...UNSET, maxTokens: "64" }, model), { ...FALLBACK, max_tokens: 64 });
  // only numeric sampling fields of the fallback are sent
  const mixed = { temperature: 0, seed: 1, top_p: 0.9, frequency_penalty: "x" };
  assert.deepEqual(modelInfo({ fallback_sampling: mixed }).fallback, { temperature: 0, top_p: 0.9 });
});

test("the request carries the system prompt and the history, not the answer being asked for", () => {
  const answer = { role: "assistant", content: "" };
  const conversation = { messages: [{ role: "user", content: "q1" }, { role: "assistant", content: "a1" },
    { role: "assistant", content: "" }, { role: "user", content: "q2" }, answer] };
  const body = requestBody(conversation, answer, { ...UNSET, system: "Be brief." }, modelInfo({ id: "smol" }));
  assert.deepEqual(body, { model: "smol", stream: true, stream_options: { include_usage: true }, messages: [
    { role: "system", content: "Be brief." }, { role: "user", content: "q1" }, { role: "assistant", content: "a1" },
    { role: "user", content: "q2" }] });
});
