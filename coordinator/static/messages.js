// The conversations on the page: the list of conversations, the messages of the open one (answers as
// markdown, with their numbers and failures), a streaming answer re-rendered in place, code blocks' Copy.
import { $, banner, el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";
import { statsLine } from "./conversation.js";

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

function messageNode(m) {
  const node = el("div", { class: `message ${m.role}`, "data-id": m.id },
    el("div", { class: "who" }, m.role === "user" ? "you" : "fleet"), el("div", { class: "content" }));
  if (m.role === "assistant") {
    node.append(el("div", { class: "stats" }), el("div", { class: "failure", role: "alert" }));
  }
  fillMessage(node, m);
  return node;
}

// Fill (or refill, while an answer streams) a message's node in place.
function fillMessage(node, m) {
  node.dataset.state = m.state || "done";
  const content = node.querySelector(".content");
  if (m.role !== "assistant") {
    content.textContent = m.content;
    return;
  }
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
  const nodes = conversation ? conversation.messages.map(messageNode) : [];
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
