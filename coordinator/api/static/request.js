// What the page sends to POST /v1/chat/completions: the conversation and the sampling fields. The model's
// entry in GET /v1/models says what a silent request gets: `generation_defaults` (the model's
// generation_config.json), and `fallback_sampling`, what a chat client sends when its user sets no
// sampling field (the coordinator's choice: greedy with a small frequency penalty, which keeps the demo
// model from looping, for a model without sampling defaults of its own; {} for one with them), as
// fleet-chat does. A coordinator that does not send it gets nothing added. The settings' tools (JSON) go
// with every request when set. Pure (no DOM): node's tests
// import it.

import { apiMessage, parseTools } from "./tools.js";

const SAMPLING_NAMES = ["temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
  "repetition_penalty"];
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

/** What the page uses of a /v1/models entry (`card`, any value): {id, defaults, fallback}; `fallback` is
 * its fallback_sampling's numeric sampling fields (fleet-chat's SAMPLING_NAMES), or null when it has none. */
export function modelInfo(card) {
  const entry = isObject(card) ? card : {};
  const fallback = {};
  if (isObject(entry.fallback_sampling)) {
    for (const name of SAMPLING_NAMES) {
      const value = entry.fallback_sampling[name];
      if (typeof value === "number" && Number.isFinite(value)) fallback[name] = value;
    }
  }
  return { id: typeof entry.id === "string" ? entry.id : "",
    defaults: isObject(entry.generation_defaults) ? entry.generation_defaults : {},
    fallback: Object.keys(fallback).length ? fallback : null };
}

/** Whether a request gets the coordinator's fallback sampling: it has one, and the user set no temperature. */
export function usesFallback(settings, model) {
  return settings.temperature === "" && model.fallback !== null;
}

/** The request's sampling fields from the page's `settings` ({temperature, maxTokens}: text of the inputs,
 * "" for unset) and `model` (modelInfo's). */
export function samplingFields(settings, model) {
  const body = {};
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  else if (usesFallback(settings, model)) Object.assign(body, model.fallback);
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  return body;
}

/** The tool fields of a request from the page's `settings` ({tools: the "tools (JSON)" text, toolChoice:
 * one of TOOL_CHOICES}), the tool choice left out after tool results (`lastRole` "tool"): {} without tools; throws an Error naming the problem when the text is not a list
 * of function tools (parseTools). */
export function toolFields(settings, lastRole = "user") {
  const { tools, problem } = parseTools(settings.tools || "");
  if (problem) throw new Error(problem);
  if (!tools) return {};
  // a forced choice is for the turn after the question: once the results are in, the model answers
  // (or calls again: the API's default, auto)
  const forced = settings.toolChoice && lastRole !== "tool";
  return { tools, ...(forced ? { tool_choice: settings.toolChoice } : {}) };
}

/** The streamed request for `conversation`'s messages in OpenAI's shape (the system prompt first when
 * set; `answer`, the one being asked for, and empty answers left out; answers keep their tool_calls and
 * results their tool_call_id: tools.js apiMessage) with the sampling and tool fields. Throws an Error
 * naming the problem when the settings' tools are not valid (toolFields). */
export function requestBody(conversation, answer, settings, model) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of conversation.messages) {
    const sent = m === answer ? null : apiMessage(m);
    if (sent) messages.push(sent);
  }
  const lastRole = messages.length ? messages[messages.length - 1].role : "user";
  return { model: model.id, messages, stream: true, stream_options: { include_usage: true },
    ...samplingFields(settings, model), ...toolFields(settings, lastRole) };
}

/** The line under the settings saying what a request sends and where the rest comes from. */
export function samplingHint(settings, model) {
  const fields = samplingFields(settings, model);
  const sent = Object.entries(fields).map(([k, v]) => `${k} ${v}`).join(", ");
  const defaults = Object.keys(model.defaults).length ? "the model's defaults" : "the coordinator's defaults";
  return `Sends ${sent || "nothing"}; the rest: ${defaults}.` + (usesFallback(settings, model) ?
    " (The coordinator's fallback for a model without sampling defaults, as fleet-chat sends.)" : "");
}
