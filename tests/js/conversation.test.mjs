// The chat page's store (coordinator/api/static/conversation.js): conversations, settings and the key kept in a
// localStorage-like storage, checks of what comes from outside the page, the numbers line.
import assert from "node:assert/strict";
import { test } from "node:test";
import { ConversationStore, KEYS, conversationProblem, statsLine } from "../../coordinator/api/static/conversation.js";

// localStorage's interface over a Map; `quota` (characters) makes setItem throw as a full browser's does.
class MemoryStorage {
  constructor(quota = Infinity) { this.items = new Map(); this.quota = quota; }
  getItem(key) { return this.items.has(key) ? this.items.get(key) : null; }
  setItem(key, value) {
    if (String(value).length > this.quota) throw Object.assign(new Error("full"), { name: "QuotaExceededError" });
    this.items.set(key, String(value));
  }
  removeItem(key) { this.items.delete(key); }
}

const conversation = (id, messages = [{ role: "user", content: "hi" }, { role: "assistant", content: "hello" }]) =>
  ({ id, title: id, created: 1, messages });

test("a turn is kept, survives a reload, and a streaming answer left behind reads as stopped", () => {
  const storage = new MemoryStorage();
  const store = new ConversationStore(storage);
  assert.equal(store.load(), 0);
  assert.equal(store.conversations.length, 1);  // a new empty conversation is open
  const { conversation: c, question, answer } = store.startTurn("What is  the\ncapital?", "smol");
  assert.deepEqual([c.title, c.model, question.content, answer.state], ["What is the capital?", "smol",
    "What is  the\ncapital?", "streaming"]);
  answer.content = "Paris";
  store.save();
  const again = new ConversationStore(storage);
  again.load();
  assert.equal(again.current().id, c.id);
  assert.deepEqual(again.current().messages.map((m) => [m.role, m.content, m.state]),
    [["user", "What is  the\ncapital?", undefined], ["assistant", "Paris", "stopped"]]);
});

test("new chats reuse an empty one; deleting the open one opens the next, or a new one", () => {
  const store = new ConversationStore(new MemoryStorage());
  store.load();
  const empty = store.current();
  assert.equal(store.newConversation("m"), empty);
  store.startTurn("one", "m");
  const second = store.newConversation("m");
  assert.notEqual(second, empty);
  assert.deepEqual(store.conversations.map((c) => c.id), [second.id, empty.id]);
  store.remove(second);
  assert.equal(store.current(), empty);
  store.remove(empty);
  assert.equal(store.conversations.length, 1);
  assert.equal(store.current().messages.length, 0);
});

test("a turn refused for want of a key is taken back", () => {
  const store = new ConversationStore(new MemoryStorage());
  store.load();
  const { conversation: c, question } = store.startTurn("hi", "m");
  store.takeBack(c, question);
  assert.deepEqual(c.messages, []);
});

test("saved conversations the page cannot show are left out and counted", () => {
  const storage = new MemoryStorage();
  storage.setItem(KEYS.conversations, JSON.stringify([conversation("good"), { id: "bad", messages: "no" },
    conversation("bad-stats", [{ role: "assistant", content: "x", stats: { tokens_per_s: "x" } }])]));
  storage.setItem(KEYS.current, JSON.stringify("bad"));
  const store = new ConversationStore(storage);
  assert.equal(store.load(), 2);
  assert.deepEqual(store.conversations.map((c) => c.id), ["good"]);
  assert.equal(store.current().id, "good");
  storage.setItem(KEYS.conversations, "{not json");
  assert.equal(new ConversationStore(storage).load(), 0);
});

test("import adds what is new, first, and refuses a file with anything the page cannot show", () => {
  const store = new ConversationStore(new MemoryStorage());
  store.load();
  store.startTurn("mine", "m");
  const data = { format: "fleet-chat", version: 1, conversations: [conversation("a"),
    conversation("b", [{ role: "assistant", content: "x", state: "streaming" }])] };
  assert.deepEqual(store.importData(data), { added: 2, skipped: 0 });
  assert.deepEqual(store.conversations.map((c) => c.title), ["a", "b", "mine"]);
  assert.equal(store.conversations[1].messages[0].state, "stopped");
  assert.ok(store.conversations[0].messages.every((m) => typeof m.id === "string" && m.id));
  assert.deepEqual(store.importData(JSON.parse(JSON.stringify(data))), { added: 0, skipped: 2 });
  assert.throws(() => store.importData({ conversations: "x" }), /not a fleet chat export/);
  const bad = conversation("c", [{ role: "user", content: "q" }, { role: "assistant", content: "a", stats: "fast" }]);
  assert.throws(() => store.importData({ conversations: [conversation("d"), bad] }),
    /conversation 2: message 2: stats must be an object/);
  assert.equal(store.conversations.length, 3);  // nothing of a refused file is added
});

test("export holds the conversations with messages", () => {
  const store = new ConversationStore(new MemoryStorage());
  store.load();
  store.startTurn("q", "m");
  store.newConversation("m");
  const data = store.exportData(new Date("2026-01-02T03:04:05Z"));
  assert.deepEqual([data.format, data.version, data.exported, data.conversations.length],
    ["fleet-chat", 1, "2026-01-02T03:04:05.000Z", 1]);
});

test("a full storage is reported, not thrown", () => {
  const errors = [];
  const store = new ConversationStore(new MemoryStorage(10), (e) => errors.push(e.name));
  store.load();
  store.startTurn("a question longer than the quota", "m");
  assert.ok(errors.length > 0 && errors.every((n) => n === "QuotaExceededError"));
});

test("settings and the API key are kept, and the key can be forgotten", () => {
  const storage = new MemoryStorage();
  const store = new ConversationStore(storage);
  const defaults = { system: "", temperature: "", maxTokens: "" };
  assert.deepEqual(store.settings(defaults), defaults);
  store.saveSettings({ ...defaults, temperature: "0.5" });
  assert.equal(new ConversationStore(storage).settings(defaults).temperature, "0.5");
  assert.equal(store.apiKey(), "");
  store.saveApiKey("k-1");
  assert.equal(new ConversationStore(storage).apiKey(), "k-1");
  store.saveApiKey("");
  assert.equal(storage.getItem(KEYS.apiKey), null);
  storage.setItem(KEYS.apiKey, "42");
  assert.equal(store.apiKey(), "");  // not text: no key
});

test("conversationProblem names the field", () => {
  assert.equal(conversationProblem(conversation("x")), null);
  assert.equal(conversationProblem([]), "is [], not a conversation");
  assert.match(conversationProblem({ id: "", messages: [] }), /^id must be a short text/);
  assert.match(conversationProblem(conversation("x", [{ role: "system", content: "x" }])), /message 1: role must be/);
  assert.match(conversationProblem(conversation("x", [{ role: "user", content: 5 }])), /content must be text/);
  assert.match(conversationProblem(conversation("x", [{ role: "user", content: "x", state: "odd" }])), /state must be/);
  assert.match(conversationProblem(conversation("x", [{ role: "assistant", content: "x",
    stats: { completion_tokens: null, approximate: "yes" } }])), /stats.approximate must be true or false/);
});

test("statsLine", () => {
  assert.equal(statsLine({ state: "done", stats: { ttft_ms: 81.6, tokens_per_s: 12.34, completion_tokens: 7,
    prompt_tokens: 20, cached_tokens: 12, finish: "length" } }),
  "TTFT 82 ms · 12.3 tokens/s · 7 tokens · prompt 20, 12 cached · cut at max tokens");
  assert.equal(statsLine({ state: "stopped", stats: { completion_tokens: 3, approximate: true } }),
    "~3 tokens · stopped");
  assert.equal(statsLine({ role: "assistant" }), "");
});
