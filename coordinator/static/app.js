// fleet's chat page. Conversations, settings and the API key live in this browser's localStorage; answers
// stream from POST /v1/chat/completions (fetch + an SSE reader: EventSource cannot POST), Stop aborts the
// fetch, which the coordinator sees as a disconnect and answers by ending the generation and freeing the
// session's KV on every stage. The fleet panel polls GET /health.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = { conversations: "fleet.conversations", current: "fleet.current", settings: "fleet.settings",
    apiKey: "fleet.apiKey" };
  // fleet-chat's sampling for a model whose generation_config.json has none (coordinator/chat.py CHAT_SAMPLING):
  // greedy with a small frequency penalty, which keeps the demo model from looping.
  const CHAT_SAMPLING = { temperature: 0, frequency_penalty: 0.3 };
  const HEALTH_EVERY_MS = 2000;
  const MIB = 1 << 20;

  const state = {
    conversations: [], current: null, apiKey: "", model: "", defaults: {},
    settings: { system: "", temperature: "", maxTokens: "" },
    streaming: null,  // {controller, answer, conversation} while an answer streams
    pendingSend: null,  // text refused for want of a key: sent again once a key is accepted
  };

  // ---- storage ------------------------------------------------------------------------------------
  function load(key, fallback) {
    try {
      const value = localStorage.getItem(key);
      return value === null ? fallback : JSON.parse(value);
    } catch (e) {
      return fallback;
    }
  }
  function store(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {
      banner(`This browser would not save the chat (${e.name}): export it, then delete old conversations.`);
    }
  }
  const saveConversations = () => {
    store(STORE.conversations, state.conversations);
    store(STORE.current, state.current);
  };
  const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const current = () => state.conversations.find((c) => c.id === state.current) || null;

  function banner(text) {
    $("banner").textContent = text || "";
    $("banner").hidden = !text;
  }

  // A DOM element: el("div", {class: "x"}, "text", child, ...); text always goes in as text, never HTML.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  // ---- conversations ------------------------------------------------------------------------------
  function newConversation() {
    const open = current();
    if (open && open.messages.length === 0) return open;  // reuse an empty one rather than pile them up
    const conversation = { id: uid(), title: "New chat", created: Date.now(), model: state.model, messages: [] };
    state.conversations.unshift(conversation);
    state.current = conversation.id;
    saveConversations();
    return conversation;
  }

  function renderConversationList() {
    const list = $("conversation-list");
    list.replaceChildren(...state.conversations.map((c) => {
      const open = el("button", { type: "button", class: "open", title: c.title }, c.title);
      open.addEventListener("click", () => { state.current = c.id; saveConversations(); renderAll(); });
      const remove = el("button", { type: "button", class: "delete", title: "delete this conversation",
        "aria-label": `delete ${c.title}` }, "×");
      remove.addEventListener("click", () => deleteConversation(c));
      return el("li", { class: c.id === state.current ? "active" : null, "data-id": c.id }, open, remove);
    }));
  }

  function deleteConversation(c) {
    if (c.messages.length && !confirm(`Delete "${c.title}"?`)) return;
    if (state.streaming && state.streaming.conversation === c) state.streaming.controller.abort();
    state.conversations = state.conversations.filter((x) => x !== c);
    if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
    if (!current()) newConversation();
    saveConversations();
    renderAll();
  }

  // ---- messages -----------------------------------------------------------------------------------
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
      content.innerHTML = window.renderMarkdown(m.content);
    } catch (e) {  // a renderer bug must not make the conversation unreadable: show the text as it is
      content.textContent = m.content;
    }
    const stats = node.querySelector(".stats");
    stats.textContent = window.statsLine(m);
    stats.title = m.stats && m.stats.measured ? `measured by ${m.stats.measured}` : "";
    const failure = node.querySelector(".failure");
    failure.textContent = m.error || "";
    failure.hidden = !m.error;
  }

  function renderMessages() {
    const c = current();
    const box = $("messages");
    const nodes = c ? c.messages.map(messageNode) : [];
    $("empty-hint").hidden = nodes.length > 0;
    box.replaceChildren($("empty-hint"), ...nodes);
    box.scrollTop = box.scrollHeight;
  }

  // Re-render one message in place (a streaming answer), keeping the view at the bottom if it was there.
  function updateMessage(m) {
    const box = $("messages");
    const old = box.querySelector(`.message[data-id="${m.id}"]`);
    if (!old) return;  // its conversation is not the one shown
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fillMessage(old, m);
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderConversationList();
    renderMessages();
  }

  // ---- sending ------------------------------------------------------------------------------------
  function samplingFields() {
    const s = state.settings;
    const body = {};
    if (s.temperature !== "") body.temperature = Number(s.temperature);
    else if (!("temperature" in state.defaults || "repetition_penalty" in state.defaults)) {
      Object.assign(body, CHAT_SAMPLING);
    }
    if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
    return body;
  }

  function requestBody(conversation, answer) {
    const messages = [];
    if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
    for (const m of conversation.messages) {
      if (m === answer || (m.role === "assistant" && !m.content)) continue;
      messages.push({ role: m.role, content: m.content });
    }
    return { model: state.model, messages, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
  }

  const headers = () => ({ "Content-Type": "application/json",
    ...(state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {}) });

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}`;
  }

  async function send(text) {
    text = (text !== undefined ? text : $("input").value).trim();
    if (!text || state.streaming) return;
    const conversation = current() || newConversation();
    $("input").value = "";
    const question = { id: uid(), role: "user", content: text, at: Date.now() };
    const answer = { id: uid(), role: "assistant", content: "", at: Date.now(), state: "streaming", stats: {} };
    conversation.messages.push(question, answer);
    if (conversation.title === "New chat") conversation.title = text.replace(/\s+/g, " ").slice(0, 60);
    conversation.model = state.model || conversation.model;
    saveConversations();
    renderAll();
    const controller = new AbortController();
    state.streaming = { controller, answer, conversation };
    setStreaming(true);
    const timing = { start: performance.now(), first: null, chunks: 0 };
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
        body: JSON.stringify(requestBody(conversation, answer)), signal: controller.signal });
      if (response.status === 401) {  // take the turn back, ask for a key, then send it again
        conversation.messages.splice(conversation.messages.indexOf(question), 2);
        state.pendingSend = text;
        openKeyDialog(state.apiKey ? await errorMessage(response) : null);
        return;
      }
      if (!response.ok) {
        answer.state = "error";
        answer.error = await errorMessage(response);
        return;
      }
      await readStream(response, answer, timing);
      if (answer.state === "streaming" && !answer.stats.finish) {
        answer.state = "error";
        answer.error = "the answer ended early: the coordinator closed the stream without finishing it";
      } else if (answer.state === "streaming") {
        answer.state = "done";
      }
    } catch (e) {
      if (e.name === "AbortError") answer.state = "stopped";
      else { answer.state = "error"; answer.error = `lost the coordinator mid-answer: ${e.message}`; }
    } finally {
      finishStats(answer, timing);
      state.streaming = null;
      setStreaming(false);
      saveConversations();
      if (conversation.messages.includes(answer)) updateMessage(answer);
      else renderMessages();
      renderConversationList();
      setTimeout(refreshHealth, 1200);  // the stages' KV after the answer (workers report once a second)
    }
  }

  // Read an SSE stream of chat.completion.chunk events (openai-python's rules: ':' lines are comments,
  // 'data: [DONE]' ends it, a payload with 'error' is a failure mid-stream).
  async function readStream(response, answer, timing) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let saved = performance.now();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      for (let cut; (cut = buffer.search(/\r?\n\r?\n/)) >= 0;) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        if (onEvent(event, answer, timing) === "done") return;
      }
      scheduleUpdate(answer);
      if (performance.now() - saved > 1000) { saveConversations(); saved = performance.now(); }
    }
  }

  function onEvent(event, answer, timing) {
    const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    if (!data) return null;  // comments and keep-alives
    if (data === "[DONE]") return "done";
    let chunk;
    try { chunk = JSON.parse(data); } catch (e) { return null; }
    if (chunk.error) {
      answer.state = "error";
      answer.error = chunk.error.message || "the fleet failed mid-answer";
      return null;
    }
    const choice = (chunk.choices || [])[0];
    const text = choice && choice.delta && choice.delta.content;
    if (text) {
      if (timing.first === null) timing.first = performance.now();
      timing.last = performance.now();
      timing.chunks += 1;
      answer.content += text;
    }
    if (choice && choice.finish_reason) answer.stats.finish = choice.finish_reason;
    if (chunk.usage) timing.usage = chunk.usage;
    if (chunk.fleet) timing.fleet = chunk.fleet;
    return null;
  }

  // The answer's numbers: the coordinator's (usage and the fleet field of the last chunk) where it sent
  // them, else the browser's own measurement (a stopped answer gets no usage chunk).
  function finishStats(answer, timing) {
    const s = answer.stats;
    const usage = timing.usage;
    const fleet = timing.fleet || {};
    const browserTtft = timing.first !== null ? timing.first - timing.start : null;
    const browserRate = timing.chunks > 1 ? (timing.chunks - 1) / ((timing.last - timing.first) / 1000) : null;
    s.ttft_ms = fleet.ttft_ms != null ? fleet.ttft_ms : browserTtft;
    s.tokens_per_s = fleet.decode_tokens_per_s != null ? fleet.decode_tokens_per_s : browserRate;
    s.browser_ttft_ms = browserTtft;
    s.measured = timing.fleet ? "the coordinator" : "this browser";
    if (usage) {
      s.completion_tokens = usage.completion_tokens;
      s.prompt_tokens = usage.prompt_tokens;
      const details = usage.prompt_tokens_details;
      s.cached_tokens = details && details.cached_tokens != null ? details.cached_tokens : null;
    } else if (timing.chunks) {
      s.completion_tokens = timing.chunks;  // one chunk per detokenized delta: about one token each
      s.approximate = true;
    }
  }

  // A streaming answer is re-rendered whole (markdown needs its context) at most every 40 ms, and never
  // sooner than 4x its last render took after it: rendering takes at most a fifth of the page's time,
  // however long the answer grows.
  let updateTimer = null;
  let renderMs = 0;
  function scheduleUpdate(answer) {
    if (updateTimer !== null) return;
    updateTimer = setTimeout(() => {
      updateTimer = null;
      const start = performance.now();
      updateMessage(answer);
      renderMs = performance.now() - start;
    }, Math.max(40, 4 * renderMs));
  }

  function setStreaming(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    if (on) $("stop").focus(); else $("input").focus();
  }

  // ---- settings and the API key --------------------------------------------------------------------
  const SETTING_INPUTS = { system: "settings-system", temperature: "settings-temperature",
    maxTokens: "settings-max-tokens" };

  function samplingHint() {
    const fields = samplingFields();
    const shown = Object.entries(fields).map(([k, v]) => `${k} ${v}`).join(", ");
    const defaults = Object.keys(state.defaults).length ? "the model's defaults" : "the coordinator's defaults";
    $("sampling-hint").textContent = `Sends ${shown || "nothing"}; the rest: ${defaults}.` +
      (fields.frequency_penalty != null && state.settings.temperature === "" ?
        " (The model has no sampling defaults: greedy with a frequency penalty, as fleet-chat.)" : "");
  }

  function bindSettings() {
    for (const [name, id] of Object.entries(SETTING_INPUTS)) {
      $(id).value = state.settings[name];
      $(id).addEventListener("input", () => {
        state.settings[name] = $(id).value;
        store(STORE.settings, state.settings);
        samplingHint();
      });
    }
    $("change-key").addEventListener("click", () => openKeyDialog(null));
    $("forget-key").addEventListener("click", () => {
      state.apiKey = "";
      localStorage.removeItem(STORE.apiKey);
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
    store(STORE.apiKey, key);
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
    if (!response.ok) {
      banner(`/v1/models: ${await errorMessage(response)}`);
      return;
    }
    const model = ((await response.json()).data || [])[0] || {};
    state.model = model.id || "";
    state.defaults = model.generation_defaults || {};
    $("model-name").textContent = state.model;
    banner("");
    samplingHint();
  }

  // ---- fleet panel ----------------------------------------------------------------------------------
  function replicaNode(w) {
    const held = w.kv_bytes != null ? `${(w.kv_bytes / MIB).toFixed(1)} MiB` : "?";
    const budget = w.kv_budget_bytes ? ` of ${(w.kv_budget_bytes / MIB).toFixed(0)} MiB` : "";
    const share = w.kv_budget_bytes ? Math.min(100, (100 * (w.kv_reserved_bytes || 0)) / w.kv_budget_bytes) : 0;
    const known = (v) => (v != null ? v : "?");
    return el("div", { class: "replica", "data-address": w.address, "data-kv-bytes": w.kv_bytes,
      "data-sessions": w.sessions },
    el("span", { class: "address" }, w.address),
    el("span", { class: w.healthy ? "up" : "down" }, w.healthy ? "healthy" : "DOWN"),
    el("span", {}, `${w.device || "?"} · RTT ${w.rtt_ms != null ? w.rtt_ms.toFixed(1) : "?"} ms`),
    el("span", {}, "sessions"), el("span", {}, `${known(w.sessions)} (busy ${known(w.busy)})`),
    el("span", {}, "KV held"), el("span", { class: "kv" }, held + budget),
    meter(share, `KV reserved: ${share.toFixed(0)}% of the budget`));
  }

  function meter(percent, title) {
    const bar = el("span");
    bar.style.width = `${percent}%`;  // through the CSSOM: the page's CSP allows no inline style attributes
    return el("span", { class: "meter", title }, bar);
  }

  function renderFleet(h) {
    const pill = $("fleet-state");
    pill.textContent = h.shutting_down ? "shutting down"
      : h.ready ? "ready" : `missing stage ${h.missing_stages.join(", ")}`;
    pill.className = `pill ${h.ready ? "ok" : "bad"}`;
    if (!Array.isArray(h.workers)) {  // a coordinator with API keys names its workers only to a key
      $("fleet-summary").textContent = `${h.num_stages} stage(s) · ${h.running} running, ${h.queued} queued · ` +
        (h.workers_hidden || "workers not shown");
      $("fleet-stages").replaceChildren();
      return;
    }
    const members = h.workers.filter((w) => w.stage !== null && !w.refused);
    const held = members.reduce((sum, w) => sum + (w.kv_bytes || 0), 0);
    const cache = h.prefix_cache;  // retained conversations, when the coordinator keeps them
    $("fleet-summary").textContent = `${h.num_stages} stage${h.num_stages === 1 ? "" : "s"} · ` +
      `${h.running} running, ${h.queued} queued · KV held ${(held / MIB).toFixed(1)} MiB` +
      (cache && cache.sessions != null ? ` · ${cache.sessions} conversation${cache.sessions === 1 ? "" : "s"} ` +
        `kept for reuse` + (cache.tokens != null ? ` (${cache.tokens} tokens)` : "") : "");
    $("fleet-summary").dataset.kvBytes = held;
    const stages = [];
    for (let stage = 0; stage < h.num_stages; stage++) {
      const replicas = members.filter((w) => w.stage === stage).sort((a, b) => a.address.localeCompare(b.address));
      const healthy = replicas.filter((w) => w.healthy).length;
      const layers = replicas.find((w) => w.layers);
      stages.push(el("div", { class: `stage${healthy ? "" : " missing"}`, "data-stage": stage },
        el("div", { class: "heading" }, `stage ${stage}` +
          (layers ? ` · layers [${layers.layers[0]}, ${layers.layers[1]})` : "") +
          ` · ${healthy} of ${replicas.length} replica${replicas.length === 1 ? "" : "s"} healthy`),
        ...replicas.map(replicaNode)));
    }
    const others = h.workers.filter((w) => w.refused || w.stage === null);
    if (others.length) {
      stages.push(el("div", { class: "stage missing" }, el("div", { class: "heading" }, "not in the pipeline"),
        ...others.map((w) => el("div", { class: "replica" }, el("span", { class: "address" }, w.address),
          el("span", { class: "down" }, w.refused ? `refused: ${w.refused}` : "not answering yet")))));
    }
    $("fleet-stages").replaceChildren(...stages);
  }

  async function refreshHealth() {
    try {
      const response = await fetch("/health", { headers: headers(), cache: "no-store" });
      if (response.status === 401) throw new Error("/health needs the API key");
      renderFleet(await response.json());  // 503 (not ready) still carries the status
    } catch (e) {
      $("fleet-state").textContent = "unreachable";
      $("fleet-state").className = "pill bad";
      $("fleet-summary").textContent = `cannot read /health: ${e.message}`;
    }
  }

  async function pollHealth() {
    if (!document.hidden) await refreshHealth();
    setTimeout(pollHealth, HEALTH_EVERY_MS);
  }

  // ---- export, import, copy ------------------------------------------------------------------------
  function exportAll() {
    const data = { format: "fleet-chat", version: 1, exported: new Date().toISOString(),
      conversations: state.conversations.filter((c) => c.messages.length) };
    const file = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const link = el("a", { href: URL.createObjectURL(file),
      download: `fleet-chats-${data.exported.slice(0, 10)}.json` });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  }

  async function importFile(file) {
    try {
      const data = JSON.parse(await file.text());
      if (!data || !Array.isArray(data.conversations)) {
        throw new Error("not a fleet chat export (conversations with user and assistant messages)");
      }
      data.conversations.forEach((c, i) => {
        const problem = window.conversationProblem(c);
        if (problem) throw new Error(`not a fleet chat export: conversation ${i + 1}: ${problem}`);
      });
      const known = new Set(state.conversations.map((c) => c.id));
      const added = data.conversations.filter((c) => !known.has(c.id));
      for (const c of added) {
        c.title = String(c.title || "Imported chat");
        for (const m of c.messages) { m.id = m.id || uid(); if (m.state === "streaming") m.state = "stopped"; }
      }
      state.conversations = [...added, ...state.conversations];
      saveConversations();
      renderAll();
      const skipped = data.conversations.length - added.length;
      banner(`Imported ${added.length} conversation(s)` + (skipped ? `; ${skipped} were here already.` : "."));
    } catch (e) {
      banner(`Cannot import ${file.name}: ${e.message}`);
    }
  }

  function copyCode(button) {
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

  // ---- start ----------------------------------------------------------------------------------------
  function start() {
    state.conversations = load(STORE.conversations, []);
    if (!Array.isArray(state.conversations)) state.conversations = [];
    const readable = state.conversations.filter((c) => !window.conversationProblem(c));  // older pages' or hand-edited
    if (readable.length < state.conversations.length) {
      banner(`${state.conversations.length - readable.length} saved conversation(s) could not be read: left out.`);
    }
    state.conversations = readable;
    for (const c of state.conversations) {
      for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";  // the page went away mid-answer
    }
    state.current = load(STORE.current, null);
    state.settings = { ...state.settings, ...load(STORE.settings, {}) };
    state.apiKey = load(STORE.apiKey, "") || "";
    $("forget-key").hidden = !state.apiKey;
    if (!current()) state.current = state.conversations.length ? state.conversations[0].id : null;
    if (!current()) newConversation();
    bindSettings();
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("stop").addEventListener("click", () => state.streaming && state.streaming.controller.abort());
    $("new-chat").addEventListener("click", () => { newConversation(); renderAll(); $("input").focus(); });
    $("export").addEventListener("click", exportAll);
    $("import").addEventListener("change", (e) => {
      if (e.target.files[0]) importFile(e.target.files[0]);
      e.target.value = "";
    });
    $("messages").addEventListener("click", (e) => { if (e.target.classList.contains("copy")) copyCode(e.target); });
    $("key-form").addEventListener("submit", onKeySubmit);
    $("key-cancel").addEventListener("click", onKeyCancel);
    $("key-dialog").addEventListener("cancel", onKeyCancel);  // Escape
    $("toggle-side").addEventListener("click", () => {
      const open = document.body.classList.toggle("side-open");
      $("toggle-side").setAttribute("aria-expanded", String(open));
    });
    renderAll();
    samplingHint();
    loadModel();
    pollHealth();
    $("input").focus();
  }

  start();
})();
