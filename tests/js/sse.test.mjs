// The chat page's answer stream (coordinator/api/static/sse.js): the SSE reader and what chunks add to an answer.
import assert from "node:assert/strict";
import { test } from "node:test";
import { SseParser, applyChunk, endAnswer, finishStats, newTiming, sseData } from "../../coordinator/api/static/sse.js";

// A ReadableStream of the UTF-8 bytes of `pieces`, one read each (as a network delivers them).
function stream(pieces) {
  const encoder = new TextEncoder();
  return new ReadableStream({
    pull(controller) {
      if (!pieces.length) return controller.close();
      const piece = pieces.shift();
      controller.enqueue(typeof piece === "string" ? encoder.encode(piece) : piece);
    },
  });
}

async function collect(body) {
  const out = [];
  for await (const data of sseData(body)) out.push(data);
  return out;
}

const chunk = (content) => JSON.stringify({ choices: [{ delta: { content }, finish_reason: null }] });

test("events are split on blank lines, data lines joined, comments and other fields ignored", () => {
  const parser = new SseParser();
  assert.deepEqual(parser.push(": keep-alive\n\ndata: a\n\nevent: x\nid: 1\ndata: b\ndata:  c\n\ndata\n\n"),
    ["a", "b\n c", ""]);
  assert.deepEqual(parser.push("retry: 5\n\n"), []);  // no data: no event
});

test("every line ending, also cut between pieces, and data cut anywhere", () => {
  const text = "data: one\r\n\r\ndata: two\r\rdata: three\n\n";
  for (let cut = 0; cut <= text.length; cut++) {
    const parser = new SseParser();
    const events = [...parser.push(text.slice(0, cut)), ...parser.push(text.slice(cut)), ...parser.end()];
    assert.deepEqual(events, ["one", "two", "three"], `cut at ${cut}`);
  }
  const parser = new SseParser();
  const events = [...text].flatMap((c) => parser.push(c));
  assert.deepEqual([...events, ...parser.end()], ["one", "two", "three"]);
});

test("an event the stream does not end is dropped; one ended by a last \\r is not", () => {
  const parser = new SseParser();
  assert.deepEqual(parser.push("data: done\n\ndata: half"), ["done"]);
  assert.deepEqual(parser.end(), []);
  const cr = new SseParser();
  assert.deepEqual([...cr.push("data: x\r\r"), ...cr.end()], ["x"]);
});

test("a long line in many pieces is not split again per piece", () => {
  const parser = new SseParser();
  const start = performance.now();
  for (let i = 0; i < 20000; i++) assert.deepEqual(parser.push("x".repeat(100)), []);
  const events = parser.push("\n\n");
  assert.ok(performance.now() - start < 1000);
  assert.deepEqual(events, []);  // "xxx..." is a field named so, not data
});

test("sseData reads a fetch body to [DONE], UTF-8 cut inside a character", async () => {
  const bytes = new TextEncoder().encode(`data: ${chunk("é€😀")}\n\n`);
  const pieces = [bytes.slice(0, 20), bytes.slice(20, 21), bytes.slice(21), ": ping\n\n", "data: [DONE]\n\n",
    "data: after\n\n"];
  const out = await collect(stream(pieces));
  assert.equal(out.length, 1);
  assert.equal(JSON.parse(out[0]).choices[0].delta.content, "é€😀");
});

test("sseData ends with the body when no [DONE] comes, and leaving early cancels the body", async () => {
  assert.deepEqual(await collect(stream(["data: a\n\n", "data: b\n\n"])), ["a", "b"]);
  let cancelled = false;
  const body = new ReadableStream({
    pull(controller) { controller.enqueue(new TextEncoder().encode("data: tick\n\n")); },
    cancel() { cancelled = true; },
  });
  for await (const data of sseData(body)) { assert.equal(data, "tick"); break; }
  assert.ok(cancelled);
});

test("chunks build the answer, its finish reason, usage and fleet timing", () => {
  const answer = { content: "", state: "streaming", stats: {} };
  const timing = newTiming(1000);
  applyChunk(answer, timing, chunk("Hel"), 1100);
  applyChunk(answer, timing, "not json", 1150);
  applyChunk(answer, timing, chunk("lo"), 1200);
  applyChunk(answer, timing, JSON.stringify({ choices: [{ delta: {}, finish_reason: "stop" }] }), 1300);
  applyChunk(answer, timing, JSON.stringify({ choices: [], usage: { completion_tokens: 2, prompt_tokens: 9,
    prompt_tokens_details: { cached_tokens: 4 } }, fleet: { ttft_ms: 80, decode_tokens_per_s: 12.5 } }), 1310);
  assert.equal(answer.content, "Hello");
  assert.equal(answer.stats.finish, "stop");
  endAnswer(answer);
  assert.equal(answer.state, "done");
  finishStats(answer, timing);
  assert.deepEqual(answer.stats, { finish: "stop", ttft_ms: 80, tokens_per_s: 12.5, browser_ttft_ms: 100,
    measured: "the coordinator", completion_tokens: 2, prompt_tokens: 9, cached_tokens: 4 });
});

test("without the coordinator's numbers the browser's are used, marked approximate", () => {
  const answer = { content: "", state: "stopped", stats: {} };
  const timing = newTiming(0);
  for (let i = 0; i < 5; i++) applyChunk(answer, timing, chunk("x"), 100 + 50 * i);
  finishStats(answer, timing);
  assert.deepEqual(answer.stats, { ttft_ms: 100, tokens_per_s: 20, browser_ttft_ms: 100, measured: "this browser",
    completion_tokens: 5, approximate: true });
});

test("an error chunk fails the answer; a stream closed without a finish reason is an error", () => {
  const failed = { content: "", state: "streaming", stats: {} };
  applyChunk(failed, newTiming(0), JSON.stringify({ error: { message: "stage 1 lost" } }), 1);
  assert.deepEqual([failed.state, failed.error], ["error", "stage 1 lost"]);
  endAnswer(failed);
  assert.equal(failed.state, "error");
  const cut = { content: "partial", state: "streaming", stats: {} };
  endAnswer(cut);
  assert.equal(cut.state, "error");
  assert.match(cut.error, /closed the stream without finishing/);
  const odd = ["null", "3", '"x"', '{"choices": "no"}', '{"choices": [null]}',
    '{"choices": [{"delta": {"content": 5}}]}'];
  for (const data of odd) {
    const answer = { content: "", state: "streaming", stats: {} };
    applyChunk(answer, newTiming(0), data, 1);
    assert.deepEqual([answer.content, answer.state], ["", "streaming"], data);
  }
});
