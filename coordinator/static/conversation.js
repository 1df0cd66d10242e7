// What the chat page keeps of a conversation, checked wherever one comes from outside the page's own code
// (an imported file, or localStorage written by an older page): every field the page reads must have the
// type the page expects, so a file with "tokens_per_s": "x" is refused with its place named instead of
// breaking the page on every load. And the numbers line under an answer.
"use strict";

(function () {
  const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
  const STATES = ["done", "stopped", "error", "streaming"];
  const STAT_NUMBERS = ["ttft_ms", "tokens_per_s", "browser_ttft_ms", "completion_tokens", "prompt_tokens",
    "cached_tokens"];
  const MAX_TEXT = 10 * (1 << 20);  // characters of one message: localStorage holds about 5 MB in all

  const shown = (v) => { const s = JSON.stringify(v); return s === undefined ? String(v) : s.slice(0, 40); };
  const optional = (v, check) => v === undefined || v === null || check(v);
  const isString = (v) => typeof v === "string";

  function statsProblem(stats) {
    if (stats === undefined) return null;
    if (!stats || typeof stats !== "object" || Array.isArray(stats)) return `stats must be an object, not ${shown(stats)}`;
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
    if (m.role !== "user" && m.role !== "assistant") return `role must be "user" or "assistant", not ${shown(m.role)}`;
    if (!isString(m.content)) return `content must be text, not ${shown(m.content)}`;
    if (m.content.length > MAX_TEXT) return `content is ${m.content.length} characters long (at most ${MAX_TEXT})`;
    if (!optional(m.id, isString)) return `id must be text, not ${shown(m.id)}`;
    if (!optional(m.at, isNumber)) return `at must be a time in ms, not ${shown(m.at)}`;
    if (!optional(m.state, (v) => STATES.includes(v))) return `state must be one of ${STATES.join(", ")}`;
    if (!optional(m.error, isString)) return `error must be text, not ${shown(m.error)}`;
    return statsProblem(m.stats);
  }

  /** What is wrong with conversation `c` (a short text naming the field), or null when the page can use it. */
  function conversationProblem(c) {
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
  function statsLine(m) {
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

  window.conversationProblem = conversationProblem;
  window.statsLine = statsLine;
})();
