// A planned fleet's state (serve --model SOURCE over empty workers) as the fleet panel shows it: the
// `fleet` entry of GET /health (coordinator/fleet/replan.py Replanner.status; coordinator/fleet/preparing.py while the
// first build is made and shipped), turned into one line and a pill.
// Pure: no DOM, so tests/js can run it under node.

function seconds(s) {
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function replans(f) {
  if (!f.replans) return "";
  return ` · ${f.replans} re-plan${f.replans === 1 ? "" : "s"}` +
    (typeof f.last_replan_s === "number" ? ` (the last took ${seconds(f.last_replan_s)})` : "");
}

/** The panel's line and the header pill for the `fleet` entry `f` of /health; null when the coordinator
 * serves a build (no `fleet` entry). `pill` is null while serving (the pill shows readiness then).
 * @param {{state: string, progress?: string, reason?: string, phase_s?: number, layers?: string,
 *   workers?: string[], replans?: number, last_replan_s?: number|null}|undefined} f
 * @returns {{text: string, pill: {text: string, cls: string}|null, state: string}|null} */
export function plannedFleet(f) {
  if (!f || typeof f !== "object" || typeof f.state !== "string") return null;
  const workers = Array.isArray(f.workers) ? f.workers.length : 0;
  const plan = `layers ${f.layers || "?"} over ${workers} worker${workers === 1 ? "" : "s"}`;
  if (f.state === "serving") {
    return { state: f.state, pill: null, text: `Planned fleet: ${plan}${replans(f)}.` };
  }
  if (f.state === "replanning") {
    const doing = f.progress ? `: ${f.progress}` : "";
    const why = f.reason ? ` (${f.reason})` : "";
    const since = typeof f.phase_s === "number" ? ` for ${seconds(f.phase_s)}` : "";
    return { state: f.state, pill: { text: "re-planning", cls: "busy" },
      text: `Re-planning${since}${why}${doing}. New requests wait; was ${plan}.` };
  }
  if (f.state === "preparing") {  // serve --model SOURCE before its first build serves (coordinator/fleet/preparing.py)
    const since = typeof f.phase_s === "number" ? ` (${seconds(f.phase_s)} so far)` : "";
    return { state: f.state, pill: { text: "preparing", cls: "busy" },
      text: `Preparing the fleet${since}: ${f.progress || "starting"}. The chat answers once every stage is ` +
        `served${f.layers ? `; the plan: ${plan}` : ""}.` };
  }
  if (f.state === "refused") {
    return { state: f.state, pill: { text: "refused", cls: "bad" },
      text: `The workers left cannot serve the model: ${f.reason || "no reason given"}. ` +
        `Requests are refused until a worker joins; was ${plan}${replans(f)}.` };
  }
  return { state: f.state, pill: null, text: `Planned fleet: state ${f.state}; ${plan}.` };
}
