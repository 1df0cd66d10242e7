// fleet's chat page, its entry module. Conversations, settings and the API key live in this browser's
// localStorage (conversation.js); answers stream from POST /v1/chat/completions (fetch and sse.js), Stop
// aborts the fetch, which the coordinator sees as a disconnect and answers by ending the generation and
// freeing the session's KV on every stage; messages.js shows them (markdown.js renders the answers), and
// fleet.js polls GET /health for the fleet panel. The model and its sampling come from GET /v1/models
// (request.js). Tool calls an answer makes show as blocks; while calls wait, what the user sends is the
// next call's result (a tool message), and the last result asks the model's next turn (tools.js).
import { $, banner, el } from "./dom.js";
import { ConversationStore } from "./conversation.js";
import { copyCode, renderConversationList, renderMessages, scheduleUpdate, showCall, updateMessage }
  from "./messages.js";
import { refreshFleet, startFleetPanel } from "./fleet.js";
import { modelInfo, requestBody, samplingHint, toolFields } from "./request.js";
import { parseTools, pendingCalls } from "./tools.js";
import { applyChunk, endAnswer, finishStats, newTiming, sseData } from "./sse.js";
import { renderMarkdown } from "./markdown.js";

const store = new ConversationStore(localStorage, (e) =>
  banner(`This browser would not save the chat (${e.name}): export it, then delete old conversations.`));
const state = {
  apiKey: "", model: modelInfo(null),
  settings: { system: "", temperature: "", maxTokens: "", tools: "", toolChoice: "" },
  streaming: null,  // {controller, answer, conversation} while an answer streams
  pendingSend: null,  // text refused for want of a key: sent again once a key is accepted
};

// ---- conversations ------------------------------------------------------------------------------
function renderAll() {
  renderConversationList(store, { onOpen: openConversation, onDelete: deleteConversation });
  renderMessages(store.current());
  showComposerHint();
}

// While the open conversation's last answer has calls without results, the message box takes the next
// call's result.
function showComposerHint() {
  const [call] = pendingCalls(store.current());
  $("input").placeholder = call ? `Result of ${call.function.name} (${call.id}), sent as the tool's answer`
    : "Message the fleet";
  $("input").classList.toggle("awaiting-result", Boolean(call));
}

function openConversation(c) {
  store.open(c.id);
  renderAll();
}

function deleteConversation(c) {
  if (c.messages.length && !confirm(`Delete "${c.title}"?`)) return;
  if (state.streaming && state.streaming.conversation === c) state.streaming.controller.abort();
  store.remove(c);
  renderAll();
}

// ---- sending ------------------------------------------------------------------------------------
const headers = () => ({ "Content-Type": "application/json",
  ...(state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {}) });

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

// Read the answer's stream into `answer`, re-rendering it as it grows and saving it every second.
async function readAnswer(response, answer, timing) {
  let saved = performance.now();
  for await (const data of sseData(response.body)) {
    applyChunk(answer, timing, data, performance.now());
    scheduleUpdate(answer);
    if (performance.now() - saved > 1000) { store.save(); saved = performance.now(); }
  }
  endAnswer(answer);
}

async function send(text) {
  text = (text !== undefined ? text : $("input").value).trim();
  if (!text || state.streaming) return;
  try {
    toolFields(state.settings);
  } catch (e) {
    banner(`Not sent: ${e.message} (Settings → Tools).`);
    return;
  }
  $("input").value = "";
  const { conversation, question, answer } = pendingCalls(store.current()).length
    ? store.startToolResult(text, state.model.id) : store.startTurn(text, state.model.id);
  renderAll();
  if (!answer) return;  // more calls wait for their results
  const controller = new AbortController();
  state.streaming = { controller, answer, conversation };
  setStreaming(true);
  const timing = newTiming(performance.now());
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(conversation, answer, state.settings, state.model)),
      signal: controller.signal });
    if (response.status === 401) {  // take the turn back, ask for a key, then send it again
      store.takeBack(conversation, question);
      state.pendingSend = text;
      openKeyDialog(state.apiKey ? await errorMessage(response) : null);
      return;
    }
    if (!response.ok) {
      answer.state = "error";
      answer.error = await errorMessage(response);
      return;
    }
    await readAnswer(response, answer, timing);
  } catch (e) {
    if (e.name === "AbortError") answer.state = "stopped";
    else { answer.state = "error"; answer.error = `lost the coordinator mid-answer: ${e.message}`; }
  } finally {
    finishStats(answer, timing);
    state.streaming = null;
    setStreaming(false);
    store.save();
    if (conversation.messages.includes(answer)) updateMessage(answer);
    else renderMessages(store.current());
    showComposerHint();
    renderConversationList(store, { onOpen: openConversation, onDelete: deleteConversation });
    setTimeout(refreshFleet, 1200);  // the stages' KV after the answer (workers report once a second)
  }
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  if (on) $("stop").focus(); else $("input").focus();
}

// ---- settings and the API key --------------------------------------------------------------------
const SETTING_INPUTS = { system: "settings-system", temperature: "settings-temperature",
  maxTokens: "settings-max-tokens", tools: "settings-tools", toolChoice: "settings-tool-choice" };

const showSamplingHint = () => {
  $("sampling-hint").textContent = samplingHint(state.settings, state.model);
  const { tools, problem } = parseTools(state.settings.tools);
  $("tools-hint").textContent = problem || (tools ? `Sends ${tools.length} tool(s): ` +
    tools.map((t) => t.function.name).join(", ") : "No tools sent.");
  $("tools-hint").classList.toggle("error", Boolean(problem));
};

function bindSettings() {
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    $(id).value = state.settings[name];
    $(id).addEventListener("input", () => {
      state.settings[name] = $(id).value;
      store.saveSettings(state.settings);
      showSamplingHint();
    });
  }
  $("change-key").addEventListener("click", () => openKeyDialog(null));
  $("forget-key").addEventListener("click", () => {
    state.apiKey = "";
    store.saveApiKey("");
    $("forget-key").hidden = true;
    loadModel();
  });
}

function openKeyDialog(error) {
  $("key-error").textContent = error || "";
  $("key-error").hidden = !error;
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

async function onKeySubmit(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  const response = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` } }).catch((e) => e);
  if (!(response instanceof Response) || !response.ok) {
    openKeyDialog(response instanceof Response ? await errorMessage(response)
      : `cannot reach the coordinator: ${response.message}`);
    return;
  }
  state.apiKey = key;
  store.saveApiKey(key);
  $("forget-key").hidden = false;
  closeKeyDialog();
  await loadModel();
  const pending = state.pendingSend;
  state.pendingSend = null;
  if (pending) send(pending);
}

// Closing a modal dialog gives the focus back to the message box, but Chromium then does not always
// put typed text there (seen after a click on the dialog's buttons): a blur and focus makes it take keys.
function closeKeyDialog() {
  $("key-dialog").close();
  $("input").blur();
  $("input").focus();
}

function onKeyCancel() {
  closeKeyDialog();
  if (state.pendingSend) { $("input").value = state.pendingSend; state.pendingSend = null; }
  banner("This fleet requires an API key: Settings → API key…");
}

async function loadModel() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    banner(`Cannot reach the coordinator (${e.message}); trying again.`);
    setTimeout(loadModel, 3000);
    return;
  }
  if (response.status === 401) {
    openKeyDialog(state.apiKey ? await errorMessage(response) : null);
    return;
  }
  if (response.status === 503) {  // the fleet is being prepared (serve --model SOURCE): the fleet panel says how far
    banner(`${await errorMessage(response)}`);
    setTimeout(loadModel, 3000);
    return;
  }
  if (!response.ok) {
    banner(`/v1/models: ${await errorMessage(response)}`);
    return;
  }
  const body = await response.json().catch(() => ({}));
  state.model = modelInfo(Array.isArray(body.data) ? body.data[0] : null);
  $("model-name").textContent = state.model.id;
  banner("");
  showSamplingHint();
}

// ---- export and import ---------------------------------------------------------------------------
function exportAll() {
  const data = store.exportData(new Date());
  const file = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const link = el("a", { href: URL.createObjectURL(file), download: `fleet-chats-${data.exported.slice(0, 10)}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

async function importFile(file) {
  try {
    const { added, skipped } = store.importData(JSON.parse(await file.text()));
    renderAll();
    banner(`Imported ${added} conversation(s)` + (skipped ? `; ${skipped} were here already.` : "."));
  } catch (e) {
    banner(`Cannot import ${file.name}: ${e.message}`);
  }
}

// ---- start ----------------------------------------------------------------------------------------
function bindControls() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => state.streaming && state.streaming.controller.abort());
  $("new-chat").addEventListener("click", () => {
    store.newConversation(state.model.id);
    renderAll();
    $("input").focus();
  });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", (e) => {
    if (e.target.files[0]) importFile(e.target.files[0]);
    e.target.value = "";
  });
  $("messages").addEventListener("click", (e) => {
    if (e.target.classList.contains("copy")) copyCode(e.target);
    if (e.target.classList.contains("call-link")) { e.preventDefault(); showCall(e.target); }
  });
  $("key-form").addEventListener("submit", onKeySubmit);
  $("key-cancel").addEventListener("click", onKeyCancel);
  $("key-dialog").addEventListener("cancel", onKeyCancel);  // Escape
  $("toggle-side").addEventListener("click", () => {
    const open = document.body.classList.toggle("side-open");
    $("toggle-side").setAttribute("aria-expanded", String(open));
  });
}

function start() {
  const unreadable = store.load();
  if (unreadable) banner(`${unreadable} saved conversation(s) could not be read: left out.`);
  state.settings = store.settings(state.settings);
  state.apiKey = store.apiKey();
  $("forget-key").hidden = !state.apiKey;
  bindSettings();
  bindControls();
  renderAll();
  showSamplingHint();
  loadModel();
  startFleetPanel(headers);
  $("input").focus();
}

// The renderer as a page global too: the browser tests (tests/integration/test_hostile_http.py) time it
// on crafted text from the page, as a console can.
window.renderMarkdown = renderMarkdown;
start();
