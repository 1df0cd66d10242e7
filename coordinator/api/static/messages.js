// The conversations on the page: the list of conversations, the messages of the open one (answers as
// markdown, with their numbers and failures; the tool calls an answer makes, one block per call, and the
// tools' results, each linked to its call), a streaming answer re-rendered in place, code blocks' Copy.
// Model output goes in as markdown.js's safe HTML or as text (textContent), never as HTML of its own.
import { $, banner, el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";
import { statsLine } from "./conversation.js";
import { callOf, prettyArguments } from "./tools.js";

/** Show the conversations of `store` (a ConversationStore), the open one marked; `onOpen(c)` and
 * `onDelete(c)` are called by each one's buttons. */
export function renderConversationList(store, { onOpen, onDelete }) {
  $("conversation-list").replaceChildren(...store.conversations.map((c) => {
    const open = el("button", { type: "button", class: "open", title: c.title }, c.title);
    open.addEventListener("click", () => onOpen(c));
    const remove = el("button", { type: "button", class: "delete", title: "delete this conversation",
      "aria-label": `delete ${c.title}` }, "×");
    remove.addEventListener("click", () => onDelete(c));
    return el("li", { class: c.id === store.currentId ? "active" : null, "data-id": c.id }, open, remove);
  }));
}

// A tool result's heading: whose result it is, and its call's id as a link to the call's block.
function resultHead(m, call) {
  const name = m.name || (call && call.function.name) || "a tool";
  const link = el("a", { href: "#", class: "call-link", "data-call-id": m.tool_call_id,
    title: call ? "show the call" : "the call is not in this conversation" }, m.tool_call_id);
  return el("div", { class: "who" }, "result of ", el("code", { class: "tool-name" }, name), " · ", link);
}

function messageNode(m, conversation) {
  const who = m.role === "tool" ? resultHead(m, callOf(conversation.messages, m.tool_call_id,
    conversation.messages.indexOf(m))) : el("div", { class: "who" }, m.role === "user" ? "you" : "fleet");
  const node = el("div", { class: `message ${m.role}`, "data-id": m.id }, who, el("div", { class: "content" }));
  if (m.role === "assistant") {
    node.append(el("div", { class: "tool-calls" }), el("div", { class: "stats" }),
      el("div", { class: "failure", role: "alert" }));
  }
  fillMessage(node, m);
  return node;
}

// One block per call: the function's name, its arguments pretty-printed (as they came while they do not
// parse yet: a call still streaming), the call's id small.
function callBlock(call) {
  const args = prettyArguments(call.function.arguments);
  return el("div", { class: "tool-call", "data-call-id": call.id },
    el("div", { class: "tool-head" }, el("span", { class: "tool-label" }, "calls "),
      el("code", { class: "tool-name" }, call.function.name || "…"), el("span", { class: "call-id" }, call.id)),
    el("pre", { class: `tool-args${args.valid ? "" : " raw"}` }, args.text));
}

// Fill (or refill, while an answer streams) a message's node in place.
function fillMessage(node, m) {
  node.dataset.state = m.state || "done";
  const content = node.querySelector(".content");
  if (m.role === "tool") {  // a result: JSON pretty-printed, other text as it is
    const result = prettyArguments(m.content);
    content.replaceChildren(el("pre", { class: "tool-result" }, result.valid ? result.text : m.content));
    return;
  }
  if (m.role !== "assistant") {
    content.textContent = m.content;
    return;
  }
  const calls = m.tool_calls || [];
  node.querySelector(".tool-calls").replaceChildren(...calls.map(callBlock));
  if (calls.length) node.dataset.calls = String(calls.length);
  try {
    content.innerHTML = renderMarkdown(m.content);
  } catch (e) {  // a renderer bug must not make the conversation unreadable: show the text as it is
    content.textContent = m.content;
  }
  const stats = node.querySelector(".stats");
  stats.textContent = statsLine(m);
  stats.title = m.stats && m.stats.measured ? `measured by ${m.stats.measured}` : "";
  const failure = node.querySelector(".failure");
  failure.textContent = m.error || "";
  failure.hidden = !m.error;
}

/** Show the messages of `conversation` (or none), scrolled to the end. */
export function renderMessages(conversation) {
  const box = $("messages");
  const nodes = conversation ? conversation.messages.map((m) => messageNode(m, conversation)) : [];
  $("empty-hint").hidden = nodes.length > 0;
  box.replaceChildren($("empty-hint"), ...nodes);
  box.scrollTop = box.scrollHeight;
}

/** Re-render message `m` in place (a streaming answer), keeping the view at the bottom if it was there;
 * nothing when its conversation is not the one shown. */
export function updateMessage(m) {
  const box = $("messages");
  const old = box.querySelector(`.message[data-id="${CSS.escape(m.id)}"]`);
  if (!old) return;
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  fillMessage(old, m);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

// A streaming answer is re-rendered whole (markdown needs its context) at most every 40 ms, and never
// sooner than 4x its last render took after it: rendering takes at most a fifth of the page's time,
// however long the answer grows.
let updateTimer = null;
let renderMs = 0;

/** Re-render the streaming answer `m` soon (see above); calls while one is pending are folded into it. */
export function scheduleUpdate(m) {
  if (updateTimer !== null) return;
  updateTimer = setTimeout(() => {
    updateTimer = null;
    const start = performance.now();
    updateMessage(m);
    renderMs = performance.now() - start;
  }, Math.max(40, 4 * renderMs));
}

/** Scroll to the block of the call a tool result's `link` names, and mark it a moment. */
export function showCall(link) {
  const block = $("messages").querySelector(`.tool-call[data-call-id="${CSS.escape(link.dataset.callId)}"]`);
  if (!block) return;
  block.scrollIntoView({ block: "center", behavior: "smooth" });
  block.classList.add("flash");
  setTimeout(() => block.classList.remove("flash"), 1200);
}

/** Copy the code of the code block whose Copy `button` was pressed, and say so on the button. */
export function copyCode(button) {
  const code = button.closest(".code").querySelector("code").textContent;
  const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(code).then(done, () => banner("The browser refused the clipboard."));
    return;
  }
  // plain http on a LAN address is no secure context: fall back to a selection and the copy command
  const area = el("textarea", { readonly: true, class: "offscreen" });
  area.value = code;
  document.body.append(area);
  area.select();
  if (document.execCommand("copy")) done();
  area.remove();
}
