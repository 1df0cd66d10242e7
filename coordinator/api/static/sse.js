// The answer stream of POST /v1/chat/completions: a server-sent-events reader (fetch's body: EventSource
// cannot POST) and what each chat.completion.chunk adds to the answer, by openai-python's rules: ':' lines
// are comments, 'data: [DONE]' ends the stream, a payload with 'error' is a failure mid-stream. Pure (no
// DOM): node's tests import it.
import { addToolCallDeltas } from "./tools.js";

/** Splits server-sent-events text, fed in pieces as it arrives, into the data of each complete event. */
export class SseParser {
  constructor() {
    this.line = "";  // the text of a line not yet ended
    this.cr = false;  // the text so far ended with a "\r", which may be half of a "\r\n"
    this.data = null;  // the data lines of the event being read (null before its first)
  }

  /** Feed the next piece of the stream's text; returns the data (lines joined by "\n") of each event this
   * piece completes, in order. Lines end with "\n", "\r\n" or "\r", also when cut between two pieces. */
  push(text) {
    if (!this.cr && !/[\r\n]/.test(text)) {  // the line grows (a long one is not split again per piece)
      this.line += text;
      return [];
    }
    let all = this.line + (this.cr ? "\r" : "") + text;
    this.cr = all.endsWith("\r");
    if (this.cr) all = all.slice(0, -1);
    const lines = all.split(/\r\n|\r|\n/);
    this.line = lines.pop();
    const events = [];
    for (const line of lines) this.takeLine(line, events);
    return events;
  }

  /** The stream has ended: the data of an event its last "\r" completes (an event not ended by a blank
   * line is dropped, as the SSE standard says). */
  end() {
    const events = [];
    if (this.cr) this.takeLine(this.line, events);
    this.line = "";
    this.cr = false;
    this.data = null;
    return events;
  }

  takeLine(line, events) {
    if (line === "") {  // an event ends; one without data lines is nothing (keep-alives)
      if (this.data !== null) events.push(this.data.join("\n"));
      this.data = null;
      return;
    }
    if (line.startsWith(":")) return;  // a comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    if (field !== "data") return;  // event, id, retry: not used by the API
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    (this.data = this.data || []).push(value);
  }
}

/** The data of each event of `body` (a ReadableStream of UTF-8 bytes, as fetch gives), up to its end or
 * to 'data: [DONE]'. Leaving the loop early cancels the stream. */
export async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  const parser = new SseParser();
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      const events = done ? parser.push(decoder.decode()).concat(parser.end())
        : parser.push(decoder.decode(value, { stream: true }));
      for (const data of events) {
        if (data === "[DONE]") return;
        yield data;
      }
      if (done) { finished = true; return; }
    }
  } finally {
    if (!finished) await reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}

/** A new answer's stream timing: `start` (ms, performance.now() when the request was sent). */
export function newTiming(start) {
  return { start, first: null, last: null, chunks: 0, usage: null, fleet: null };
}

/** Apply one event's `data` (a chat.completion.chunk as JSON) to `answer` (its content, tool_calls (tools.js
 * addToolCallDeltas), state, error and stats.finish) and `timing` (when text came, the usage and fleet fields), at time `now` (ms). Data that
 * is not JSON is skipped, as openai-python does. */
export function applyChunk(answer, timing, data, now) {
  let chunk;
  try { chunk = JSON.parse(data); } catch (e) { return; }
  if (!chunk || typeof chunk !== "object") return;
  if (chunk.error) {
    answer.state = "error";
    answer.error = (chunk.error && chunk.error.message) || "the fleet failed mid-answer";
    return;
  }
  const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
  const delta = choice && choice.delta;
  const text = delta && delta.content;
  const grew = typeof text === "string" && text.length > 0;
  if (grew) answer.content += text;
  const called = delta ? addToolCallDeltas(answer, delta.tool_calls) > 0 : false;
  if (grew || called) {
    if (timing.first === null) timing.first = now;
    timing.last = now;
    timing.chunks += 1;
  }
  if (choice && choice.finish_reason) answer.stats.finish = choice.finish_reason;
  if (chunk.usage) timing.usage = chunk.usage;
  if (chunk.fleet) timing.fleet = chunk.fleet;
}

/** The answer's numbers into `answer.stats`: the coordinator's (usage and the fleet field of the last
 * chunk) where it sent them, else the browser's own measurement from `timing` (a stopped answer gets no
 * usage chunk; its token count is then the chunk count, marked approximate). */
export function finishStats(answer, timing) {
  const s = answer.stats;
  const usage = timing.usage;
  const fleet = timing.fleet || {};
  const browserTtft = timing.first !== null ? timing.first - timing.start : null;
  const browserRate = timing.chunks > 1 && timing.last > timing.first
    ? (timing.chunks - 1) / ((timing.last - timing.first) / 1000) : null;
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

/** How an answer that streamed to its end (no Stop, no lost connection) is left: "done" when the stream
 * said why it finished, else "error" with a reason (the coordinator closed the stream without finishing). */
export function endAnswer(answer) {
  if (answer.state !== "streaming") return;
  if (answer.stats.finish) {
    answer.state = "done";
  } else {
    answer.state = "error";
    answer.error = "the answer ended early: the coordinator closed the stream without finishing it";
  }
}
