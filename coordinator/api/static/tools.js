// Tool calling on the chat page (OpenAI's shape, as /v1/chat/completions speaks it): an answer's
// `tool_calls` assembled from the streamed `delta.tool_calls` pieces (index, then id, type, function.name
// and function.arguments pieces to append), the checks of calls and results that come from outside the
// page (an import), the calls still waiting for a result, the messages as the API takes them back, and
// the settings' "tools (JSON)" field read and checked. Pure (no DOM): node's tests import it.

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isString = (v) => typeof v === "string";
const shown = (v) => { const s = JSON.stringify(v); return s === undefined ? String(v) : s.slice(0, 40); };
const MAX_CALLS = 128;  // calls in one answer the page keeps (a stream that sends more is cut there)

/** Append the pieces of one chunk's `delta.tool_calls` (`pieces`, any value: non-lists and malformed items
 * are skipped) to `answer.tool_calls`, by OpenAI's streaming rules: a piece's `index` says which call it
 * continues; the first piece of a call brings its id, type and function.name, every piece may bring more
 * of function.arguments (JSON text, cut anywhere). Returns how many pieces were taken. */
export function addToolCallDeltas(answer, pieces) {
  if (!Array.isArray(pieces)) return 0;
  let taken = 0;
  for (const piece of pieces) {
    if (!isObject(piece) || !Number.isInteger(piece.index) || piece.index < 0 || piece.index >= MAX_CALLS) continue;
    const calls = answer.tool_calls || (answer.tool_calls = []);
    while (calls.length <= piece.index) calls.push({ id: "", type: "function", function: { name: "", arguments: "" } });
    const call = calls[piece.index];
    if (isString(piece.id) && piece.id) call.id = piece.id;
    if (isString(piece.type) && piece.type) call.type = piece.type;
    const fn = isObject(piece.function) ? piece.function : {};
    if (isString(fn.name) && fn.name && !call.function.name) call.function.name = fn.name;
    if (isString(fn.arguments)) call.function.arguments += fn.arguments;
    taken += 1;
  }
  return taken;
}

/** A call's arguments for reading: JSON pretty-printed (two spaces) when they parse, else the text as it
 * came (a call still streaming, or a model that wrote no valid JSON); `valid` says which. */
export function prettyArguments(text) {
  try {
    return { text: JSON.stringify(JSON.parse(text), null, 2), valid: true };
  } catch (e) {
    return { text: String(text), valid: false };
  }
}

/** What is wrong with an assistant message's `tool_calls` (a short text naming the field), or null. */
export function toolCallsProblem(calls) {
  if (calls === undefined) return null;
  if (!Array.isArray(calls)) return `tool_calls must be a list, not ${shown(calls)}`;
  if (calls.length > MAX_CALLS) return `tool_calls holds ${calls.length} calls (at most ${MAX_CALLS})`;
  for (let i = 0; i < calls.length; i++) {
    const c = calls[i];
    const at = `tool_calls[${i}]`;
    if (!isObject(c)) return `${at} must be an object, not ${shown(c)}`;
    if (!isString(c.id)) return `${at}.id must be text, not ${shown(c.id)}`;
    if (c.type !== undefined && c.type !== "function") return `${at}.type must be "function", not ${shown(c.type)}`;
    if (!isObject(c.function)) return `${at}.function must be an object, not ${shown(c.function)}`;
    if (!isString(c.function.name)) return `${at}.function.name must be text, not ${shown(c.function.name)}`;
    if (!isString(c.function.arguments)) {
      return `${at}.function.arguments must be text (JSON), not ${shown(c.function.arguments)}`;
    }
  }
  return null;
}

/** What is wrong with a tool message's own fields (its tool_call_id and name), or null. */
export function toolMessageProblem(m) {
  if (!isString(m.tool_call_id) || !m.tool_call_id) return `tool_call_id must be text, not ${shown(m.tool_call_id)}`;
  if (m.name !== undefined && !isString(m.name)) return `name must be text, not ${shown(m.name)}`;
  return null;
}

/** The call of id `id` among `messages` (the last assistant message before index `before` that made it),
 * or null. */
export function callOf(messages, id, before = messages.length) {
  for (let i = Math.min(before, messages.length) - 1; i >= 0; i--) {
    const calls = messages[i].role === "assistant" && messages[i].tool_calls;
    const call = calls && calls.find((c) => c.id === id);
    if (call) return call;
  }
  return null;
}

/** The calls of the conversation's last answer that have no tool message after it yet, in order (none
 * when its last message is not an answer with calls or a result; an answer that failed or was stopped
 * leaves none: its calls may be cut off). */
export function pendingCalls(conversation) {
  const messages = conversation ? conversation.messages : [];
  let i = messages.length - 1;
  while (i >= 0 && messages[i].role === "tool") i--;
  const answer = messages[i];
  if (!answer || answer.role !== "assistant" || !answer.tool_calls || !answer.tool_calls.length) return [];
  if (answer.state === "error" || answer.state === "stopped" || answer.state === "streaming") return [];
  const answered = new Set(messages.slice(i + 1).map((m) => m.tool_call_id));
  return answer.tool_calls.filter((c) => !answered.has(c.id));
}

/** Message `m` as the API takes it back: {role, content} for a question; an answer with calls keeps
 * them (content null when it has none); a result keeps its tool_call_id (and name). null for an answer
 * with neither text nor calls (nothing to send). */
export function apiMessage(m) {
  if (m.role === "tool") {
    return { role: "tool", tool_call_id: m.tool_call_id, content: m.content, ...(m.name ? { name: m.name } : {}) };
  }
  const calls = m.role === "assistant" && Array.isArray(m.tool_calls) && m.tool_calls.length ? m.tool_calls : null;
  if (m.role === "assistant" && !m.content && !calls) return null;
  if (!calls) return { role: m.role, content: m.content };
  return { role: "assistant", content: m.content || null, tool_calls: calls.map((c) => ({ id: c.id,
    type: "function", function: { name: c.function.name, arguments: c.function.arguments } })) };
}

/** The settings' "tools (JSON)" text read: {tools, problem}. Empty text: no tools (null). Otherwise a JSON
 * list of OpenAI function tools ({"type": "function", "function": {"name", "description"?, "parameters"?}}),
 * each checked; `problem` names what is wrong (and `tools` is null) when it is not one. */
export function parseTools(text) {
  if (!String(text).trim()) return { tools: null, problem: null };
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (e) {
    return { tools: null, problem: `tools: not JSON (${e.message})` };
  }
  if (!Array.isArray(tools) || !tools.length) return { tools: null, problem: "tools: must be a non-empty JSON list" };
  const names = new Set();
  for (let i = 0; i < tools.length; i++) {
    const t = tools[i];
    const at = `tools[${i}]`;
    if (!isObject(t) || t.type !== "function") return { tools: null, problem: `${at}.type must be "function"` };
    const fn = t.function;
    if (!isObject(fn) || !isString(fn.name) || !/^[A-Za-z0-9_-]{1,64}$/.test(fn.name)) {
      return { tools: null, problem: `${at}.function.name must be 1 to 64 letters, digits, _ or -` };
    }
    if (names.has(fn.name)) return { tools: null, problem: `${at}: a second tool named ${fn.name}` };
    names.add(fn.name);
    if (fn.description !== undefined && !isString(fn.description)) {
      return { tools: null, problem: `${at}.function.description must be text` };
    }
    if (fn.parameters !== undefined && !isObject(fn.parameters)) {
      return { tools: null, problem: `${at}.function.parameters must be a JSON schema object` };
    }
  }
  return { tools, problem: null };
}

/** The tool_choice values the settings offer ("" sends none: the API's default, auto with tools). */
export const TOOL_CHOICES = ["", "auto", "required", "none"];
