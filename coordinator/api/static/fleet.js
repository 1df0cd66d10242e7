// The fleet panel: the pipeline's stages and their replicas (health, device, RTT, sessions, KV held and
// reserved) from GET /health, polled while the page is visible; for a planned fleet (serve --model SOURCE)
// also its re-planning progress (fleet_state.js).
import { $, el } from "./dom.js";
import { plannedFleet } from "./fleet_state.js";

const HEALTH_EVERY_MS = 2000;
const MIB = 1 << 20;
let requestHeaders = () => ({});

function meter(percent, title) {
  const bar = el("span");
  bar.style.width = `${percent}%`;  // through the CSSOM: the page's CSP allows no inline style attributes
  return el("span", { class: "meter", title }, bar);
}

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

function stageNode(stage, members) {
  const replicas = members.filter((w) => w.stage === stage).sort((a, b) => a.address.localeCompare(b.address));
  const healthy = replicas.filter((w) => w.healthy).length;
  const layers = replicas.find((w) => w.layers);
  return el("div", { class: `stage${healthy ? "" : " missing"}`, "data-stage": stage },
    el("div", { class: "heading" }, `stage ${stage}` +
      (layers ? ` · layers [${layers.layers[0]}, ${layers.layers[1]})` : "") +
      ` · ${healthy} of ${replicas.length} replica${replicas.length === 1 ? "" : "s"} healthy`),
    ...replicas.map(replicaNode));
}

function summary(h, held) {
  const cache = h.prefix_cache;  // retained conversations, when the coordinator keeps them
  return `${h.num_stages} stage${h.num_stages === 1 ? "" : "s"} · ` +
    `${h.running} running, ${h.queued} queued · KV held ${(held / MIB).toFixed(1)} MiB` +
    (cache && cache.sessions != null ? ` · ${cache.sessions} conversation${cache.sessions === 1 ? "" : "s"} ` +
      "kept for reuse" + (cache.tokens != null ? ` (${cache.tokens} tokens)` : "") : "");
}

/** Show the /health status `h` in the panel and the header's pill. */
export function renderFleet(h) {
  const pill = $("fleet-state");
  pill.textContent = h.shutting_down ? "shutting down"
    : h.ready ? "ready" : `missing stage ${(h.missing_stages || []).join(", ")}`;
  pill.className = `pill ${h.ready ? "ok" : "bad"}`;
  const planned = plannedFleet(h.fleet);  // serve --model SOURCE: re-planning, refused or serving a plan
  if (planned && planned.pill && !h.shutting_down) {
    pill.textContent = planned.pill.text;
    pill.className = `pill ${planned.pill.cls}`;
  }
  const line = $("fleet-plan");
  line.textContent = planned ? planned.text : "";
  line.hidden = !planned;
  line.dataset.state = planned ? planned.state : "";
  if (!Array.isArray(h.workers)) {  // a coordinator with API keys names its workers only to a key
    $("fleet-summary").textContent = `${h.num_stages} stage(s) · ${h.running} running, ${h.queued} queued · ` +
      (h.workers_hidden || "workers not shown");
    $("fleet-stages").replaceChildren();
    return;
  }
  const members = h.workers.filter((w) => w.stage !== null && !w.refused);
  const held = members.reduce((sum, w) => sum + (w.kv_bytes || 0), 0);
  $("fleet-summary").textContent = summary(h, held);
  $("fleet-summary").dataset.kvBytes = held;
  const stages = [];
  for (let stage = 0; stage < h.num_stages; stage++) stages.push(stageNode(stage, members));
  const others = h.workers.filter((w) => w.refused || w.stage === null);
  if (others.length) {
    stages.push(el("div", { class: "stage missing" }, el("div", { class: "heading" }, "not in the pipeline"),
      ...others.map((w) => el("div", { class: "replica" }, el("span", { class: "address" }, w.address),
        el("span", { class: "down" }, w.refused ? `refused: ${w.refused}` : "not answering yet")))));
  }
  $("fleet-stages").replaceChildren(...stages);
}

/** Read /health now and show it (or that it cannot be read). */
export async function refreshFleet() {
  try {
    const response = await fetch("/health", { headers: requestHeaders(), cache: "no-store" });
    if (response.status === 401) throw new Error("/health needs the API key");
    renderFleet(await response.json());  // 503 (not ready) still carries the status
  } catch (e) {
    $("fleet-state").textContent = "unreachable";
    $("fleet-state").className = "pill bad";
    $("fleet-summary").textContent = `cannot read /health: ${e.message}`;
  }
}

async function poll() {
  if (!document.hidden) await refreshFleet();
  setTimeout(poll, HEALTH_EVERY_MS);
}

/** Start polling /health every 2 s while the page is visible, with the request headers `headers()` gives
 * (the API key's, once there is one). */
export function startFleetPanel(headers) {
  requestHeaders = headers;
  poll();
}
