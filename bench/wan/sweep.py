"""WAN sweep: decode tokens/s of 2- and 3-stage fleets of a model (the demo by default) behind ``fleet-wan`` links,
one-way delay per hop 0/10/25/50/100 ms at 1 Gbit/s and 20 Mbit/s, for

* naive      : 1 user, no speculation (every token crosses every hop)
* +spec      : 1 user, speculative decoding with the build's self-int8 draft, adaptive K
* +interleave: 2 users, no speculation (batch groups interleave across the stages)
* full stack : 2 users with speculation

and, at the ``relay`` profile, a greedy decode whose last stage returns the full vocabulary's
logits per token (what a naive stack ships) vs only the top-1 candidate (what fleet ships). Prints
the paper's table shape (full stack / naive per delay) and writes every cell to JSON. The
measured cells also calibrate and validate ``bench/wan/fleet_model.py``.

Workers run one inference thread each, pinned to core ``stage mod nproc``; every worker has its
own link (the coordinator reaches stage 0 and the last stage's result stream through them, and
each stage reaches the next through the next one's link), so a step crosses N+1 links.

Repeats: on a shared 2-core machine one run of a cell at small delays varies by about +-10-15% with the
machine's other load, which also drifts over minutes (``bench/wan/fleet_model.py``'s docstring has the numbers).
So each cell runs up to ``--repeats`` times (default 3), its modes taking turns, until its runs took
``--cell-budget-s`` (cheap low-delay cells get every repeat, the 100 ms cells one run), and the JSON
keeps the median tok/s with every run's value and the spread (max - min) / median; speculation
statistics are pooled over the runs. Both link rates of one delay run back to back, so a drift of
the machine's load over minutes does not fall between them.

``--model PATH`` (bench/models.py): a GGUF file or an HF folder, built into ``--cache`` per stage count with a
self-int8 draft (``fleet-compiler build SRC --shards N --draft self-int8``), or a fleet build used as it is: it
must have a ``self-int8`` draft, ``--stages`` defaults to its own count, and the relay cells run on it (2 stages
otherwise). The relay's full-logits return is the manifest's vocabulary, the model's hidden size comes from it too.

    python bench/wan/sweep.py [--model PATH] [--json PATH] [--tokens 24] [--delays 0,10,25,50,100] [--stages 2,3]
                              [--repeats 3] [--cell-budget-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import clients, harness, models

from bench.wan import fleet_calibrate, fleet_model
from bench.wan.links import PROFILES, LinkProfile

PROMPTS = clients.PROMPTS[:2]
MODES = {"naive": (1, False), "+spec": (1, True), "+interleave": (2, False), "full stack": (2, True)}
RATES_MBIT = (1000.0, 20.0)
DRAFTS = ("self-int8",)  # the +spec modes' draft


def run_cell(url: str, users: int, tokens: int) -> dict:
    """``users`` concurrent streams; decode tok/s = tokens after each user's first / (last token of
    anyone - first token of anyone), plus TTFT, the speculation statistics and their counts (decode
    steps that verified drafts, and plain steps: adaptive K decodes one token when drafting does not
    pay; the last verify step's bonus token may be cut, hence the floor at 0)."""
    _, outs = clients.concurrent_users(url, [PROMPTS[i % len(PROMPTS)] for i in range(users)], tokens)
    first = min(o["times"][0] for o in outs)
    last = max(o["times"][-1] for o in outs)
    decoded = users * (tokens - 1)
    drafted = sum(o["fleet"]["drafted_tokens"] for o in outs)
    accepted = sum(o["fleet"]["accepted_tokens"] for o in outs)
    steps = sum(o["fleet"]["verify_steps"] for o in outs)
    draft_ms = sum(o["fleet"]["draft_ms"] for o in outs)
    return {"tok_s": decoded / max(last - first, 1e-9),
            "draft_ms_per_token": draft_ms / drafted if drafted else None,
            "ttft_ms": statistics.median(o["ttft_ms"] for o in outs),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_k": drafted / steps if steps else 0.0,
            "tokens_per_step": (accepted + steps) / steps if steps else 1.0,
            "drafted": drafted, "accepted": accepted, "draft_ms": draft_ms, "verify_steps": steps,
            "plain_steps": sum(max(0, tokens - 1 - o["fleet"]["accepted_tokens"] - o["fleet"]["verify_steps"])
                               for o in outs)}


def pool_runs(runs: list[dict]) -> dict:
    """One cell from its repeated runs: median tok/s and TTFT, every run's tok/s and their spread
    ((max - min) / median), the speculation statistics pooled over the runs' counts."""
    drafted, accepted, steps = (sum(r[k] for r in runs) for k in ("drafted", "accepted", "verify_steps"))
    tok_s = [r["tok_s"] for r in runs]
    median = statistics.median(tok_s)
    return {"tok_s": median, "draft_ms_per_token": sum(r["draft_ms"] for r in runs) / drafted if drafted else None,
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_k": drafted / steps if steps else 0.0,
            "tokens_per_step": (accepted + steps) / steps if steps else 1.0,
            "verify_steps": steps, "plain_steps": sum(r["plain_steps"] for r in runs),
            "runs": len(runs), "tok_s_runs": tok_s, "tok_s_spread": (max(tok_s) - min(tok_s)) / median}


def sweep_fleet(build: Path, stages: int, delays: list[float], tokens: int, logs: Path, repeats: int = 1,
                cell_budget_s: float = 0.0) -> list[dict]:
    """Every (rate, delay, mode) cell of one fleet: workers behind links, a plain and a speculative
    coordinator sharing them; each cell runs up to ``repeats`` times while its runs took less than
    ``cell_budget_s`` (see ``pool_runs``)."""
    cells = []
    with harness.Fleet(build, logs, shards=range(stages), worker_args=("--threads", "1"), pin=True, link=LinkProfile(),
                       coordinator=False, prefix=f"wan-{stages}stage-") as fleet:
        links = fleet.links
        urls = {spec: fleet.add_coordinator("--draft", "self-int8" if spec else "none", "--draft-threads", "1",
                                            "--log-level", "WARNING", name="-spec" if spec else "-plain")[1]
                for spec in (False, True)}
        for delay in delays:  # both rates of a delay back to back (the machine's load drifts over minutes)
            for rate in RATES_MBIT:
                for link in links:
                    link.profile = LinkProfile(delay_ms=delay, rate_mbit=rate)
                for spec in (False, True):  # warm-up: adaptive K learns this link's step costs
                    run_cell(urls[spec], 1, 8)
                runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
                spent = dict.fromkeys(MODES, 0.0)
                for rep in range(repeats):  # the modes take turns, so a drift spreads over all of them
                    for mode, (users, spec) in MODES.items():
                        if rep and spent[mode] >= cell_budget_s:
                            continue
                        t0 = time.monotonic()
                        runs[mode].append(run_cell(urls[spec], users, tokens))
                        spent[mode] += time.monotonic() - t0
                row = {}
                for mode, (users, spec) in MODES.items():
                    cell = {"stages": stages, "rate_mbit": rate, "delay_ms": delay, "mode": mode, "users": users,
                            "speculation": spec, **pool_runs(runs[mode])}
                    cells.append(cell)
                    row[mode] = cell
                print(f"  {stages}-stage {rate:>6.0f} Mbit/s {delay:>5.0f} ms/hop: " + "  ".join(
                    f"{m} {c['tok_s']:6.1f}" + (f" ±{c['tok_s_spread'] / 2:.0%}" if c["runs"] > 1 else "")
                    for m, c in row.items())
                      + f"   full/naive {row['full stack']['tok_s'] / row['naive']['tok_s']:.2f}x", flush=True)
    return cells


async def logits_return(addresses: list[str], build: Path, tokens: int, top_k: int) -> dict:
    """Greedy decode through the pipeline client, the last stage returning ``top_k`` candidates per
    token (the vocabulary size = full logits): decode tok/s and bytes per result."""
    from coordinator.engine.pipeline import Channels, Pipeline
    from coordinator.tokenizer import ChatTokenizer
    from fleet_common.manifest import load_manifest

    loaded = load_manifest(build)
    ids = ChatTokenizer(build).encode_chat([{"role": "user", "content": PROMPTS[0]}])
    channels = Channels()
    pipeline = await Pipeline.connect(addresses, channels, loaded.sha256)
    try:
        session = f"logits-{top_k}-{time.monotonic_ns()}"
        await pipeline.open_session(session, len(ids) + tokens + 8, 60)
        out = await pipeline.step(session, ids, 0, 0, 1, top_k, 120)
        t0, n = time.perf_counter(), len(ids)
        for _ in range(tokens):
            token = int(out.top_ids[-1][np.argmax(out.top_logprobs[-1])])
            out = await pipeline.step(session, [token], n, n, 1, top_k, 120)
            n += 1
        elapsed = time.perf_counter() - t0
        await pipeline.close_session(session, 10)
        return {"top_k": top_k, "tok_s": tokens / elapsed, "result_bytes": out.top_ids.nbytes + out.top_logprobs.nbytes}
    finally:
        await pipeline.close()
        await channels.close()


def relay_cells(build: Path, tokens: int, logs: Path) -> list[dict]:
    """A fleet of ``build`` (each of its stages) over ``relay`` links: top-1 return vs full-logits return
    (the vocabulary size of its manifest)."""
    vocab = models.architecture(build).vocab_size
    cells = []
    with harness.Fleet(build, logs, worker_args=("--threads", "1"), pin=True, link=PROFILES["relay"],
                       coordinator=False, prefix="wan-relay-") as fleet:
        for top_k in (1, vocab):
            cell = {"profile": "relay", **asyncio.run(logits_return(fleet.peers, build, tokens, top_k))}
            cells.append(cell)
            print(f"  relay, {'top-1' if top_k == 1 else 'full logits'} return: {cell['tok_s']:.2f} tok/s, "
                  f"{cell['result_bytes']:,} bytes per result", flush=True)
    return cells


def table(cells: list[dict], delays: list[float]) -> str:
    """The sweep's cells as text: tok/s per mode and the full-stack/naive ratio per fleet, link and delay."""
    rows = []
    for stages in sorted({c["stages"] for c in cells}):
        for rate in RATES_MBIT:
            for delay in delays:
                row = {c["mode"]: c for c in cells if c["stages"] == stages and c["rate_mbit"] == rate
                       and c["delay_ms"] == delay}
                if row:
                    rows.append([f"{stages}-stage", f"{rate:.0f} Mbit", f"{delay:.0f}",
                                 *(f"{row[m]['tok_s']:.1f}" for m in MODES),
                                 f"{row['full stack']['tok_s'] / row['naive']['tok_s']:.2f}x"])
    return harness.table(["fleet", "link", "ms/hop", *MODES, "full/naive"], rows, pad=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sweep's options; argparse's usage error for a bad value or a build without a self-int8 draft."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models.add_model_option(parser)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", type=int, default=24, help="completion tokens per user per cell")
    parser.add_argument("--delays", default="0,10,25,50,100")
    parser.add_argument("--stages", type=models.counts, help="fleet stage counts (default 2,3; a build: its own)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE)
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell at most (the median is kept)")
    parser.add_argument("--cell-budget-s", type=float, default=4.0,
                        help="no further repeat of a cell once its runs took this long (keeps the sweep under 15 min)")
    args = parser.parse_args(argv)
    args.stages = models.stage_counts(args.model, args.stages, [2, 3]) if args.model else args.stages or [2, 3]
    try:
        if args.model:
            models.check_stages(args.model, args.stages, DRAFTS)
    except models.ModelError as exc:
        parser.error(str(exc))
    return args


def stage_profiles(builds: dict[int, Path]) -> dict[int, dict]:
    """Each build's per-stage and draft chunk costs, measured on one core with one thread as the workers run."""
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})  # profile each stage as the workers run: one core, one thread
    draft = fleet_calibrate.profile_draft(next(iter(builds.values())), "self-int8")  # one model, every build's
    profiles = {n: {**fleet_calibrate.profile_stages(b), **draft} for n, b in builds.items()}
    os.sched_setaffinity(0, affinity)
    for n, p in profiles.items():
        print(f"  {n}-stage compute per chunk of 1 / 4 / 8 tokens, ms: " + "; ".join(
            f"stage {i} {ms[0]:.1f} / {ms[3]:.1f} / {ms[7]:.1f}" for i, ms in enumerate(p["stage_ms"])), flush=True)
    return profiles


def relay_build(model: models.Model, builds: dict[int, Path], cache: Path) -> Path:
    """The relay cells' fleet: the 2-stage build (made from a source if the sweep has none), or the build folder."""
    if model.kind == "build":
        return model.path
    return builds.get(2) or harness.ensure_build(model.path, cache, 2, drafts=DRAFTS)


def print_summary(cells: list[dict], relay: list[dict], delays: list[float]) -> None:
    """The sweep's table, adaptive K per delay, the relay comparison, the targets and the repeat spread."""
    print("\ndecode tok/s (aggregate over users)\n" + table(cells, delays))
    print("\nadaptive K (+spec, 1 user): mean drafts per verify step by delay (slower links should pick larger K),"
          " and the share of decode steps that drafted")
    for stages in sorted({c["stages"] for c in cells}):
        for rate in RATES_MBIT:
            ks = [(c["delay_ms"], c["mean_k"], c["acceptance_rate"] or 0.0,
                   c["verify_steps"] / max(1, c["verify_steps"] + c["plain_steps"]))
                  for c in cells if c["stages"] == stages and c["rate_mbit"] == rate and c["mode"] == "+spec"]
            print(f"  {stages}-stage {rate:>5.0f} Mbit/s: " + ", ".join(
                f"{d:.0f} ms K {k:.1f} (accept {a:.2f}, {v:.0%} of steps)" for d, k, a, v in ks))
    top1, full = relay
    print(f"\nrelay profile {json.dumps(PROFILES['relay'].__dict__)}: top-1 return {top1['tok_s']:.2f} tok/s vs full "
          f"logits {full['tok_s']:.2f} tok/s = {top1['tok_s'] / full['tok_s']:.2f}x")
    for c in cells:
        if c["stages"] == 2 and c["mode"] == "full stack" and c["delay_ms"] in (50, 100) and c["rate_mbit"] == 20:
            naive = next(n for n in cells if n["stages"] == 2 and n["mode"] == "naive" and n["rate_mbit"] == 20
                         and n["delay_ms"] == c["delay_ms"])
            goal = 4 if c["delay_ms"] == 50 else 5
            print(f"target: 2 stages, {c['delay_ms']:.0f} ms/hop, full stack = {c['tok_s'] / naive['tok_s']:.2f}x naive "
                  f"(goal >= {goal}x)")
    repeated = sorted((c for c in cells if c["runs"] > 1), key=lambda c: c["tok_s_spread"])
    if repeated:
        worst = repeated[-1]
        print(f"repeat spread (max - min) / median over {len(repeated)} repeated cells: median "
              f"{statistics.median(c['tok_s_spread'] for c in repeated):.0%}, largest {worst['tok_s_spread']:.0%} "
              f"({worst['stages']}-stage {worst['rate_mbit']:.0f} Mbit/s {worst['delay_ms']:.0f} ms {worst['mode']})")


def main(argv: list[str] | None = None) -> int:
    """Profile, sweep every fleet, run the relay cells, validate the fleet model; writes ``--json``."""
    args = parse_args(argv)
    delays = [float(d) for d in args.delays.split(",")]
    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = models.from_args(args.model, cache)
    builds = models.builds(model, cache, args.stages, drafts=DRAFTS)
    t0 = time.monotonic()
    profiles = stage_profiles(builds)
    print(f"WAN sweep: {model.name}, {args.tokens} tokens per user, delays {delays} ms per hop, {RATES_MBIT} Mbit/s, "
          f"up to {args.repeats} runs per cell ({args.cell_budget_s:.0f} s), nproc {os.cpu_count()}", flush=True)
    cells = []
    for stages, build in builds.items():
        cells += sweep_fleet(build, stages, delays, args.tokens, logs, args.repeats, args.cell_budget_s)
    relay = relay_cells(relay_build(model, builds, cache), args.tokens, logs)
    print_summary(cells, relay, delays)
    from coordinator.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(next(iter(builds.values())))
    result = harness.write_json(None, "wan_sweep", {
        "model": model.name, "model_path": str(model.path), "model_kind": model.kind,
        "tokens": args.tokens, "delays_ms": delays, "rates_mbit": RATES_MBIT,
        "repeats": args.repeats, "cell_budget_s": args.cell_budget_s,
        "prompt_tokens": [len(tokenizer.encode_chat([{"role": "user", "content": p}])) for p in PROMPTS],
        "cells": cells, "relay": relay, "profiles": {k: v.__dict__ for k, v in PROFILES.items()},
        "stage_profiles": {str(n): p for n, p in profiles.items()},
        "hidden_size": models.architecture(next(iter(builds.values()))).hidden_size})
    checked = fleet_model.validate(result)
    worst = max(abs(c["error"]) for c in checked)
    print(f"fleet model (bench/wan/fleet_model.py): within 15% on {sum(abs(c['error']) <= 0.15 for c in checked)} of "
          f"{len(checked)} cells, worst {worst:.1%}")
    print(f"sweep took {time.monotonic() - t0:.0f} s")
    harness.write_json(args.json, "wan_sweep", result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
