"""A discrete-event model of a fleet: predicts decode tokens/s (and TTFT) from per-stage compute,
link delay and bandwidth, hidden size, draft cost, acceptance, K and the number of users.

Resources are FIFO servers: each **core** (or PC) runs the stages placed on it, one chunk at a time;
each link **direction** serialises its bytes at the link rate and then adds its one-way delay (a
pure delay: many messages may be in flight); the coordinator's **draft** model runs one proposal at a
time. A user's decode step: draft K tokens -> link into stage 0 -> stage 0 -> link into stage 1 ->
... -> last stage -> link back (the result: k candidates per position) -> the coordinator samples.
Every hop also pays a fixed software latency (calibrated) and CPU time on the receiving stage's core
(gRPC, protobuf, Python: 1.8 ms here, from ``bench/interleave_bench.py``'s CPU accounting: a worker's
CPU ms per token minus its inference ms), which limits how many users' steps a core can interleave. A step emits
``tokens_per_step`` tokens (1 without speculation; with acceptance rate a and K drafts, the expected
(1 - a^(K+1)) / (1 - a), Leviathan et al. 2023, eq. 1). Users beyond the batch groups share a group's
steps, at ``batch_cost(rows)`` times one row's compute.

``python bench/fleet_model.py --sweep bench/results/wan_sweep.json`` validates the model against a
``bench/wan_sweep.py`` run (the naive cells over the fastest link calibrate the hop cost, every
other cell is a prediction) and prints
predicted fleets of Llama-3.1-8B (1-4 nodes) and 70B (4-8 nodes) on LAN/Wi-Fi and WAN links with a
PNG plot, from the paper's device figures (Berenbaum & Venkatachalam, arXiv 2608.19147: ~20-23 ms
per 16-layer INT4 stage on an Arc iGPU, 6 ms TCP RTT on Wi-Fi).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Fleet:
    """What the model needs to know. Times in milliseconds, sizes in bytes, rates in Mbit/s.

    ``stage_ms[i](seq)``: stage i's compute for one chunk of ``seq`` tokens of one row;
    ``stage_core[i]``: which core/PC runs stage i (stages on one core queue behind each other).
    """

    stage_ms: tuple[Callable[[int], float], ...]
    stage_core: tuple[int, ...]
    hidden_size: int
    delay_ms: float = 0.0  # one-way, per link
    rate_mbit: float = 0.0  # per link direction; 0 = unlimited
    hop_ms: float = 0.0  # fixed software latency per hop (event loops, thread hand-offs; calibrated)
    hop_cpu_ms: float = 0.0  # CPU time a hop costs the receiving stage's core (gRPC, protobuf, Python)
    coordinator_ms: float = 0.0  # per step at the coordinator (sampling, scheduling)
    users: int = 1
    groups: int = 0  # batch groups (0 = one per stage); users beyond them share steps
    batch_cost: Callable[[int], float] = lambda rows: 1.0 + 0.15 * (rows - 1)
    k: float = 0.0  # drafts per step (mean); 0 = no speculation
    draft_core: int | None = None  # the core/PC the draft model shares (None: its own)
    acceptance: float = 0.0
    draft_ms_per_token: float = 0.0
    tokens_per_step: float | None = None  # measured; else from acceptance and k
    result_candidates: int = 1  # candidates per position the last stage returns (vocab = full logits)
    prompt_tokens: int = 32
    prefill_chunk: int = 64

    @property
    def emitted_per_step(self) -> float:
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        if not self.k:
            return 1.0
        a, k = self.acceptance, self.k
        return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class _Server:
    """A FIFO resource: ``serve(t, duration)`` returns when a job arriving at t finishes."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def serve(self, arrival: float, duration: float) -> float:
        start = max(arrival, self.free_at)
        self.free_at = start + duration
        return self.free_at


def _transfer(fleet: Fleet, link: _Server, t: float, nbytes: int) -> float:
    serial = nbytes * 8 / (fleet.rate_mbit * 1e3) if fleet.rate_mbit else 0.0  # ms
    return link.serve(t, serial) + fleet.delay_ms + fleet.hop_ms


def simulate(fleet: Fleet, steps_per_user: int = 200) -> dict:
    """Run ``steps_per_user`` decode steps of every user; returns decode tok/s (aggregate and per
    user) and the modelled TTFT (ms)."""
    n = len(fleet.stage_ms)
    cores = {c: _Server() for c in set(fleet.stage_core)}
    up = [_Server() for _ in range(n)]  # link into stage i
    down = _Server()  # last stage's link back to the coordinator
    draft = cores[fleet.draft_core] if fleet.draft_core is not None else _Server()
    groups = fleet.groups or n
    rows = max(1, math.ceil(fleet.users / groups))
    n_groups = min(groups, fleet.users)
    cost = fleet.batch_cost(rows)
    seq = 1 + round(fleet.k)
    counter = itertools.count()
    events: list[_Event] = []
    done_at = [0.0] * n_groups
    steps = [0] * n_groups

    def step(g: int, t: float) -> None:
        if steps[g] == steps_per_user:
            done_at[g] = t
            return
        if fleet.k:  # every row of the group drafts (one draft thread at the coordinator)
            for _ in range(rows):
                t = draft.serve(t, fleet.k * fleet.draft_ms_per_token)
        t = _transfer(fleet, up[0], t, rows * seq * 8)
        for i in range(n):
            t = cores[fleet.stage_core[i]].serve(t, fleet.stage_ms[i](seq) * cost + fleet.hop_cpu_ms)
            if i + 1 < n:
                t = _transfer(fleet, up[i + 1], t, rows * seq * fleet.hidden_size * 4)
        t = _transfer(fleet, down, t, rows * seq * fleet.result_candidates * 8) + fleet.coordinator_ms
        steps[g] += 1
        heapq.heappush(events, _Event(t, next(counter), lambda: step(g, t)))

    for g in range(n_groups):
        heapq.heappush(events, _Event(0.0, next(counter), lambda g=g: step(g, 0.0)))
    while events:
        heapq.heappop(events).action()
    tokens = n_groups * rows * steps_per_user * fleet.emitted_per_step
    elapsed_ms = max(done_at)
    # TTFT of one user alone: prefill chunks through the chain, then one result
    chunks = math.ceil(fleet.prompt_tokens / fleet.prefill_chunk)
    chunk = min(fleet.prompt_tokens, fleet.prefill_chunk)
    per_chunk = (sum(f(chunk) for f in fleet.stage_ms) + (n + 1) * (fleet.delay_ms + fleet.hop_ms)
                 + (chunk * fleet.hidden_size * 4 * 8 / (fleet.rate_mbit * 1e3) if fleet.rate_mbit else 0.0) * (n - 1))
    return {"tok_s": tokens / elapsed_ms * 1000, "per_user_tok_s": tokens / elapsed_ms * 1000 / fleet.users,
            "ttft_ms": chunks * per_chunk + fleet.coordinator_ms}


# -- calibration on this machine -------------------------------------------------------------------
def profile_stages(build: Path, seqs: range = range(1, 10), context: int = 64, repeats: int = 15) -> dict:
    """Median ms of one chunk of ``seq`` tokens (one row) per stage of ``build``, one inference thread,
    in this process: {"stage_ms": [[ms per seq] per stage], "seqs": [...]}."""
    import time

    import numpy as np

    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import compile_ir

    loaded = load_manifest(build)
    out = []
    for i, entry in enumerate(loaded.manifest.stages):
        compiled, _, _ = compile_ir(loaded.directory / entry.xml, "CPU", 1)
        request = compiled.create_infer_request()
        names = {p.get_any_name() for p in compiled.inputs}
        first = "input_ids" in names
        timings = []
        for seq in seqs:
            samples = []
            for _ in range(repeats):
                request.reset_state()
                x0 = (np.arange(context, dtype=np.int64)[None] % 1000 if first
                      else np.zeros((1, context, loaded.manifest.architecture.hidden_size), np.float32))
                feed = {("input_ids" if first else "hidden_states"): x0, "attention_mask": np.ones((1, context), np.int64),
                        "position_ids": np.arange(context)[None], "beam_idx": np.zeros(1, np.int32)}
                if "logits_index" in names:
                    feed["logits_index"] = np.array([context - 1])
                request.infer(feed)
                x = x0[:, :seq]
                feed = {("input_ids" if first else "hidden_states"): x,
                        "attention_mask": np.ones((1, context + seq), np.int64),
                        "position_ids": np.arange(context, context + seq)[None], "beam_idx": np.zeros(1, np.int32)}
                if "logits_index" in names:
                    feed["logits_index"] = np.arange(seq)
                t0 = time.perf_counter()
                request.infer(feed)
                samples.append((time.perf_counter() - t0) * 1000)
            timings.append(sorted(samples)[len(samples) // 2])
        out.append(timings)
    return {"seqs": list(seqs), "stage_ms": out}


def _curve(seqs: list[int], ms: list[float]) -> Callable[[int], float]:
    table = dict(zip(seqs, ms))
    return lambda seq: table.get(seq, ms[-1] * seq / seqs[-1])


LOCAL_HOP_CPU_MS = 1.8  # worker CPU ms per token beyond inference, 2-stage fleet (interleave bench)


def local_fleet(profile: dict, cell: dict, ncpu: int, hidden_size: int, hop_ms: float) -> Fleet:
    """The model of one sweep cell on this machine (stage i pinned to core i mod nproc; the draft
    model shares the least busy core)."""
    curves = tuple(_curve(profile["seqs"], ms) for ms in profile["stage_ms"])
    n = len(curves)
    spec = cell["speculation"] and cell["mean_k"] > 0
    cores = tuple(i % ncpu for i in range(n))
    # the coordinator's draft model is not pinned: it competes with the stages on the least busy core
    load = {c: sum(curves[i](1) for i in range(n) if cores[i] == c) for c in range(min(ncpu, n))}
    return Fleet(stage_ms=curves, stage_core=cores, hidden_size=hidden_size, draft_core=min(load, key=load.get),
                 delay_ms=cell["delay_ms"], rate_mbit=cell["rate_mbit"], hop_ms=hop_ms, hop_cpu_ms=LOCAL_HOP_CPU_MS,
                 users=cell["users"],
                 k=cell["mean_k"] if spec else 0.0, tokens_per_step=cell["tokens_per_step"] if spec else None,
                 draft_ms_per_token=cell.get("draft_ms_per_token") or 0.0)


def validate(sweep: dict) -> list[dict]:
    """Calibrate ``hop_ms`` per fleet on its naive cells over the fastest link (the median over their
    delays of the per-hop time the compute and the delays leave unexplained); predict every cell.
    Returns the cells with ``predicted_tok_s`` and ``error`` (predicted / measured - 1)."""
    profiles = sweep["stage_profiles"]
    ncpu = sweep["machine"]["nproc"]
    out = []
    for stages_key, profile in profiles.items():
        stages = int(stages_key)
        cells = [c for c in sweep["cells"] if c["stages"] == stages]
        fastest = max(c["rate_mbit"] for c in cells)
        base = [c for c in cells if c["mode"] == "naive" and c["rate_mbit"] == fastest]
        unexplained = sorted((1000 / c["tok_s"] - 1000 / simulate(local_fleet(profile, c, ncpu, sweep["hidden_size"],
                                                                               0.0))["tok_s"]) / (stages + 1)
                             for c in base)
        hop_ms = max(0.0, unexplained[len(unexplained) // 2])
        for c in cells:
            predicted = simulate(local_fleet(profile, c, ncpu, sweep["hidden_size"], hop_ms))["tok_s"]
            out.append({**c, "hop_ms": hop_ms, "predicted_tok_s": predicted, "error": predicted / c["tok_s"] - 1,
                        "calibration": c in base})
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
DRAFT = dict(k=3, acceptance=0.55, draft_ms_per_token=ARC_MS_PER_8B_LAYER * 32 / 8, draft_core=0)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, help="wan_sweep.py JSON to validate against")
    parser.add_argument("--json", type=Path, help="write the validation and predictions here")
    parser.add_argument("--plot", type=Path, default=Path("bench/results/fleet_model.png"))
    args = parser.parse_args(argv)
    result: dict = {}
    if args.sweep:
        cells = validate(json.loads(args.sweep.read_text()))
        result["validation"] = cells
        print(f"{'fleet':<7} | {'Mbit/s':>6} | {'ms/hop':>6} | {'mode':<11} | {'measured':>8} | {'model':>7} | {'error':>6}")
        for c in cells:
            print(f"{c['stages']}-stage | {c['rate_mbit']:>6.0f} | {c['delay_ms']:>6.0f} | {c['mode']:<11} | "
                  f"{c['tok_s']:>8.1f} | {c['predicted_tok_s']:>7.1f} | {c['error']:>+6.1%}"
                  + ("  (calibration)" if c["calibration"] else ""))
        worst = max(abs(c["error"]) for c in cells)
        within = sum(abs(c["error"]) <= 0.15 for c in cells)
        print(f"hop cost calibrated per fleet: " + ", ".join(sorted({f"{c['stages']}-stage {c['hop_ms']:.2f} ms"
                                                                     for c in cells})))
        print(f"model within 15% on {within} of {len(cells)} cells; worst error {worst:.1%} (goal: every cell)")
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
    print(f"{'model':<14} | {'link':<17} | {'nodes':>5} | {'1 user':>7} | {'+spec':>7} | {'N users+spec':>12}")
    for (model, link, nodes), group in itertools.groupby(rows, key=lambda r: (r["model"], r["link"], r["nodes"])):
        vals = {(r["users"] == 1, r["speculation"]): r["tok_s"] for r in group}
        print(f"{model:<14} | {link:<17} | {nodes:>5} | {vals.get((True, False), 0):>7.1f} | "
              f"{vals.get((True, True), 0):>7.1f} | {vals.get((False, True), vals.get((True, True), 0)):>12.1f}")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
