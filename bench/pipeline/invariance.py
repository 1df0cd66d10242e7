"""Which settings make greedy output invariant: 8 concurrent streams against their solo runs, and a stream
failed over to a replica against the same stream without a failure, on real fleets of the demo's 2-stage build.

For each configuration (one setting toggled from the shipped defaults at a time, plus the combinations
that isolate a cause) a fresh fleet (2 workers, no mDNS, loopback) answers the 8 prompts one at a time
(the solo runs, with the top-2 logprobs of every position), then all 8 at once (batch groups). A stream
differs when its ``fleet.completion_token_ids`` differ from its solo run's; the table gives how many of 8
differ, the first position where each does, and how many of those positions were a near-tie in the solo
run (top-2 logprob gap below ``--tie``). ``--failover`` adds, per configuration, a fleet with a second
stage-1 worker: one stream is run to the end, then again with the stage-1 worker serving it killed
(SIGKILL) after 30 tokens, and the two are compared the same way.

    python bench/pipeline/invariance.py [--configs defaults,f32,...] [--tokens 128] [--failover] [--json PATH]

Findings (docs/precision.md, 2-stage demo, 128 tokens): at the defaults 5, 6 and 7 of 8 streams differed in
three runs and the failover diverged at token 57; ``--threads 1`` 3/8, ``--draft none`` 3/8,
``--no-prefix-cache`` 6/8, ``--max-batch 1`` 4/8, ``--batch-groups 1`` 4/8, the three together 2/8 and 4/8;
``--inference-precision f32`` 0/8 and an identical failover (also at ``--threads 1``). Every divergence was at
a top-two gap below 0.15. The default precision on a bf16-capable CPU is bf16 (the f16 KV cache plays no part:
f32 KV at bf16 gives bit-identical logits); at bf16 a token's logits depend on the shape of the steps that
computed its context (a session's first chunk; batch rows and chunk lengths with more than one thread), by up
to ~0.7. At f32 they move by ~7e-5 at most.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from bench import harness

PROMPTS = [  # tests/integration/test_concurrency.py's
    "What is the capital of France?",
    "Explain how a bicycle works in simple terms.",
    "Write a Python function that reverses a string.",
    "List five fruits and their colors.",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What are the three states of matter?",
]
FAILOVER_PROMPT = "Write a long story about a dragon who learns to bake bread."  # test_failover.py's
# name -> (worker arguments, coordinator arguments); everything not named is the shipped default
CONFIGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "defaults": ((), ()),
    "f32": (("--inference-precision", "f32"), ()),
    "threads1": (("--threads", "1"), ()),
    "draft-none": ((), ("--draft", "none")),
    "no-prefix-cache": ((), ("--no-prefix-cache",)),
    "max-batch1": ((), ("--max-batch", "1")),
    "batch-groups1": ((), ("--batch-groups", "1")),
    "threads1+no-prefix-cache": (("--threads", "1"), ("--no-prefix-cache",)),
    "threads1+no-prefix-cache+draft-none": (("--threads", "1"), ("--no-prefix-cache", "--draft", "none")),
    "f32+threads1": (("--inference-precision", "f32", "--threads", "1"), ()),
}


def default_build() -> Path:
    """The newest 2-stage test build (tests/conftest.py makes it: ``pytest tests/integration/test_api.py``)."""
    builds = sorted(harness.TEST_MODELS.glob("smollm2-2stage-" + "?" * 10), key=lambda p: p.stat().st_mtime)
    if not builds:
        raise SystemExit("no models/test/smollm2-2stage-* build: run the tests once or pass --build")
    return builds[-1]


def start_fleet(build: Path, config: str, logs: Path, replicas: int = 1) -> harness.Fleet:
    """Workers (stage 0 once, stage 1 ``replicas`` times) and a coordinator of ``config``; its URL once every
    stage has a worker."""
    worker_args, coord_args = CONFIGS[config]
    return harness.Fleet(build, logs, *coord_args, shards=[0, *[1] * replicas], worker_args=worker_args, draft=None,
                         prefix=f"{config}-")


def complete(url: str, prompt: str, tokens: int, logprobs: bool = False) -> dict:
    """One greedy chat completion: {"ids": output ids, "gaps": top-1 minus top-2 logprob per position}."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": tokens,
            "ignore_eos": True}
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    reply = r.json()
    out = {"ids": reply["fleet"]["completion_token_ids"], "fleet": reply["fleet"]}
    if logprobs:
        out["gaps"] = [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"]
                       for t in reply["choices"][0]["logprobs"]["content"]]
    return out


def compare(ref: dict, ids: list[int], tie: float) -> dict:
    """Where ``ids`` first leaves the reference run ``ref`` (None: identical), and whether that was a near-tie."""
    first = next((i for i, (a, b) in enumerate(zip(ref["ids"], ids)) if a != b), None)
    if first is None and len(ids) != len(ref["ids"]):
        first = min(len(ids), len(ref["ids"]))
    gap = ref["gaps"][first] if first is not None and first < len(ref.get("gaps", [])) else None
    return {"first": first, "gap": gap, "near_tie": gap is not None and gap < tie}


def concurrency(url: str, tokens: int, tie: float) -> dict:
    """The 8 prompts solo (with top-2 logprobs) then all at once: how many differ, where, near-ties."""
    solo = {p: complete(url, p, tokens, logprobs=True) for p in PROMPTS}
    together: dict = {}

    def one(p: str) -> None:
        together[p] = complete(url, p, tokens)["ids"]

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    diffs = [compare(solo[p], together[p], tie) for p in PROMPTS]
    gaps = [g for p in PROMPTS for g in solo[p]["gaps"]]
    # how often a close call comes up at all: what a tolerance of the tests (conftest.DEFAULTS_NEAR_TIE) lets pass
    share = {str(t): round(sum(g < t for g in gaps) / len(gaps), 3) for t in (0.075, 0.25, 1.0)}
    return {"differ": sum(d["first"] is not None for d in diffs), "of": len(PROMPTS),
            "first": [d["first"] for d in diffs], "gaps": [d["gap"] and round(d["gap"], 4) for d in diffs],
            "near_ties": sum(d["near_tie"] for d in diffs), "positions_below_gap": share,
            "concurrent_tokens_per_s": round(len(PROMPTS) * tokens / wall, 1),
            "draft": solo[PROMPTS[0]]["fleet"].get("draft")}


def failover(build: Path, config: str, logs: Path, tokens: int, tie: float, after: int = 30) -> dict:
    """The failover prompt to the end, then again with the stage-1 worker serving it SIGKILLed after ``after``
    streamed tokens (by the coordinator's placement load)."""
    with start_fleet(build, config, logs, replicas=2) as fleet:
        url, workers = fleet.url, [(shard, proc, address) for shard, (proc, address) in zip([0, 1, 1], fleet.workers)]
        ref = complete(url, FAILOVER_PROMPT, tokens, logprobs=True)
        body = {"messages": [{"role": "user", "content": FAILOVER_PROMPT}], "temperature": 0, "max_tokens": tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks, fleet, killed = 0, {}, None
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": event["error"]}
                fleet = event.get("fleet") or fleet
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    chunks += 1
                if chunks == after and killed is None:
                    load = {w["address"]: w["load"] for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]}
                    for shard, proc, address in workers:
                        if shard == 1 and load.get(address, 0) > 0:
                            os.killpg(proc.pid, signal.SIGKILL)
                            killed = address
                            break
        result = compare(ref, fleet.get("completion_token_ids", []), tie)
        return {**result, "killed": killed, "failovers": fleet.get("failovers")}


def table(rows: list[dict]) -> str:
    """The markdown table: per configuration, streams differing from their solo runs, where, near-ties, the
    concurrent rate and the failover's first differing token."""
    out = []
    for row in rows:
        c, f = row["concurrency"], row.get("failover")
        firsts = ", ".join(str(x) for x in sorted(x for x in c["first"] if x is not None)) or "-"
        fo = "" if f is None else (f.get("error") or ("identical" if f["first"] is None else str(f["first"])))
        out.append([row["config"], c["draft"], f"{c['differ']}/{c['of']}", firsts, c["near_ties"],
                    c["concurrent_tokens_per_s"], fo])
    return harness.table(["configuration", "draft", "streams differing", "first differing token",
                          "near-ties (solo gap < tie)", "concurrent tok/s", "failover: first differing token"], out)


def main(argv: list[str] | None = None) -> int:
    """Each configuration's fleet (module docstring); prints a JSON line per row and the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=None, help="2-stage build (default: the newest test build)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (ignore_eos)")
    parser.add_argument("--tie", type=float, default=0.05, help="top-2 logprob gap counted as a near-tie")
    parser.add_argument("--failover", action="store_true", help="also measure failover per configuration")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/fleet-invariance"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    build = args.build or default_build()
    args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        with start_fleet(build, config, args.logs) as fleet:
            url = fleet.url
            row = {"config": config, "workers": CONFIGS[config][0], "coordinator": CONFIGS[config][1],
                   "concurrency": concurrency(url, args.tokens, args.tie)}
        if args.failover:
            row["failover"] = failover(build, config, args.logs, args.tokens, args.tie)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    harness.write_json(args.json, "invariance", {"build": str(build), "tokens": args.tokens, "tie": args.tie,
                                                 "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
