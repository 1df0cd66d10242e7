// What the chat page keeps (conversations, settings, the API key), in a localStorage-like store, and the
// checks of a conversation that comes from outside the page's own code (an imported file, or localStorage
// written by an older page): every field the page reads must have the type the page expects, so a file
// with "tokens_per_s": "x" is refused with its place named instead of breaking the page on every load.
// Messages are questions (user), answers (assistant: text, and the tool calls it made, in OpenAI's shape)
// and tool results (tool, with the tool_call_id of their call). And the numbers line under an answer. Pure (no DOM; the storage is passed in): node's tests import it.

import { pendingCalls, toolCallsProblem, toolMessageProblem } from "./tools.js";

const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
const STATES = ["done", "stopped", "error", "streaming"];
const STAT_NUMBERS = ["ttft_ms", "tokens_per_s", "browser_ttft_ms", "completion_tokens", "prompt_tokens",
  "cached_tokens"];
const MAX_TEXT = 10 * (1 << 20);  // characters of one message: localStorage holds about 5 MB in all
/** The localStorage keys of what the page keeps. */
export const KEYS = { conversations: "fleet.conversations", current: "fleet.current", settings: "fleet.settings",
  apiKey: "fleet.apiKey" };
const NEW_TITLE = "New chat";
const ROLES = ["user", "assistant", "tool"];

const shown = (v) => { const s = JSON.stringify(v); return s === undefined ? String(v) : s.slice(0, 40); };
const optional = (v, check) => v === undefined || v === null || check(v);
const isString = (v) => typeof v === "string";

function statsProblem(stats) {
  if (stats === undefined) return null;
  if (!stats || typeof stats !== "object" || Array.isArray(stats)) {
    return `stats must be an object, not ${shown(stats)}`;
  }
  for (const name of STAT_NUMBERS) {
    if (!optional(stats[name], (v) => isNumber(v) && v >= 0)) {
      return `stats.${name} must be a number, not ${shown(stats[name])}`;
    }
  }
  if (!optional(stats.finish, isString)) return `stats.finish must be text, not ${shown(stats.finish)}`;
  if (!optional(stats.measured, isString)) return `stats.measured must be text, not ${shown(stats.measured)}`;
  if (!optional(stats.approximate, (v) => typeof v === "boolean")) return "stats.approximate must be true or false";
  return null;
}

function messageProblem(m) {
  if (!m || typeof m !== "object") return `is ${shown(m)}, not a message`;
  if (!ROLES.includes(m.role)) return `role must be "user", "assistant" or "tool", not ${shown(m.role)}`;
  const calls = m.role === "assistant" ? toolCallsProblem(m.tool_calls) : null;
  if (calls) return calls;
  if (m.role !== "assistant" && m.tool_calls !== undefined) return `a ${m.role} message has no tool_calls`;
  if (m.role === "tool") {
    const problem = toolMessageProblem(m);
    if (problem) return problem;
  }
  // OpenAI's answer of calls alone has content null: the page keeps "" (settle)
  const nullOk = m.role === "assistant" && Array.isArray(m.tool_calls) && m.tool_calls.length;
  if (!isString(m.content) && !(nullOk && m.content === null)) return `content must be text, not ${shown(m.content)}`;
  if (m.content && m.content.length > MAX_TEXT) return `content is ${m.content.length} characters long (at most ${MAX_TEXT})`;
  if (!optional(m.id, isString)) return `id must be text, not ${shown(m.id)}`;
  if (!optional(m.at, isNumber)) return `at must be a time in ms, not ${shown(m.at)}`;
  if (!optional(m.state, (v) => STATES.includes(v))) return `state must be one of ${STATES.join(", ")}`;
  if (!optional(m.error, isString)) return `error must be text, not ${shown(m.error)}`;
  return statsProblem(m.stats);
}

/** What is wrong with conversation `c` (a short text naming the field), or null when the page can use it. */
export function conversationProblem(c) {
  if (!c || typeof c !== "object" || Array.isArray(c)) return `is ${shown(c)}, not a conversation`;
  if (!isString(c.id) || !c.id || c.id.length > 200) return `id must be a short text, not ${shown(c.id)}`;
  if (!optional(c.title, isString)) return `title must be text, not ${shown(c.title)}`;
  if (!optional(c.model, isString)) return `model must be text, not ${shown(c.model)}`;
  if (!optional(c.created, isNumber)) return `created must be a time in ms, not ${shown(c.created)}`;
  if (!Array.isArray(c.messages)) return "messages must be a list";
  for (let i = 0; i < c.messages.length; i++) {
    const problem = messageProblem(c.messages[i]);
    if (problem) return `message ${i + 1}: ${problem}`;
  }
  return null;
}

/** The numbers under an answer (TTFT, tokens/s, tokens, prompt and cached tokens, how it ended). */
export function statsLine(m) {
  const s = m.stats || {};
  const parts = [];
  if (isNumber(s.ttft_ms)) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (isNumber(s.tokens_per_s)) parts.push(`${s.tokens_per_s.toFixed(1)} tokens/s`);
  if (isNumber(s.completion_tokens)) parts.push(`${s.approximate ? "~" : ""}${s.completion_tokens} tokens`);
  if (isNumber(s.prompt_tokens)) {
    parts.push(`prompt ${s.prompt_tokens}` + (isNumber(s.cached_tokens) ? `, ${s.cached_tokens} cached` : ""));
  }
  if (m.state === "stopped") parts.push("stopped");
  else if (s.finish === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

/** A new id: time and randomness in base 36. */
export const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

// A message left streaming (the page went away mid-answer, or another browser exported it) is stopped;
// an answer of calls alone with content null (OpenAI's spelling) gets "".
function settle(c) {
  for (const m of c.messages) {
    if (m.state === "streaming") m.state = "stopped";
    if (m.content === null) m.content = "";
  }
}

/** The conversations, the open one, the settings and the API key, kept in `storage` (localStorage, or
 * anything with its getItem, setItem and removeItem); `onSaveError(error)` is told when a save fails
 * (the browser's quota), the page going on without it. */
export class ConversationStore {
  constructor(storage, onSaveError = () => {}) {
    this.storage = storage;
    this.onSaveError = onSaveError;
    this.conversations = [];
    this.currentId = null;
  }

  /** The stored value of `key` (JSON), or `fallback` when absent or unreadable. */
  read(key, fallback) {
    try {
      const value = this.storage.getItem(key);
      return value === null ? fallback : JSON.parse(value);
    } catch (e) {
      return fallback;
    }
  }

  /** Store `value` (as JSON) under `key`; false (and onSaveError told) when the storage refused it. */
  write(key, value) {
    try {
      this.storage.setItem(key, JSON.stringify(value));
      return true;
    } catch (e) {
      this.onSaveError(e);
      return false;
    }
  }

  /** Read the saved conversations, leaving out those the page cannot show; returns how many were left
   * out. The open conversation is the saved one, else the first, else a new empty one. */
  load() {
    let saved = this.read(KEYS.conversations, []);
    if (!Array.isArray(saved)) saved = [];
    this.conversations = saved.filter((c) => !conversationProblem(c));  // older pages' or hand-edited
    const leftOut = saved.length - this.conversations.length;
    this.conversations.forEach(settle);
    this.currentId = this.read(KEYS.current, null);
    if (!this.current()) this.currentId = this.conversations.length ? this.conversations[0].id : null;
    if (!this.current()) this.newConversation("");
    return leftOut;
  }

  /** Save the conversations and which one is open. */
  save() {
    this.write(KEYS.conversations, this.conversations);
    this.write(KEYS.current, this.currentId);
  }

  /** The open conversation, or null. */
  current() {
    return this.conversations.find((c) => c.id === this.currentId) || null;
  }

  /** Open the conversation of id `id` (and save that). */
  open(id) {
    this.currentId = id;
    this.save();
  }

  /** Open a new empty conversation for `model` (the open one when it is empty already) and return it. */
  newConversation(model) {
    const open = this.current();
    if (open && open.messages.length === 0) return open;  // reuse an empty one rather than pile them up
    const conversation = { id: uid(), title: NEW_TITLE, created: Date.now(), model, messages: [] };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  /** Delete conversation `c`; the first one left (or a new one) is opened if `c` was. */
  remove(c) {
    this.conversations = this.conversations.filter((x) => x !== c);
    if (this.currentId === c.id) this.currentId = this.conversations.length ? this.conversations[0].id : null;
    if (!this.current()) this.newConversation(c.model || "");
    this.save();
  }

  /** Start a turn in the open conversation: the user's `text` and an empty streaming answer by `model`,
   * saved. Returns {conversation, question, answer}. */
  startTurn(text, model) {
    const conversation = this.current() || this.newConversation(model);
    const question = { id: uid(), role: "user", content: text, at: Date.now() };
    const answer = { id: uid(), role: "assistant", content: "", at: Date.now(), state: "streaming", stats: {} };
    conversation.messages.push(question, answer);
    if (conversation.title === NEW_TITLE) conversation.title = text.replace(/\s+/g, " ").slice(0, 60);
    conversation.model = model || conversation.model;
    this.save();
    return { conversation, question, answer };
  }

  /** Give the open conversation's first call still waiting (tools.js pendingCalls) its result `text`: a
   * tool message with the call's tool_call_id and name; when no call waits any longer, an empty streaming
   * answer by `model` after it (the model's turn that reads the results), else none. Saved. Returns
   * {conversation, question: the tool message, answer (or null)}; null when no call waits. */
  startToolResult(text, model) {
    const conversation = this.current();
    const [call, ...others] = pendingCalls(conversation);
    if (!call) return null;
    const question = { id: uid(), role: "tool", tool_call_id: call.id, name: call.function.name, content: text,
      at: Date.now() };
    conversation.messages.push(question);
    let answer = null;
    if (!others.length) {
      answer = { id: uid(), role: "assistant", content: "", at: Date.now(), state: "streaming", stats: {} };
      conversation.messages.push(answer);
    }
    conversation.model = model || conversation.model;
    this.save();
    return { conversation, question, answer };
  }

  /** Take a turn back (its question or tool result, and its answer), as if it had not been sent. */
  takeBack(conversation, question) {
    const at = conversation.messages.indexOf(question);
    if (at >= 0) conversation.messages.splice(at, 2);
    this.save();
  }

  /** What Export writes: every conversation with messages, stamped with `now` (a Date). */
  exportData(now) {
    return { format: "fleet-chat", version: 1, exported: now.toISOString(),
      conversations: this.conversations.filter((c) => c.messages.length) };
  }

  /** Add the conversations of an export (`data`, parsed) that are not here yet, first in the list, and
   * save; returns {added, skipped}. Throws an Error naming the problem (and adds nothing) when any
   * conversation is one the page cannot show. */
  importData(data) {
    if (!data || !Array.isArray(data.conversations)) {
      throw new Error("not a fleet chat export (conversations with user, assistant and tool messages)");
    }
    data.conversations.forEach((c, i) => {
      const problem = conversationProblem(c);
      if (problem) throw new Error(`not a fleet chat export: conversation ${i + 1}: ${problem}`);
    });
    const known = new Set(this.conversations.map((c) => c.id));
    const added = data.conversations.filter((c) => !known.has(c.id));
    for (const c of added) {
      c.title = String(c.title || "Imported chat");
      for (const m of c.messages) m.id = m.id || uid();
      settle(c);
    }
    this.conversations = [...added, ...this.conversations];
    this.save();
    return { added: added.length, skipped: data.conversations.length - added.length };
  }

  /** The saved settings over `defaults`. */
  settings(defaults) {
    const saved = this.read(KEYS.settings, {});
    return { ...defaults, ...(saved && typeof saved === "object" ? saved : {}) };
  }

  /** Save the settings. */
  saveSettings(settings) {
    this.write(KEYS.settings, settings);
  }

  /** The saved API key, or "". */
  apiKey() {
    const key = this.read(KEYS.apiKey, "");
    return typeof key === "string" ? key : "";
  }

  /** Save the API key; "" forgets it. */
  saveApiKey(key) {
    if (key) this.write(KEYS.apiKey, key);
    else this.storage.removeItem(KEYS.apiKey);
  }
}
