"""A discrete-event model of a fleet: predicts decode tokens/s (and TTFT) from per-stage compute,
link delay and bandwidth, hidden size, draft cost, acceptance, K and the number of users. The simulator is
``bench/wan/fleet_sim.py`` (``Fleet``, ``simulate``); this module calibrates it on measured sweeps, validates it
and predicts paper-scale fleets.

A user's decode step (one batch group's): the coordinator's draft model proposes K tokens -> the chunk
crosses the link into stage 0 -> stage 0 computes -> link into stage 1 -> ... -> last stage -> the
result (k candidates per position, never full logits) crosses the link back -> the coordinator
samples. A step emits ``tokens_per_step`` tokens (1 without speculation; with acceptance rate a and K
drafts the expected (1 - a^(K+1)) / (1 - a), Leviathan et al. 2023, eq. 1, unless measured). Users
beyond the batch groups share a group's steps at ``batch_cost(rows)`` times one row's compute.

The terms, and where each number comes from (times in ms):

* **stage compute** ``stage_ms[i](seq)``, one chunk of ``seq`` tokens of one row. This machine: the
  profile ``bench/wan/sweep.py`` takes at its start (``profile_stages``: in-process, one inference
  thread on one core, median of 15, seq 1-9 at context 64), linear between whole seqs (a mean K of
  1.4 is a 2.4-token verify) and along the last segment's slope beyond seq 9 (prompts), divided by
  the fleet's calibrated ``speed`` (below). Paper PCs:
  ~21.5 ms per 16 INT4 Llama-3.1-8B layers on an Arc iGPU (the paper), +4% per extra token.
* **processors.** On separate PCs (``shared_cores`` = 0, the paper fleets) each PC runs its stage's
  chunks one at a time (first come, first served; the draft shares PC ``draft_core``). When stages
  share one machine (``shared_cores`` = C, the sweep on this box) the OS time-slices: every running
  job on a core progresses at 1/n of its speed while n run there (processor sharing). Each worker
  is pinned to core ``stage_core[i]`` and runs its chunks one at a time on its inference thread; the
  coordinator (its draft thread), the ``fleet-wan`` proxies and the benchmark's clients are not
  pinned: their work goes to the core running the fewest jobs.
* **links.** Each direction serialises a message's bytes (payload + ``MESSAGE_OVERHEAD_BYTES`` of
  protobuf fields and HTTP/2 + gRPC framing, an estimate) at ``rate_mbit`` behind the messages before
  it, then adds the one-way ``delay_ms`` (many messages may be in flight). Payloads: token ids 8 bytes
  per token, hidden states ``hidden_size`` x 4 bytes per token, results 8 bytes per candidate.
* **fleet-wan timers** (``link_timers``, only for the simulated links of ``bench/wan/links.py``): a byte whose
  release time is ahead of the proxy's event loop waits in an asyncio timer, and Python's epoll
  selector rounds the timeout *up to whole milliseconds*. A message then arrives at
  ``eps + ceil(wait - eps)`` instead of ``wait`` (wait = queueing + serialisation + delay;
  ``LINK_TIMER_EPS_MS``: the loop's own latency, 14 us without delay and 27 us with, under which no
  timer is set). Measured with an echo server behind one link (``fleet_calibrate.measure_link_timers``): at 1 Gbit/s
  and 0 ms a 1,500-byte message crosses with no timer and a 2,400-byte one (19 us on the wire) pays
  ~1.1 ms; at 20 Mbit/s every message pays ~1 ms; at 10 ms a 100-byte message at 1 Gbit/s crosses in
  10.2 ms, at 20 Mbit/s (40 us on the wire) in 11.2 ms.
* **hop overhead** ``hop_ms``, per crossing: event loops, gRPC and protobuf in Python, the proxies,
  thread wake-ups (and, on a loaded machine, the wait for a time slice). Calibrated per fleet on its
  naive (1 user, no speculation) cells over the fastest link, together with ``speed`` (the machine's
  speed during the fleet's runs relative to the profile, ``calibrate``): the hop is the value whose
  predictions have a median error of 0 over their delays (6.3 and 6.6 ms at speed 1.0 for
  ``wan_sweep_quiet.json``'s 2- and 3-stage fleets; in the two quiet sweeps of 2026-11-30, 2.8 ms at
  1.0 and 0.1 ms at 1.05, then 2.3 and 2.1 ms at 1.0). On separate PCs it is a latency. On a shared
  machine ``hop_work_ms`` of it is CPU work of the unpinned processes, time-sharing the cores with
  the stages, and the rest a wait: ``LOCAL_HOP_WORK_MS`` = 1.1 ms, from
  ``fleet_calibrate.measure_hop_cpu`` (the coordinator's, the proxies' and the client's CPU per
  decode step over the step's crossings). When users interleave, that work competes
  with the stages' compute (in a naive cell one core is always free for it).
* **hop CPU on the receiving stage** ``hop_cpu_ms`` (1.8 ms here, ``LOCAL_HOP_CPU_MS``): a worker's CPU
  per chunk beyond inference (receive, forward, reply), from ``bench/pipeline/interleave_bench.py``'s CPU
  accounting (a worker's CPU ms per token minus its inference ms); on a shared machine it runs on
  the worker's core beside (not behind) its inference thread.
* **draft** ``draft_ms_per_token``: the draft model's time per drafted token, on one draft thread
  that serves every user in turn (``coordinator/engine/draft.py``). The sweep measures it per cell as the
  coordinator sees it: wall time per drafted token, *including* the wait for the draft thread while
  another user's draft runs (and the catch-up on tokens decoded without drafts). The model simulates
  that wait, so for a cell it uses the service time whose simulated wall time per drafted token
  equals the measured one (``_deconvolve_draft``; with one user the two are the same; with two, the
  wait depends on how their steps align, so the smallest fitting service time is taken). A request's
  draft model also prefills its prompt (the first token waits for it): that costs ``draft_ms(prompt)``,
  the draft's own profile (``fleet_calibrate.profile_draft``, one thread, chunks of 1-48 tokens). Using
  the catch-up-laden per-token cost there instead (as before 2026-11-30) made the 2-stage full stack
  at 0 ms and 20 Mbit/s come out 33% slow: adaptive K drafted in 6 of 132 steps, each after a long
  plain stretch (97 ms per drafted token). Fleets without a measured per-token cost (the paper's)
  pay ``draft_ms(1 + tokens decoded plainly since the last draft) + (K - 1) draft_ms(1)`` per verify
  step and row.
* **speculation** ``k`` (mean drafts per verify step), ``tokens_per_step`` (emitted per verify step)
  and ``verify_share`` (share of decode steps that carry drafts: adaptive K decodes plainly when
  drafting does not pay) are the cell's measurements (``verify_share`` from its ``plain_steps``;
  sweeps that did not record them count every step as a verify step).
* **the benchmark's window** (``bench_tokens`` > 0): ``bench/wan/sweep.py`` times users x (tokens - 1)
  tokens from the first token of any user to the last token of any user. So the model runs each
  user's request whole: an ``OpenSession`` round trip, its prompt (``prompt_tokens``: the sweep's two
  prompts through the chat template are 40 and 46 tokens) through the stages (users prefill
  concurrently, so the second one's first token comes later), then it joins a batch group (a
  ``Merge`` round trip to the stages, inside the window), then it decodes until it has its tokens
  (the last step's drafts are cut to the tokens left, so 23 tokens at 6 per step take 4 steps, not
  3.8). With 2 users and ``groups`` = stages, each user has a group of its own (as the coordinator's
  ``Batcher`` places them): the users interleave, nothing is batched.

**Noise.** On this 2-core machine, shared with other work, one run of a cell is not a stable number:
10 interleaved runs of the 2-stage naive cell at 0 ms (load average ~5) spread over 23-32% of their
median (the fleet direct, behind 1 Gbit/s links, behind 20 Mbit/s links: medians 90.2, 89.0 and 94.9
ms per step; the 6% the 20 Mbit/s links add is what the model gives). Over minutes the load drifts:
in ``wan_sweep_quiet.json`` the naive 20 Mbit/s cells, which differ from the 1 Gbit/s cells that
calibrate the model only in the link rate, came out 15-19% slower (2 stages) and 17-30% faster (3
stages) than predicted at 0-10 ms, and the same draft's cost per token varied from 20 to 50 ms over
the +spec cells. Hence ``bench/wan/sweep.py``'s repeats (median of up to 3 runs, the modes taking
turns, the spread kept) and both rates of a delay back to back. Sweeps from before that change also
lack the plain-step counts: there every decode step of a speculative cell counts as a verify step,
which over-predicts cells where adaptive K mostly decoded plainly (in a fresh 2-stage run at 0 ms, two
repeats on the loaded machine, it verified drafts in 2 steps and decoded 42 plainly with one user, in
7 and 78 with two).

``python bench/wan/fleet_model.py --sweep bench/results/wan_sweep.json`` validates the model against a
``bench/wan/sweep.py`` run (the naive cells over the fastest link calibrate ``speed`` and ``hop_ms``,
every other cell is a prediction) and prints predicted fleets of Llama-3.1-8B (1-4 nodes) and 70B
(4-8 nodes) on LAN/Wi-Fi and WAN links with a PNG plot, from the paper's device figures (Berenbaum & Venkatachalam,
arXiv 2608.19147: ~20-23 ms per 16-layer INT4 stage on an Arc iGPU, 6 ms TCP RTT on Wi-Fi).
``bench/wan/fleet_calibrate.py`` re-measures the fleet-wan timer term and the processes' CPU per decode step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench import harness
from bench.wan.fleet_sim import Fleet, simulate


# -- calibration on this machine -------------------------------------------------------------------
def _curve(seqs: list[int], ms: list[float]) -> Callable[[float], float]:
    """Stage ms per chunk length from a profile at whole ``seqs`` (1, 2, ...): linear between them, the
    last segment's slope beyond."""
    def f(seq: float) -> float:
        if seq <= seqs[0]:
            return ms[0]
        if seq >= seqs[-1]:
            return ms[-1] + (ms[-1] - ms[-2]) / (seqs[-1] - seqs[-2]) * (seq - seqs[-1])
        i = next(j for j in range(1, len(seqs)) if seqs[j] >= seq)
        w = (seq - seqs[i - 1]) / (seqs[i] - seqs[i - 1])
        return ms[i - 1] * (1 - w) + ms[i] * w
    return f


# worker CPU ms per chunk beyond inference, 2-stage fleet (interleave bench; measure_hop_cpu gave 1.9 and 1.5)
LOCAL_HOP_CPU_MS = 1.8
# CPU ms per hop of the unpinned processes: coordinator 1.7 + fleet-wan proxies 1.0 + client 0.6 ms per decode step
# of the 2-stage fleet behind 1 Gbit/s links, over its 3 crossings (measure_hop_cpu: naive, 48 tokens, median of 3
# runs; the machine was loaded, load average ~4, which inflated the workers' inference CPU ~1.3x over the profile)
LOCAL_HOP_WORK_MS = 1.1
PROMPT_TOKENS = (40, 46)  # bench/wan/sweep.py's two prompts through the demo's chat template


def local_fleet(profile: dict, cell: dict, sweep: dict, hop_ms: float, speed: float = 1.0) -> Fleet:
    """The model of one sweep cell on this machine: stage i pinned to core i mod nproc (as the sweep
    pins its workers), everything else time-sharing the same cores, fleet-wan links, the sweep's window.
    ``speed``: the profile's compute times (stages and draft) are divided by it (see ``calibrate``).
    A sweep without a draft profile (before 2026-11-30) gets the cell's measured wall ms per drafted
    token, times the stages' seq/one-token cost ratio."""
    curves = tuple(_curve(profile["seqs"], [m / speed for m in ms]) for ms in profile["stage_ms"])
    ncpu = sweep["machine"]["nproc"]
    spec = bool(cell["speculation"] and cell["mean_k"] > 0)
    plain = cell.get("plain_steps")
    verify = cell.get("verify_steps")
    share = verify / (verify + plain) if spec and verify and plain is not None else 1.0
    if not spec:
        draft = None
    elif "draft_ms" in profile:
        draft = _curve(profile["draft_seqs"], [m / speed for m in profile["draft_ms"]])
    else:
        per_token = cell.get("draft_ms_per_token") or 0.0  # the same kind of model as the stages, scaled
        draft = (lambda seq: per_token * sum(f(seq) for f in curves) / sum(f(1) for f in curves))
    return Fleet(stage_ms=curves, stage_core=tuple(i % ncpu for i in range(len(curves))),
                 hidden_size=sweep["hidden_size"], delay_ms=cell["delay_ms"], rate_mbit=cell["rate_mbit"],
                 hop_ms=hop_ms, hop_work_ms=LOCAL_HOP_WORK_MS, hop_cpu_ms=LOCAL_HOP_CPU_MS, users=cell["users"],
                 k=cell["mean_k"] if spec else 0.0, tokens_per_step=cell["tokens_per_step"] if spec else None,
                 verify_share=share, draft_ms=draft,
                 prompt_tokens=tuple(sweep.get("prompt_tokens") or PROMPT_TOKENS), shared_cores=ncpu,
                 link_timers=True, bench_tokens=sweep["tokens"])


def _deconvolve_draft(fleet: Fleet, wall_ms: float) -> Fleet:
    """``fleet`` with the draft service time per drafted token whose simulated wall time per drafted
    token (the wait for the draft thread included) is the measured ``wall_ms``: with one user the same;
    with more, the smallest such service time (bisection; the wait depends on how the users' steps
    happen to align, so larger ones may also fit)."""
    if fleet.users == 1:
        return replace(fleet, draft_ms_per_token=wall_ms)
    lo, hi = 0.0, wall_ms
    for _ in range(25):
        mid = (lo + hi) / 2
        simulated = simulate(replace(fleet, draft_ms_per_token=mid))["draft_wall_ms_per_token"] or 0.0
        lo, hi = (mid, hi) if simulated < wall_ms else (lo, mid)
    return replace(fleet, draft_ms_per_token=hi)


def _error(profile: dict, cell: dict, sweep: dict, hop_ms: float, speed: float) -> float:
    return simulate(local_fleet(profile, cell, sweep, hop_ms, speed))["tok_s"] / cell["tok_s"] - 1


def _fit_hop(profile: dict, base: list[dict], sweep: dict, speed: float) -> float:
    """The hop overhead (>= 0) whose predictions of the ``base`` cells have a median error of 0
    (bisection: predictions fall as it grows)."""
    def median_error(hop_ms: float) -> float:
        return statistics.median(_error(profile, c, sweep, hop_ms, speed) for c in base)

    lo, hi = 0.0, 100.0
    if median_error(lo) <= 0:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_error(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


SPEEDS = tuple(0.8 + 0.025 * i for i in range(19))  # 0.8-1.25: the machine's speed vs the profile, tried
SPEED_PENALTY = 0.01  # worst-error points per unit of |log speed|: keep the profile unless the cells insist


def calibrate(profile: dict, base: list[dict], sweep: dict) -> tuple[float, float]:
    """(speed, hop_ms) for one fleet from its ``base`` cells (naive, fastest link, every delay).

    ``hop_ms`` as in ``_fit_hop``. ``speed`` is the machine's speed during the fleet's runs relative to
    the profile taken at the sweep's start (the load drifts over minutes: in the sweep of 2026-11-30 the
    3-stage fleet's fastest naive run at 0 ms took 24.6 ms per token, less than its profile's 25.3 ms
    of compute alone, which no hop overhead >= 0 can fit). In a naive step compute and hop overhead
    are both a fixed time per token, so these cells alone hardly tell them apart: of the ``SPEEDS``
    the one whose fitted hop gives the smallest worst error over the base cells, plus
    ``SPEED_PENALTY`` x |log speed|, is taken (1.0 unless another one fits clearly better)."""
    def score(speed: float) -> tuple[float, float]:
        hop = _fit_hop(profile, base, sweep, speed)
        worst = max(abs(_error(profile, c, sweep, hop, speed)) for c in base)
        return worst + SPEED_PENALTY * abs(math.log(speed)), hop

    scored = {speed: score(speed) for speed in SPEEDS}
    speed = min(scored, key=lambda v: scored[v][0])
    return speed, scored[speed][1]


def validate(sweep: dict) -> list[dict]:
    """Calibrate ``speed`` and ``hop_ms`` per fleet on its naive cells over the fastest link; predict
    every cell. Returns the cells with ``speed``, ``hop_ms``, ``predicted_tok_s``, ``error``
    (predicted / measured - 1), ``calibration`` and, for speculative cells, the simulated
    ``draft_service_ms`` (``_deconvolve_draft``) and ``predicted_draft_wall_ms`` per drafted token."""
    out = []
    for stages_key, profile in sweep["stage_profiles"].items():
        cells = [c for c in sweep["cells"] if c["stages"] == int(stages_key)]
        fastest = max(c["rate_mbit"] for c in cells)
        base = [c for c in cells if c["mode"] == "naive" and c["rate_mbit"] == fastest]
        speed, hop_ms = calibrate(profile, base, sweep)
        for c in cells:
            fleet = local_fleet(profile, c, sweep, hop_ms, speed)
            if fleet.k and c.get("draft_ms_per_token"):
                fleet = _deconvolve_draft(fleet, c["draft_ms_per_token"])
            r = simulate(fleet)
            out.append({**c, "speed": speed, "hop_ms": hop_ms, "predicted_tok_s": r["tok_s"],
                        "draft_service_ms": fleet.draft_ms_per_token if fleet.k else None,
                        "predicted_draft_wall_ms": r["draft_wall_ms_per_token"],
                        "error": r["tok_s"] / c["tok_s"] - 1, "calibration": c in base})
    return out


# -- paper-scale predictions -----------------------------------------------------------------------
ARC_MS_PER_8B_LAYER = 21.5 / 16  # paper: ~20-23 ms per 16-layer INT4 stage of Llama-3.1-8B on an Arc iGPU
MODELS = {  # layers, hidden size, INT4 weight GB, per-layer cost relative to an 8B layer (weights per layer)
    "Llama-3.1-8B": (32, 4096, 4.5, 1.0),
    "Llama-3.1-70B": (80, 8192, 38.0, (70.6e9 - 2.1e9) / 80 / ((8.0e9 - 1.05e9) / 32)),
}
LINKS = {"Wi-Fi LAN (3 ms)": 3.0, "WAN (50 ms)": 50.0}
NODE_MEMORY_GB = 14.0  # usable for weights + KV on a 32 GB AI PC sharing memory with its iGPU
# a 1B INT4 draft on the coordinator's PC, which also serves stage 0 (1/8 of an 8B token's weight reads);
# the paper does not publish its acceptance rate: 0.55 is an assumption (see the paper checks)
DRAFT = dict(k=3, acceptance=0.55, draft_core=0,
             draft_ms=lambda seq: ARC_MS_PER_8B_LAYER * 32 / 8 * (1 + 0.04 * (seq - 1)))


def paper_fleet(model: str, nodes: int, delay_ms: float, users: int, spec: bool) -> Fleet | None:
    """A Llama fleet of ``nodes`` Arc-iGPU PCs (even layer split), or None when it does not fit memory."""
    layers, hidden, weights_gb, rel = MODELS[model]
    if weights_gb / nodes > NODE_MEMORY_GB * 0.8:
        return None
    per_layer = ARC_MS_PER_8B_LAYER * rel
    split = [layers // nodes + (1 if i < layers % nodes else 0) for i in range(nodes)]
    curves = tuple((lambda seq, n=n: n * per_layer * (1 + 0.04 * (seq - 1))) for n in split)
    return Fleet(stage_ms=curves, stage_core=tuple(range(nodes)), hidden_size=hidden, delay_ms=delay_ms,
                 rate_mbit=300.0, hop_ms=1.0, users=users, **(DRAFT if spec else {}))


def predictions() -> list[dict]:
    """Predicted decode tok/s (aggregate and per user) of Llama-3.1-8B on 1-4 and 70B on 4-8 Arc-iGPU
    PCs over each of ``LINKS``, for 1 user, 1 user with speculation and one user per node with it;
    fleets that do not fit ``NODE_MEMORY_GB`` are left out."""
    rows = []
    for model, node_counts in (("Llama-3.1-8B", (1, 2, 3, 4)), ("Llama-3.1-70B", (4, 5, 6, 7, 8))):
        for link, delay in LINKS.items():
            for nodes in node_counts:
                for users, spec in ((1, False), (1, True), (nodes, True)):
                    fleet = paper_fleet(model, nodes, delay if nodes > 1 else 0.0, users, spec)
                    if fleet is None:
                        continue
                    r = simulate(fleet)
                    rows.append({"model": model, "link": link, "nodes": nodes, "users": users, "speculation": spec,
                                 "tok_s": r["tok_s"], "per_user_tok_s": r["per_user_tok_s"]})
    return rows


def paper_checks() -> list[dict]:
    """The model against the paper's published figures."""
    one = simulate(paper_fleet("Llama-3.1-8B", 1, 0.0, 1, False))["tok_s"]
    two = simulate(replace(paper_fleet("Llama-3.1-8B", 2, 3.0, 2, True), k=3))["tok_s"]
    seventy = simulate(paper_fleet("Llama-3.1-70B", 4, 3.0, 1, True))["tok_s"]
    return [
        {"case": "8B, 1 node, 1 stream", "paper_tok_s": 24.54, "model_tok_s": one},
        {"case": "8B, 2 nodes, 2 streams, spec K=3", "paper_tok_s": 43.97, "model_tok_s": two},
        {"case": "70B, 4 nodes (paper: 5.4-6.4)", "paper_tok_s": 5.9, "model_tok_s": seventy},
    ]


def plot(rows: list[dict], path: Path) -> None:
    """Write ``predictions()`` ``rows`` as a PNG at ``path``: tok/s against nodes, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, model in zip(axes, MODELS):
        for link, style in zip(LINKS, ("-", "--")):
            for (users_label, spec), color in zip((("1 user", False), ("1 user + spec", True), ("N users + spec", True)),
                                                  ("tab:gray", "tab:blue", "tab:green")):
                pts = [(r["nodes"], r["tok_s"]) for r in rows if r["model"] == model and r["link"] == link
                       and r["speculation"] == spec and ((r["users"] == 1) == users_label.startswith("1"))]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker="o", label=f"{users_label}, {link}")
        ax.set_title(f"{model} INT4 on Arc-iGPU PCs (predicted)")
        ax.set_xlabel("nodes")
        ax.set_xticks(sorted({r["nodes"] for r in rows if r["model"] == model}))
        ax.set_ylabel("aggregate decode tok/s")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(cells: list[dict]) -> str:
    """Cells within 15% and the worst error, overall and per mode."""
    def line(name: str, group: list[dict]) -> str:
        errors = [c["error"] for c in group]
        return (f"{name}: {sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} within 15%, worst "
                f"{max(errors, key=abs):+.1%}")
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    return "\n".join([line("all cells", cells)] + [line(f"  {m}", [c for c in cells if c["mode"] == m]) for m in modes])


def validation_table(cells: list[dict]) -> str:
    """``validate``'s cells: measured tok/s (and the repeats' spread), predicted, error; calibration cells marked."""
    return harness.table(
        ["fleet", "Mbit/s", "ms/hop", "mode", "measured", "spread", "model", "error", ""],
        [[f"{c['stages']}-stage", f"{c['rate_mbit']:.0f}", f"{c['delay_ms']:.0f}", c["mode"], f"{c['tok_s']:.1f}",
          f"{c['tok_s_spread']:.0%}" if c.get("tok_s_spread") is not None else None, f"{c['predicted_tok_s']:.1f}",
          f"{c['error']:+.1%}", "calibration" if c["calibration"] else ""] for c in cells], pad=True)


def predictions_table(rows: list[dict]) -> str:
    """``predictions()``'s rows: tok/s per model, link and node count for 1 user, + speculation, N users."""
    out = []
    for (model, link, nodes), group in itertools.groupby(rows, key=lambda r: (r["model"], r["link"], r["nodes"])):
        vals = {(r["users"] == 1, r["speculation"]): r["tok_s"] for r in group}
        out.append([model, link, nodes, f"{vals.get((True, False), 0):.1f}", f"{vals.get((True, True), 0):.1f}",
                    f"{vals.get((False, True), vals.get((True, True), 0)):.1f}"])
    return harness.table(["model", "link", "nodes", "1 user", "+spec", "N users+spec"], out, pad=True)


def main(argv: list[str] | None = None) -> int:
    """Validate against ``--sweep`` (if given), check the paper's figures, print and plot the predictions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, help="bench/wan/sweep.py's JSON to validate against")
    parser.add_argument("--json", type=Path, help="write the validation and predictions here")
    parser.add_argument("--plot", type=Path, default=Path("bench/results/fleet_model.png"))
    args = parser.parse_args(argv)
    result: dict = {}
    if args.sweep:
        cells = validate(json.loads(args.sweep.read_text()))
        result["validation"] = cells
        print(validation_table(cells))
        print("calibrated per fleet: " + ", ".join(sorted({f"{c['stages']}-stage speed {c['speed']:.3f}, hop overhead "
                                                           f"{c['hop_ms']:.2f} ms" for c in cells})))
        print(summary(cells) + "  (goal: every cell)")
    checks = paper_checks()
    result["paper_checks"] = checks
    print("\nagainst the paper's figures:")
    for c in checks:
        print(f"  {c['case']:<36} paper {c['paper_tok_s']:6.2f} tok/s, model {c['model_tok_s']:6.2f} "
              f"({c['model_tok_s'] / c['paper_tok_s'] - 1:+.0%})")
    rows = predictions()
    result["predictions"] = rows
    print(f"\npredicted fleets (INT4, Arc iGPU PCs, {NODE_MEMORY_GB:.0f} GB usable each; draft K={DRAFT['k']}, "
          f"acceptance {DRAFT['acceptance']}):")
    print(predictions_table(rows))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    harness.write_json(args.json, "fleet_model", result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
