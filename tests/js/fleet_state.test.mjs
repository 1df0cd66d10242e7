// The fleet panel's planned-fleet line (coordinator/api/static/fleet_state.js) from /health's `fleet` entry,
// in the shape coordinator/fleet/replan.py Replanner.status() gives it.
import assert from "node:assert/strict";
import { test } from "node:test";
import { plannedFleet } from "../../coordinator/api/static/fleet_state.js";

const BASE = { layers: "0:15,15:30", workers: ["10.0.0.2:7070", "10.0.0.3:7070"], replans: 0, last_replan_s: null };

test("a build served directly has no planned-fleet line", () => {
  for (const f of [undefined, null, {}, "serving", { state: 3 }]) assert.equal(plannedFleet(f), null);
});

test("serving: the plan's layers and workers, and the re-plans so far", () => {
  const first = plannedFleet({ ...BASE, state: "serving", progress: "", reason: "", phase_s: 3.2 });
  assert.deepEqual(first, { state: "serving", pill: null, text: "Planned fleet: layers 0:15,15:30 over 2 workers." });
  const later = plannedFleet({ ...BASE, state: "serving", replans: 2, last_replan_s: 9.24, workers: ["a:1"] });
  assert.equal(later.text, "Planned fleet: layers 0:15,15:30 over 1 worker · 2 re-plans (the last took 9.2 s).");
});

test("re-planning: how long, why and what it does now, with a busy pill", () => {
  const f = plannedFleet({ ...BASE, state: "replanning", phase_s: 75.4, reason: "stage 1 has no worker",
    progress: "shipping stage 1 of 2 to 10.0.0.3:7070: stage_1/openvino_model.bin 40 of 120 MB" });
  assert.deepEqual(f.pill, { text: "re-planning", cls: "busy" });
  assert.equal(f.text, "Re-planning for 1 min 15 s (stage 1 has no worker): shipping stage 1 of 2 to " +
    "10.0.0.3:7070: stage_1/openvino_model.bin 40 of 120 MB. New requests wait; was layers 0:15,15:30 over 2 workers.");
  assert.match(plannedFleet({ ...BASE, state: "replanning" }).text, /^Re-planning\. New requests wait/);
});

test("refused: the planner's reason and that requests are refused", () => {
  const f = plannedFleet({ ...BASE, state: "refused", replans: 1, last_replan_s: 20,
    reason: "node 'b' (900 MiB) cannot hold even one layer: short 12 MiB" });
  assert.deepEqual(f.pill, { text: "refused", cls: "bad" });
  assert.match(f.text, /cannot serve the model: node 'b' \(900 MiB\) cannot hold even one layer: short 12 MiB\. /);
  assert.match(f.text, /Requests are refused until a worker joins; was layers 0:15,15:30 over 2 workers · 1 re-plan \(the last took 20\.0 s\)\.$/);
});

test("preparing: the first build's progress with a busy pill, the plan once there is one", () => {
  const early = plannedFleet({ state: "preparing", progress: "collecting empty workers (2 expected)", phase_s: 1.5,
    layers: "", workers: [], replans: 0, last_replan_s: null, reason: "serve --model m.gguf" });
  assert.deepEqual(early.pill, { text: "preparing", cls: "busy" });
  assert.equal(early.text, "Preparing the fleet (1.5 s so far): collecting empty workers (2 expected). The chat " +
    "answers once every stage is served.");
  const later = plannedFleet({ ...BASE, state: "preparing", progress: "shipping stage 1 of 2 to 10.0.0.3:7070",
    phase_s: 65 });
  assert.match(later.text, /^Preparing the fleet \(1 min 5 s so far\): shipping stage 1 of 2 to 10\.0\.0\.3:7070\. .*; the plan: layers 0:15,15:30 over 2 workers\.$/);
});
