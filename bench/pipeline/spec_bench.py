"""Speculative decoding benchmark on the demo model, one run, table + JSON.

(a) Cost of one rejection (K = 4 rejected drafts) at KV contexts 128, 1024 and 2048, on both shards
    of the 2-stage build in this process: mask-based rejection (clear 4 visibility bits, then carry 4
    hidden slots through the next step's attention) vs a physical trim (rewrite every KV state
    tensor without the 4 slots, the only way to shrink an OpenVINO stateful KV in place). Also the
    amortized cost of our compaction (one rewrite per >= 64 hidden slots, i.e. per >= 16 rejections).
(b) Decode tokens/s with speculation off and on, per draft source (ngram, self-int8, self-int4,
    the 8-layer early-exit model), adaptive K, over 8 prompt categories, with acceptance rates, on a 2-stage
    fleet (a worker process per stage, gRPC on loopback) ...
(c) ... with a one-way delay per hop of 0, 10 and 50 ms: a fleet-wan link per worker (bench/wan/links.py)
    in front of each worker, so coordinator -> stage 0 -> stage 1 -> coordinator (the result stream)
    each cross one delayed link. (b) is the 0 ms row of (c).

Within a delay, prompts run round-robin across the draft sources so machine load hits all alike;
a cell is the median over categories of the coordinator's decode tokens/s (first token -> last).

    python bench/pipeline/spec_bench.py [--json PATH] [--tokens 96] [--delays 0,10,50] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from bench import harness
from bench.wan.links import LinkProfile

CATEGORIES = {
    "short factual": "What is the capital of Australia, and when did it become the capital?",
    "reasoning": "If a train leaves at 3 pm and travels 120 km at 60 km/h, when does it arrive? Explain.",
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "list": "List ten common kitchen utensils, one per line, each with a short description.",
    "creative": "Write a short poem about autumn leaves falling in a quiet park.",
    "technical explanation": "Explain how a hash table works and why lookups are fast on average.",
    "chat": "Hi! I'm planning a weekend trip and feel a bit stressed. Any tips to relax?",
    "translation": "Translate into French: 'The weather is nice today, so we are going to the beach.'",
}
EARLY_EXIT_LAYERS = 8
SOURCES = ("none", "ngram", "self-int8", "self-int4", f"SmolLM2-early{EARLY_EXIT_LAYERS}")
CONTEXTS = (128, 1024, 2048)
REJECTED = 4
CARRY_PROBE = 128  # hidden slots used to measure the per-slot attention cost of carrying them


# ---------------------------------------------------------------- (a) mask vs trim

def median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    """Median ms of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def rejection_costs(build: Path, repeats: int) -> list[dict]:
    """Per context: ms of mask-based rejection vs physical trim of REJECTED slots, summed over stages."""
    import openvino as ov

    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import KVSession, compact
    from worker.runner import ShardRunner

    loaded = load_manifest(build)
    runners = [ShardRunner(loaded, i) for i in range(loaded.manifest.num_stages)]
    rng = np.random.default_rng(0)
    rows = []
    for context in CONTEXTS:
        total = context + CARRY_PROBE + 256
        sessions = [KVSession(f"c{context}", r.new_request(), total) for r in runners]

        def feed(tokens: np.ndarray, hide: list[int] = ()) -> None:
            x, past = tokens[None, :], sessions[0].length
            for runner, session in zip(runners, sessions):
                x = runner.run(session, x, past, past, list(hide), 1).output

        for start in range(0, context, 256):  # prefill the context with random tokens
            feed(rng.integers(0, 40000, min(256, context - start)))
        snapshot = [[s.state.data.copy() for s in ses.request.query_state()] for ses in sessions]

        def restore() -> None:
            for ses, states in zip(sessions, snapshot):
                for state, data in zip(ses.request.query_state(), states):
                    state.state = ov.Tensor(data)
                ses.length = context
                ses.visible[0, :] = 0
                ses.visible[0, :context] = 1

        # trim: the state holds context + REJECTED slots; rewrite it without the last REJECTED
        trim, update, step_plain, step_masked = [], [], [], []
        for _ in range(repeats):
            restore()
            feed(rng.integers(0, 40000, REJECTED))
            t0 = time.perf_counter()
            for ses in sessions:
                compact(ses, ses.length, list(range(context, context + REJECTED)))
            trim.append((time.perf_counter() - t0) * 1000)
            # mask: the same rejection as visibility bits ...
            restore()
            feed(rng.integers(0, 40000, REJECTED))
            t0 = time.perf_counter()
            for ses in sessions:
                ses.visible[0, context:context + REJECTED] = 0
            update.append((time.perf_counter() - t0) * 1000)
            # ... whose hidden slots every later step carries through attention: measured per slot
            # with CARRY_PROBE hidden slots (one slot is below timer noise), scaled to REJECTED
            restore()
            feed(rng.integers(0, 40000, CARRY_PROBE), hide=[])
            for ses in sessions:
                ses.visible[0, context:context + CARRY_PROBE] = 0
            t0 = time.perf_counter()
            feed(rng.integers(0, 40000, 1))
            step_masked.append((time.perf_counter() - t0) * 1000)
            restore()
            t0 = time.perf_counter()
            feed(rng.integers(0, 40000, 1))
            step_plain.append((time.perf_counter() - t0) * 1000)
        carry = max(0.0, statistics.median(step_masked) - statistics.median(step_plain)) * REJECTED / CARRY_PROBE
        trim_ms, update_ms = statistics.median(trim), statistics.median(update)
        rows.append({"context": context, "rejected": REJECTED, "stages": len(runners), "repeats": repeats,
                     "trim_ms": trim_ms, "mask_update_ms": update_ms, "mask_carry_ms_per_step": carry,
                     "mask_ms": update_ms + carry, "mask_over_trim": (update_ms + carry) / trim_ms,
                     "compaction_ms_amortized": trim_ms / 16,
                     "decode_step_ms": statistics.median(step_plain)})
    return rows


# ---------------------------------------------------------------- (b), (c) fleet

def ensure_build(hf: Path, cache: Path) -> Path:
    """The 2-stage build of ``hf`` with every draft source this bench compares (self-int8, self-int4 and the
    8-layer early-exit model), made once per compiler version into ``cache``."""
    draft = harness.early_exit_draft(hf, cache / f"SmolLM2-early{EARLY_EXIT_LAYERS}", EARLY_EXIT_LAYERS)
    return harness.ensure_build(hf, cache, 2, drafts=("self-int8", "self-int4", str(draft)))


def chat(client: httpx.Client, url: str, prompt: str, tokens: int) -> dict:
    """One greedy non-streamed completion of ``tokens``: its text and the response's ``fleet`` statistics."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "ignore_eos": True,
            "max_tokens": tokens}
    r = client.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], **body["fleet"]}


def fleet_runs(build: Path, logs: Path, delays: list[float], tokens: int, categories: dict[str, str]) -> list[dict]:
    """Every (delay, source, category) run; workers behind delaying proxies, one coordinator per source."""
    runs = []
    with harness.Fleet(build, logs, shards=[0, 1], link=LinkProfile(), coordinator=False, prefix="spec-") as fleet, \
            httpx.Client() as client:
        urls = {source: fleet.add_coordinator("--log-level", "WARNING", draft=source, name=f"-{source}")[1]
                for source in SOURCES}
        for delay in delays:
            for proxy in fleet.links:
                proxy.profile = LinkProfile(delay_ms=delay)
            for source in SOURCES:  # warm-up: compile paths, and adaptive K's step-cost estimates
                chat(client, urls[source], "Say hello.", 16)
            for category, prompt in categories.items():
                for source in SOURCES:
                    run = chat(client, urls[source], prompt, tokens)
                    runs.append({"delay_ms": delay, "source": source, "category": category, **run})
                print(f"  {delay:>3.0f} ms/hop  {category:<22} " + "  ".join(
                    f"{r['source']} {r['decode_tokens_per_s']:.1f}" for r in runs[-len(SOURCES):]), flush=True)
    return runs


def summarize(runs: list[dict], delays: list[float]) -> list[dict]:
    """Per delay and draft source: median decode tok/s over the categories, speed-up over plain decoding,
    acceptance, mean K, the per-category numbers and whether every text equals plain decoding's."""
    rows = []
    for delay in delays:
        base = None
        for source in SOURCES:
            mine = [r for r in runs if r["delay_ms"] == delay and r["source"] == source]
            tok_s = statistics.median(r["decode_tokens_per_s"] for r in mine)
            base = tok_s if source == "none" else base
            drafted = sum(r["drafted_tokens"] for r in mine)
            accepted = sum(r["accepted_tokens"] for r in mine)
            rows.append({
                "delay_ms": delay, "source": source, "decode_tok_s": tok_s, "speedup": tok_s / base,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_k": drafted / max(1, sum(r["verify_steps"] for r in mine)),
                "per_category": {r["category"]: {"tok_s": round(r["decode_tokens_per_s"], 2),
                                                 "acceptance": r["acceptance_rate"]} for r in mine},
                "same_text_as_plain": all(r["text"] == p["text"] for r, p in zip(
                    mine, [r for r in runs if r["delay_ms"] == delay and r["source"] == "none"])),
            })
    return rows


def tables(costs: list[dict], rows: list[dict], categories: list[str]) -> str:
    """(a) the rejection costs per context and (b, c) decode tok/s per delay and draft source, as text."""
    rejection = harness.table(
        ["context", "trim ms", "mask ms", "(update", "carry)", "mask/trim", "compaction ms/rejection"],
        [[c["context"], f"{c['trim_ms']:.3f}", f"{c['mask_ms']:.4f}", f"{c['mask_update_ms']:.4f}",
          f"{c['mask_carry_ms_per_step']:.3f}", f"{c['mask_over_trim']:.2%}", f"{c['compaction_ms_amortized']:.3f}"]
         for c in costs], pad=True)
    speed = harness.table(
        ["ms/hop", "draft", "tok/s", "x plain", "accept", "K", *(c.split()[0][:6] for c in categories)],
        [[f"{r['delay_ms']:.0f}", r["source"], f"{r['decode_tok_s']:.1f}", f"{r['speedup']:.2f}",
          f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else None, f"{r['mean_k']:.1f}",
          *(f"{r['per_category'][c]['tok_s']:.1f} ({r['per_category'][c]['acceptance'] or 0:.2f})" for c in categories)]
         for r in rows], pad=True)
    return (f"(a) one rejection of {REJECTED} drafts, both stages of the 2-stage build\n{rejection}\n\n"
            f"(b, c) decode tok/s, 2-stage fleet, adaptive K; acceptance rate per category in ()\n{speed}")


def main(argv: list[str] | None = None) -> int:
    """Measure (a), then (b, c) (module docstring); prints the tables and targets, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every run and summary here")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per prompt (ignore_eos)")
    parser.add_argument("--delays", default="0,10,50", help="one-way delay per hop, ms, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="repetitions per (a) measurement")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 categories, 24 tokens, delays 0,50")
    parser.add_argument("--cache", type=Path, default=harness.CACHE, help="builds are cached here")
    args = parser.parse_args(argv)
    delays = [float(d) for d in ("0,50" if args.quick else args.delays).split(",")]
    tokens = 24 if args.quick else args.tokens
    categories = dict(list(CATEGORIES.items())[:3]) if args.quick else CATEGORIES

    cache = args.cache.resolve()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    build = ensure_build(harness.demo_hf(None, cache), cache)
    print(f"spec bench: (a) contexts {CONTEXTS}; (b, c) {tokens} tokens x {len(categories)} categories x "
          f"{len(SOURCES)} sources x delays {delays} ms; nproc {os.cpu_count()}", flush=True)
    costs = rejection_costs(build, 5 if args.quick else args.repeats)
    runs = fleet_runs(build, cache / "logs", delays, tokens, categories)
    rows = summarize(runs, delays)
    print("\n" + tables(costs, rows, list(categories)))
    at = {c["context"]: c for c in costs}
    print(f"\ntargets: mask/trim at 1024 = {at[1024]['mask_over_trim']:.2%} (goal <= 1%)" if 1024 in at else "")
    for r in rows:
        if r["delay_ms"] == 50 and r["source"] != "none":
            print(f"  50 ms/hop, {r['source']}: {r['speedup']:.2f}x plain (goal >= 2.5x)")
    harness.write_json(args.json, "spec_bench", {
        "model": "SmolLM2-135M-Instruct", "build": str(build), "tokens": tokens, "categories": categories,
        "sources": SOURCES, "delays_ms": delays, "rejection_cost": costs, "summary": rows, "runs": runs})
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
