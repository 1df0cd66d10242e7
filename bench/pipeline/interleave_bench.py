"""Many users on one fleet: aggregate and per-user decode tokens/s and TTFT for 1, 2, 4, 8 concurrent
users on 1-, 2- and 3-stage fleets of a model (the demo by default), beside the whole model in one process.

Each worker is pinned to its own core (``taskset``, core = stage mod nproc) with one inference
thread, standing in for separate PCs; the coordinator is not pinned. The baseline is the 1-stage
build's whole-model IR in one process on one core, one thread, one user (a numpy greedy loop fed as
a worker feeds it). Greedy, ``ignore_eos``, the same token count for everyone; users start together.

* aggregate tok/s = all completion tokens / wall time from the first request to the last token
* per-user tok/s = median over users of (tokens - 1) / (first token -> last token)
* TTFT = median over users of request start -> first streamed token
* CPU ms/token = CPU time (user + system) each fleet process and the client spent per completion
  token; ``cpu bound`` = nproc * 1000 / their sum, the tokens/s this machine could give if every core
  did nothing but this work (all roles share the same cores here, unlike separate PCs)

Each fleet runs twice: ``interleave`` (``--max-batch 1``: every session its own KV state, steps of
different users overlap across the stages) and ``batch groups`` (the default: sessions of a group
share one infer call per stage, and groups interleave).

    python bench/pipeline/interleave_bench.py [--model PATH] [--json PATH] [--tokens 64] [--users 1,2,4,8] [--stages 1,2,3]

``--model PATH`` (bench/models.py): a GGUF file or an HF folder, built into ``--cache`` per stage count (and
the 2-stage even split), or a fleet build used as it is: ``--stages`` then defaults to its own count, and the
baseline (a 1-stage build), the even split and the fairness runs (2 stages) run only where it has them.

``--llama-cpp`` runs instead the fleet against llama.cpp's RPC fleet on one GGUF (the demo's Q4_1, or
``--model FILE.gguf``: llama.cpp needs a GGUF, and the fleet is built from the same file), 2 stages, 1, 2 and
4 users, fleet ÷ llama.cpp per cell (bench/pipeline/llama_cpp.py; build llama.cpp once with bench/build_llama_cpp.sh):

    python bench/pipeline/interleave_bench.py --llama-cpp [--model FILE.gguf] [--llama-cpp-bin DIR] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench import clients, harness, models
from bench.clients import PROMPTS, run_users, user
from bench.models import counts, positive_int


def baseline(build: Path, tokens: int, core: int = 0) -> dict:
    """Whole model, one process pinned to ``core``, one thread, one user: decode tok/s and TTFT."""
    code = f"""
import os, sys, time, json
import numpy as np, openvino as ov
from coordinator.tokenizer import ChatTokenizer
from fleet_common.runtime import stage_core
os.sched_setaffinity(0, {{{core}}})
build = {str(build)!r}
tok = ChatTokenizer(build)
req = stage_core().compile_model(build + "/stage_0/openvino_model.xml", "CPU",
    {{"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": 1}}).create_infer_request()
rates, ttfts = [], []
for prompt in {list(PROMPTS[:3])!r} * 2:
    ids = tok.encode_chat([{{"role": "user", "content": prompt}}])
    req.reset_state()
    chunk, past, out = ids, 0, []
    start = time.perf_counter()
    while len(out) < {tokens}:
        seq = len(chunk)
        logits = req.infer({{"input_ids": np.array([chunk], dtype=np.int64),
            "attention_mask": np.ones((1, past + seq), dtype=np.int64),
            "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32), "logits_index": np.array([seq - 1], dtype=np.int64)}})[0]
        out.append(int(logits[0, -1].argmax()))
        if past == 0:
            first = time.perf_counter()
        chunk, past = out[-1:], past + seq
    rates.append((len(out) - 1) / (time.perf_counter() - first))
    ttfts.append((first - start) * 1000)
print(json.dumps({{"decode_tok_s": sorted(rates)[len(rates) // 2], "ttft_ms": sorted(ttfts)[len(ttfts) // 2]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=harness.ROOT,
                         env=harness.repo_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


# without batching at a stage, with batch groups (default: one group per stage), and with one group
# more (the coordinator and the network as one more stage of the cycle)
MODES = {"interleave": lambda stages: ["--max-batch", "1"], "batch groups": lambda stages: [],
         "batch groups G=stages+1": lambda stages: ["--batch-groups", str(stages + 1)]}

LONG_PROMPT = ("Summarize the following notes in one sentence. " + " ".join(
    f"Note {i}: the committee met on day {i} and agreed to review item {i * 7 % 23} before the next session."
    for i in range(80)))  # about 1,800 tokens


def fairness_cells(build: Path, logs: Path, chunks: tuple[int, ...] = (64, 256, 4096)) -> list[dict]:
    """Three users decode on a 2-stage fleet while a fourth arrives with a ~1,800-token prompt: the
    decoders' longest gap between tokens while it prefills, and its TTFT, per ``--prefill-chunk``."""
    cells = []
    for chunk in chunks:
        with harness.Fleet(build, logs, "--log-level", "WARNING", "--prefill-chunk", str(chunk), shards=[0, 1],
                           worker_args=("--threads", "1"), pin=True, prefix=f"fairness-chunk{chunk}-") as fleet:
            url = fleet.url
            run_users(url, 1, 8)  # warm-up
            results = [dict() for _ in range(4)]
            with httpx.Client(limits=httpx.Limits(max_connections=16)) as client:
                threads = [threading.Thread(target=user, args=(client, url, PROMPTS[i], 640, results[i]))
                           for i in range(3)]
                for t in threads:
                    t.start()
                time.sleep(1.5)
                arrived = time.perf_counter()
                user(client, url, LONG_PROMPT, 4, results[3])
                for t in threads:
                    t.join()
            window_end = results[3]["times"][0]
            gaps = [b - a for r in results[:3] for a, b in zip(r["times"], r["times"][1:])]
            during = [b - a for r in results[:3] for a, b in zip(r["times"], r["times"][1:])
                      if b >= arrived and a <= window_end]
            cell = {"prefill_chunk": chunk, "newcomer_ttft_ms": results[3]["ttft_ms"],
                    "decoder_gap_p50_ms": statistics.median(gaps) * 1000,
                    "decoder_max_gap_during_prefill_ms": max(during, default=0.0) * 1000}
            cells.append(cell)
            print(f"  fairness, --prefill-chunk {chunk}: newcomer TTFT {cell['newcomer_ttft_ms']:.0f} ms, decoders' "
                  f"median gap {cell['decoder_gap_p50_ms']:.0f} ms, longest gap while it prefills "
                  f"{cell['decoder_max_gap_during_prefill_ms']:.0f} ms", flush=True)
    return cells


def start_fleet(build: Path, stages: int, logs: Path, mode: str, tag: str = "interleave") -> harness.Fleet:
    """A fleet of ``build``: one pinned worker per stage (one inference thread, no mDNS) and an unpinned
    coordinator in ``mode`` (:data:`MODES`), no draft, warmed up with one short request. Raises
    ``RuntimeError``/``TimeoutError`` if a process exits or does not serve in time."""
    fleet = harness.Fleet(build, logs, "--log-level", "WARNING", *MODES[mode](stages), shards=range(stages),
                          worker_args=("--threads", "1"), pin=True,
                          prefix=f"{tag}-{stages}stage-{mode.replace(' ', '-')}-")
    try:
        clients.warm_up(fleet.url)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def fleet_cells(build: Path, stages: int, users_list: list[int], tokens: int, logs: Path, mode: str) -> list[dict]:
    """One fleet in ``mode``, its cells for each user count (:func:`bench.clients.run_users`)."""
    ncpu = os.cpu_count() or 1
    cells = []
    with start_fleet(build, stages, logs, mode) as fleet:
        url, processes = fleet.url, fleet.processes()
        for users in users_list:
            cell = {"stages": stages, "mode": mode, "pinning": [f"stage {s} -> core {s % ncpu}" for s in range(stages)],
                    **run_users(url, users, tokens, processes)}
            cells.append(cell)
            cpu = ", ".join(f"{name} {ms:.1f}" for name, ms in cell["cpu_ms_per_token"].items())
            print(f"  {stages}-stage {mode}, {users} users: {cell['aggregate_tok_s']:.1f} tok/s aggregate, "
                  f"{cell['per_user_tok_s']:.1f} per user, TTFT {cell['ttft_ms']:.0f} ms; CPU ms/token: {cpu}; "
                  f"cpu bound {cell['cpu_bound_tok_s']:.1f} tok/s", flush=True)
    return cells


def add_llama_cpp_options(parser: argparse.ArgumentParser) -> None:
    """The ``--llama-cpp`` comparison's options (bench/pipeline/llama_cpp.py runs it)."""
    parser.add_argument("--llama-cpp", action="store_true",
                        help="instead: the fleet against llama.cpp's RPC fleet on the same GGUF (the demo's Q4_1, or "
                        "--model FILE.gguf), 2 stages (bench/pipeline/llama_cpp.py; build llama.cpp with "
                        "bench/build_llama_cpp.sh)")
    parser.add_argument("--llama-cpp-bin", type=Path, metavar="DIR", default=None,
                        help="folder with llama-server and rpc-server (default: bench/build_llama_cpp.sh's)")
    parser.add_argument("--llama-cpp-single", action="store_true",
                        help="with --llama-cpp: also one llama-server process on both cores, no RPC")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="with --llama-cpp: runs per cell, the systems taking turns; medians and the median "
                        "paired ratio are kept")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options; ``users`` resolved to its default (1,2,4,8, or 1,2,4 with ``--llama-cpp``).
    Exits with argparse's usage error for a bad value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models.add_model_option(parser)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", type=positive_int, default=64)
    parser.add_argument("--users", type=counts,
                        help="concurrent users per cell (default 1,2,4,8; with --llama-cpp 1,2,4)")
    parser.add_argument("--stages", type=counts, help="fleet stage counts (default 1,2,3; a build: its own)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE)
    add_llama_cpp_options(parser)
    parser.add_argument("--modes", default=",".join(MODES), help="fleet modes to run")
    parser.add_argument("--no-fairness", action="store_true", help="skip the long-prompt fairness runs")
    parser.add_argument("--no-even", action="store_true", help="skip the 2-stage even-split runs (equal layer counts, e.g. 15+15)")
    args = parser.parse_args(argv)
    args.users = args.users or ([1, 2, 4] if args.llama_cpp else [1, 2, 4, 8])
    args.stages = models.stage_counts(args.model, args.stages, [1, 2, 3]) if args.model else args.stages or [1, 2, 3]
    try:
        if args.llama_cpp and args.model:
            models.require_gguf(args.model, "--llama-cpp")
        elif args.model:
            models.check_stages(args.model, args.stages)
    except models.ModelError as exc:
        parser.error(str(exc))
    return args


def run_fleets(model: models.Model, builds: dict[int, Path], args: argparse.Namespace, logs: Path) -> list[dict]:
    """Every fleet cell: each stage count in each mode, and (2 stages, from a source) the even split."""
    cells = []
    for stages in args.stages:
        for mode in args.modes.split(","):
            if mode:
                cells += fleet_cells(builds[stages], stages, args.users, args.tokens, logs, mode)
        if stages == 2 and not args.no_even and model.kind != "build":  # the split before the LM head counted
            layers = models.even_split(builds[2])
            even = harness.ensure_build(model.path, args.cache.resolve(), 2, layers)
            split = "+".join(str(int(b) - int(a)) for a, b in (r.split(":") for r in layers.split(",")))
            for cell in fleet_cells(even, 2, args.users, args.tokens, logs, "batch groups"):
                cells.append({**cell, "mode": f"batch groups, even split {split}"})
    return cells


def print_tables(base: dict | None, cells: list[dict], fairness: list[dict]) -> None:
    """The cells beside the baseline (its ratios left out without one), the fairness runs and the targets."""
    ref = base["decode_tok_s"] if base else None

    def times(x: float) -> str | None:
        return f"{x / ref:.2f}" if ref else None

    rows = [["whole model, 1 core", 1, f"{ref:.1f}", "1.00", f"{ref:.1f}", f"{base['ttft_ms']:.0f}", ""]] \
        if base else []
    rows += [[f"fleet {c['stages']}-stage, {c['mode']}", c["users"], f"{c['aggregate_tok_s']:.1f}",
              times(c["aggregate_tok_s"]), f"{c['per_user_tok_s']:.1f}", f"{c['ttft_ms']:.0f}",
              times(c["cpu_bound_tok_s"])] for c in cells]
    print("\n" + harness.table(["config", "users", "aggregate tok/s", "x baseline", "per-user tok/s", "TTFT ms",
                                 "cpu bound x"], rows, pad=True))
    if fairness:
        print("\n" + harness.table(
            ["2-stage, 3 decoding + 1 long prompt", "newcomer TTFT ms", "decoders median gap ms",
             "longest gap during its prefill ms"],
            [[f"--prefill-chunk {f['prefill_chunk']}", f"{f['newcomer_ttft_ms']:.0f}", f"{f['decoder_gap_p50_ms']:.0f}",
              f"{f['decoder_max_gap_during_prefill_ms']:.0f}"] for f in fairness], pad=True))
    for c in cells if ref else []:
        if c["stages"] == 2 and c["users"] in (2, 4):
            goal = 1.8 if c["users"] == 2 else 1.9
            print(f"target: 2 stages, {c['mode']}, {c['users']} users = {c['aggregate_tok_s'] / ref:.2f}x baseline "
                  f"(goal >= {goal}x; this machine's CPU bound for the cell: {c['cpu_bound_tok_s'] / ref:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    """Run the bench or, with ``--llama-cpp``, the comparison; prints the tables, writes ``--json``."""
    args = parse_args(argv)
    if args.llama_cpp:
        from bench.pipeline.llama_cpp import DEFAULT_BIN, binaries

        try:
            binaries(args.llama_cpp_bin or DEFAULT_BIN)
        except FileNotFoundError as exc:
            print(f"interleave_bench: {exc}", file=sys.stderr)
            return 2
    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.llama_cpp:
        from bench.pipeline.llama_cpp import compare

        gguf = args.model.path if args.model else harness.demo_gguf(models.from_args(None, cache).path)
        return compare(gguf, cache, args.users, args.tokens, args)
    model = models.from_args(args.model, cache)
    builds = models.builds(model, cache, args.stages, optional=(1,) if args.no_fairness else (1, 2))
    print(f"interleave bench: {model.name}, {args.tokens} tokens per user, users {args.users}, stages {args.stages}, "
          f"nproc {os.cpu_count()}", flush=True)
    base = baseline(builds[1], args.tokens) if 1 in builds else None
    if base:
        print(f"  whole model, 1 process, 1 core, 1 user: {base['decode_tok_s']:.1f} tok/s, "
              f"TTFT {base['ttft_ms']:.0f} ms", flush=True)
    else:
        print(f"  no whole-model baseline: {model.path} is a {model.stages}-stage build (it runs a 1-stage one)")
    cells = run_fleets(model, builds, args, logs)
    fairness = [] if args.no_fairness or 2 not in builds else fairness_cells(builds[2], logs)
    print_tables(base, cells, fairness)
    harness.write_json(args.json, "interleave_bench", {
        "model": model.name, "model_path": str(model.path), "model_kind": model.kind, "tokens": args.tokens,
        "baseline": base, "cells": cells, "fairness": fairness})
    return 0


if __name__ == "__main__":
    sys.exit(main())
