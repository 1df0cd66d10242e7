// Tool calls on the chat page (coordinator/api/static/tools.js, and where sse.js, conversation.js and request.js
// use it): calls assembled from streamed deltas, kept through export and import, sent back in OpenAI's
// shape, results given to the calls that wait, the settings' tools checked.
import assert from "node:assert/strict";
import { test } from "node:test";
import { applyChunk, endAnswer, finishStats, newTiming } from "../../coordinator/api/static/sse.js";
import { ConversationStore, conversationProblem } from "../../coordinator/api/static/conversation.js";
import { requestBody, toolFields } from "../../coordinator/api/static/request.js";
import { addToolCallDeltas, apiMessage, callOf, parseTools, pendingCalls, prettyArguments }
  from "../../coordinator/api/static/tools.js";

class MemoryStorage {
  constructor() { this.items = new Map(); }
  getItem(key) { return this.items.has(key) ? this.items.get(key) : null; }
  setItem(key, value) { this.items.set(key, String(value)); }
  removeItem(key) { this.items.delete(key); }
}

const SETTINGS = { system: "", temperature: "", maxTokens: "", tools: "", toolChoice: "" };
const MODEL = { id: "smol", defaults: {}, fallback: null };
const WEATHER = [{ type: "function", function: { name: "get_weather", description: "The weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
const event = (delta, finish = null) => JSON.stringify({ id: "c", object: "chat.completion.chunk",
  choices: [{ index: 0, delta, finish_reason: finish }] });

// An answer of two calls as coordinator/api/tool_chat.py streams it: each call's first piece brings its
// index, id, type and name (and the first arguments), the later ones more arguments for an index.
const STREAM = [
  event({ role: "assistant", content: "" }),
  event({ content: "Let me look." }),
  event({ tool_calls: [{ index: 0, id: "call_a1", type: "function", function: { name: "get_weather", arguments: "{\"ci" } }] }),
  event({ tool_calls: [{ index: 0, function: { arguments: "ty\": \"Par" } }] }),
  event({ tool_calls: [{ index: 0, function: { arguments: "is\"}" } },
    { index: 1, id: "call_b2", type: "function", function: { name: "get_weather", arguments: "" } }] }),
  event({ tool_calls: [{ index: 1, function: { arguments: "{\"city\": \"Oslo\"}" } }] }),
  event({}, "tool_calls"),
];

function streamed() {
  const answer = { id: "a", role: "assistant", content: "", state: "streaming", stats: {} };
  const timing = newTiming(1000);
  STREAM.forEach((data, i) => applyChunk(answer, timing, data, 1100 + 10 * i));
  return { answer, timing };
}

test("streamed tool_calls deltas are assembled into calls, call by index, arguments piece by piece", () => {
  const { answer, timing } = streamed();
  assert.equal(answer.content, "Let me look.");
  assert.deepEqual(answer.tool_calls, [
    { id: "call_a1", type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Paris\"}" } },
    { id: "call_b2", type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Oslo\"}" } }]);
  assert.equal(answer.stats.finish, "tool_calls");
  endAnswer(answer);
  assert.equal(answer.state, "done");
  finishStats(answer, timing);
  assert.equal(answer.stats.completion_tokens, 5);  // text and call pieces count as chunks (no usage chunk)
  assert.equal(answer.stats.ttft_ms, 110);
});

test("a call's arguments read while they stream: as they came until they parse, then pretty-printed", () => {
  const answer = { content: "", stats: {} };
  addToolCallDeltas(answer, [{ index: 0, id: "call_x", type: "function", function: { name: "f", arguments: "{\"a\": [1," } }]);
  assert.deepEqual(prettyArguments(answer.tool_calls[0].function.arguments), { text: "{\"a\": [1,", valid: false });
  addToolCallDeltas(answer, [{ index: 0, function: { arguments: " 2]}" } }]);
  assert.deepEqual(prettyArguments(answer.tool_calls[0].function.arguments),
    { text: "{\n  \"a\": [\n    1,\n    2\n  ]\n}", valid: true });
  assert.equal(prettyArguments("<b>not json</b>").text, "<b>not json</b>");  // shown as text by messages.js
});

test("malformed tool_calls pieces are skipped, not a broken page", () => {
  const answer = { content: "", stats: {} };
  for (const pieces of [null, "x", [null], [{}], [{ index: -1 }], [{ index: 1.5 }], [{ index: 100000 }], { index: 0 }]) {
    assert.equal(addToolCallDeltas(answer, pieces), 0, JSON.stringify(pieces));
  }
  assert.equal(answer.tool_calls, undefined);
  assert.equal(addToolCallDeltas(answer, [{ index: 0, function: { name: 7, arguments: null } }]), 1);
  assert.deepEqual(answer.tool_calls, [{ id: "", type: "function", function: { name: "", arguments: "" } }]);
});

test("results go to the waiting calls in order; the last one asks the model's next turn", () => {
  const store = new ConversationStore(new MemoryStorage());
  store.load();
  const { conversation, answer } = store.startTurn("Weather in Paris and Oslo?", "smol");
  Object.assign(answer, streamed().answer);
  assert.deepEqual(pendingCalls(conversation), []);  // still streaming: its calls may be cut off
  answer.state = "done";
  assert.deepEqual(pendingCalls(conversation).map((c) => c.id), ["call_a1", "call_b2"]);
  const first = store.startToolResult("{\"celsius\": 21}", "smol");
  assert.equal(first.answer, null);
  assert.deepEqual([first.question.role, first.question.tool_call_id, first.question.name],
    ["tool", "call_a1", "get_weather"]);
  assert.deepEqual(pendingCalls(conversation).map((c) => c.id), ["call_b2"]);
  const second = store.startToolResult("cold", "smol");
  assert.equal(second.answer.state, "streaming");
  assert.deepEqual(pendingCalls(conversation), []);
  assert.equal(store.startToolResult("more", "smol"), null);
  assert.equal(callOf(conversation.messages, "call_b2").function.arguments, "{\"city\": \"Oslo\"}");

  const body = requestBody(conversation, second.answer, { ...SETTINGS, tools: JSON.stringify(WEATHER) }, MODEL);
  assert.deepEqual(body.messages, [
    { role: "user", content: "Weather in Paris and Oslo?" },
    { role: "assistant", content: "Let me look.", tool_calls: answer.tool_calls },
    { role: "tool", tool_call_id: "call_a1", content: "{\"celsius\": 21}", name: "get_weather" },
    { role: "tool", tool_call_id: "call_b2", content: "cold", name: "get_weather" }]);
  assert.deepEqual(body.tools, WEATHER);
  assert.equal(body.tool_choice, undefined);
  store.takeBack(conversation, second.question);  // a 401: the result and its answer go, the call waits again
  assert.deepEqual(pendingCalls(conversation).map((c) => c.id), ["call_b2"]);
});

test("an answer of calls alone is sent back with content null; a stopped one with no calls is left out", () => {
  const calls = [{ id: "call_1", type: "function", function: { name: "f", arguments: "{}" } }];
  assert.deepEqual(apiMessage({ role: "assistant", content: "", tool_calls: calls, state: "done" }),
    { role: "assistant", content: null, tool_calls: calls });
  assert.equal(apiMessage({ role: "assistant", content: "", state: "stopped" }), null);
  assert.deepEqual(apiMessage({ role: "user", content: "hi", at: 5 }), { role: "user", content: "hi" });
});

test("export and import keep calls and results; OpenAI's content null is taken; a conversation can be sent again", () => {
  const a = new ConversationStore(new MemoryStorage());
  a.load();
  const calls = [{ id: "call_q", type: "function", function: { name: "lookup", arguments: "{\"q\": \"<script>\"}" } }];
  const data = JSON.parse(JSON.stringify({ format: "fleet-chat", version: 1, conversations: [{ id: "t", title: "tools",
    messages: [{ role: "user", content: "find it" }, { role: "assistant", content: null, tool_calls: calls },
      { role: "tool", tool_call_id: "call_q", content: "found" }, { role: "assistant", content: "It is found." }] }] }));
  assert.deepEqual(a.importData(data), { added: 1, skipped: 0 });
  const exported = JSON.parse(JSON.stringify(a.exportData(new Date(0))));
  const b = new ConversationStore(new MemoryStorage());
  b.load();
  b.importData(exported);
  const c = b.conversations[0];
  assert.deepEqual(c.messages.map((m) => [m.role, m.content, m.tool_calls, m.tool_call_id]), [
    ["user", "find it", undefined, undefined], ["assistant", "", calls, undefined],
    ["tool", "found", undefined, "call_q"], ["assistant", "It is found.", undefined, undefined]]);
  b.open(c.id);
  const { answer } = b.startTurn("thanks", "smol");
  assert.deepEqual(requestBody(c, answer, SETTINGS, MODEL).messages.map((m) => [m.role, m.content]),
    [["user", "find it"], ["assistant", null], ["tool", "found"], ["assistant", "It is found."], ["user", "thanks"]]);
});

test("calls and results from outside the page are checked, the field named", () => {
  const conv = (m) => ({ id: "x", messages: [{ role: "user", content: "q" }, m] });
  const call = { id: "c1", type: "function", function: { name: "f", arguments: "{}" } };
  const cases = [
    [{ role: "assistant", content: "", tool_calls: "x" }, /tool_calls must be a list/],
    [{ role: "assistant", content: "", tool_calls: [{ ...call, id: 3 }] }, /tool_calls\[0\]\.id must be text/],
    [{ role: "assistant", content: "", tool_calls: [{ ...call, type: "code" }] }, /tool_calls\[0\]\.type must be "function"/],
    [{ role: "assistant", content: "", tool_calls: [{ id: "c", function: { name: "f", arguments: {} } }] },
      /function\.arguments must be text/],
    [{ role: "assistant", content: null }, /content must be text/],
    [{ role: "user", content: "x", tool_calls: [call] }, /a user message has no tool_calls/],
    [{ role: "tool", content: "r" }, /tool_call_id must be text/],
    [{ role: "tool", tool_call_id: "c1", content: 5 }, /content must be text/],
    [{ role: "system", content: "s" }, /role must be "user", "assistant" or "tool"/],
  ];
  for (const [message, expected] of cases) assert.match(conversationProblem(conv(message)), expected);
  assert.equal(conversationProblem(conv({ role: "assistant", content: null, tool_calls: [call] })), null);
  assert.equal(conversationProblem(conv({ role: "tool", tool_call_id: "c1", name: "f", content: "r" })), null);
});

test("the settings' tools: a list of function tools, or a problem that names the field", () => {
  assert.deepEqual(parseTools(""), { tools: null, problem: null });
  assert.deepEqual(parseTools(JSON.stringify(WEATHER)).tools, WEATHER);
  const problems = [["{", /not JSON/], ["[]", /non-empty JSON list/], ["{}", /non-empty JSON list/],
    ['[{"type": "code"}]', /tools\[0\]\.type must be "function"/],
    ['[{"type": "function", "function": {"name": "a b"}}]', /tools\[0\]\.function\.name/],
    ['[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]',
      /a second tool named f/],
    ['[{"type": "function", "function": {"name": "f", "parameters": []}}]', /parameters must be a JSON schema/]];
  for (const [text, expected] of problems) {
    assert.match(parseTools(text).problem, expected, text);
    assert.throws(() => toolFields({ tools: text }), expected);
  }
  assert.deepEqual(toolFields({ tools: JSON.stringify(WEATHER), toolChoice: "required" }),
    { tools: WEATHER, tool_choice: "required" });
  assert.deepEqual(toolFields({ tools: "", toolChoice: "required" }), {});  // no tools: no tool_choice
  // a forced choice is for the turn after the question, not the one after the results (it would call again)
  assert.deepEqual(toolFields({ tools: JSON.stringify(WEATHER), toolChoice: "required" }, "tool"), { tools: WEATHER });
});
