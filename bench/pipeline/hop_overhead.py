"""Where each token's CPU goes outside inference: per process of a pinned fleet, measured.

For every cell (stages x users) a fleet of the model (the demo by default) is started as ``interleave_bench`` starts one (each
worker pinned to its own core with one inference thread, the coordinator unpinned, ``--draft none``),
greedy streams of ``--tokens`` tokens run, and for each process the bench reports CPU ms per token
(user + system, ``psutil``) and, for workers, the part spent running chunks (the workers' own
``fleet_worker_infer_cpu_seconds``, read from ``--metrics-port``, by the thread that ran them: the
inference thread, or the event loop's for a small step while that one is idle; with one inference
thread OpenVINO infers on the calling thread, so that thread's CPU time is infer's). ``overhead`` =
CPU - infer: what an extra stage costs beyond its layers.

Each cell also splits every process's CPU by thread (/proc/PID/task: the event loop and the inference
thread, each inside and outside ``run_chunk``, and gRPC's I/O threads). With ``--profile`` one more 1-user run per fleet is sampled
by py-spy (Python frames, every thread, idle ones left out) and each sample is put in one category by the
innermost frame it recognises (:data:`CATEGORIES`): gRPC, protobuf, numpy, the inference call,
asyncio, thread hand-offs, HTTP, tokenizer, sampling, logging, other Python. The table gives each
category's share of the process's measured CPU per token, in ms.

    python bench/pipeline/hop_overhead.py [--model PATH] [--stages 2,3] [--users 1,2,4] [--tokens 128] [--json PATH] [--profile]

The baseline is ``interleave_bench.baseline``: the whole model in one process on one core (a 1-stage build).
``--model PATH`` (bench/models.py): a GGUF file or an HF folder, built into ``--cache`` per stage count (and 1
for the baseline), or a fleet build used as it is (``--stages`` then defaults to its own count; without a
1-stage build there is no baseline, and the tables leave its ratio out).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench import clients, harness, models
from bench.clients import run_users
from bench.pipeline.interleave_bench import baseline
from bench.models import counts, positive_int
from coordinator.fleet.local import free_port

# (category, regex on one frame); the innermost frame of a sample that matches any decides it
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("infer", r"\binfer\b.*(openvino|runtime\.py)|ov::|InferRequest|dnnl|jit_|ov_cpu|libopenvino"),
    ("protobuf", r"google/protobuf|upb_|_message\.|protobuf"),
    ("gRPC", r"grpc|cygrpc|_cython|completion_queue|libgrpc|chttp2|absl"),
    ("numpy", r"numpy|_multiarray|np\.|PyArray|wire\.py"),
    ("thread hand-off", r"concurrent/futures|threading\.py|run_in_executor|futex|pthread_cond"),
    ("HTTP", r"uvicorn|starlette|fastapi|h11|sse_starlette|httptools|anyio"),
    ("tokenizer", r"tokenizers|tokenizer\.py|detok"),
    ("sampling", r"sampling\.py|speculative\.py"),
    ("logging", r"logging/"),
    ("asyncio", r"asyncio/|selectors\.py|epoll|uvloop"),
)


def categorise(stack: str) -> str:
    """The category of one collapsed py-spy stack (frames outermost first, ``;``-separated)."""
    for frame in reversed(stack.split(";")):
        for name, pattern in CATEGORIES:
            if re.search(pattern, frame):
                return name
    return "other Python"


def profile(pids: dict[str, int], seconds: float, out: Path) -> dict[str, subprocess.Popen]:
    """Start py-spy on each process for ``seconds`` (raw collapsed stacks into ``out/NAME.txt``)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = {}
    for name, pid in pids.items():
        procs[name] = subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--nonblocking", "--rate", "250", "--format", "raw",
             "--duration", str(int(seconds)), "--output", str(out / f"{name.replace(' ', '_')}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return procs


def breakdown(path: Path) -> dict[str, float]:
    """Fractions of a process's samples per category, from py-spy's raw output at ``path``."""
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            totals[categorise(stack)] += int(count)
    n = sum(totals.values()) or 1
    return {name: totals[name] / n for name in [c for c, _ in CATEGORIES] + ["other Python"]}


TICK = os.sysconf("SC_CLK_TCK")


def thread_seconds(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of each thread of ``pid``, by (thread id, name), from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def by_thread(pid: int, before: dict, after: dict, per_token: int) -> dict[str, float]:
    """ms per token of a process's threads, grouped: the event loop (the main thread: gRPC's Python side,
    protobuf, asyncio, the step's own code, and small steps' chunks), gRPC's I/O threads
    (``event_engine``), a worker's inference thread (``stageN-infer``, its one-thread executor) and the
    rest (gRPC's completion-queue poller among them: an unnamed native thread)."""
    delta = {key: (after[key] - before.get(key, 0.0)) * 1000 / per_token for key in after}
    groups = {"event loop": 0.0, "gRPC I/O threads": 0.0, "inference thread": 0.0, "other threads": 0.0}
    for (tid, name), ms in delta.items():
        if tid == pid:
            groups["event loop"] += ms
        elif name.startswith("event_engine") or name.startswith("grpc"):
            groups["gRPC I/O threads"] += ms
        elif name.startswith("stage") and "infer" in name:
            groups["inference thread"] += ms
        else:
            groups["other threads"] += ms
    return groups


def infer_seconds(metrics_url: str) -> dict[str, float]:
    """``fleet_worker_infer_cpu_seconds_total`` of a worker's /metrics by the thread that ran the chunks
    (``inference``, ``event_loop``; a worker older than the label: all ``inference``; older than the
    metric: its infer wall time, ``fleet_worker_infer_seconds_sum``)."""
    text = httpx.get(metrics_url, timeout=10).text
    found = {thread: float(v) for thread, v in re.findall(
        r'^fleet_worker_infer_cpu_seconds_total\{thread="(\w+)"\} (\S+)$', text, re.M)}
    if found:
        return found
    m = re.search(r"^fleet_worker_infer_cpu_seconds_total (\S+)$", text, re.M) or re.search(
        r"^fleet_worker_infer_seconds_sum (\S+)$", text, re.M)
    return {"inference": float(m.group(1))}


def start_fleet(build: Path, stages: int, logs: Path) -> tuple[harness.Fleet, list[str]]:
    """Pinned workers (one inference thread each, metrics on) and a coordinator (batch groups, no draft),
    warmed up; returns the fleet and the workers' metrics URLs."""
    mports = [free_port() for _ in range(stages)]
    fleet = harness.Fleet(build, logs, "--log-level", "WARNING", shards=range(stages), pin=True,
                          worker_args=lambda i: ("--threads", "1", "--metrics-port", str(mports[i])),
                          prefix=f"hop-{stages}stage-")
    try:
        clients.warm_up(fleet.url)
    except BaseException:
        fleet.stop()
        raise
    return fleet, [f"http://127.0.0.1:{p}/metrics" for p in mports]


def measure(url: str, procs: dict, metrics: list[str], users: int, tokens: int) -> dict:
    """One cell: ``run_users`` plus each worker's infer ms per token and overhead (CPU - infer)."""
    before = [infer_seconds(m) for m in metrics]
    threads_before = {name: thread_seconds(p.pid) for name, p in procs.items()}
    cell = run_users(url, users, tokens, procs)
    threads_after = {name: thread_seconds(p.pid) for name, p in procs.items()}
    after = [infer_seconds(m) for m in metrics]
    per_token = users * tokens
    cell["threads_ms_per_token"] = {name: by_thread(p.pid, threads_before[name], threads_after[name], per_token)
                                    for name, p in procs.items()}
    by_runner = [{t: (a.get(t, 0.0) - b.get(t, 0.0)) * 1000 / per_token for t in ("inference", "event_loop")}
                 for a, b in zip(after, before)]
    cell["infer_ms_per_token_by_thread"] = {f"worker {i}": ms for i, ms in enumerate(by_runner)}
    cell["infer_ms_per_token"] = {f"worker {i}": sum(ms.values()) for i, ms in enumerate(by_runner)}
    cell["overhead_ms_per_token"] = {name: cell["cpu_ms_per_token"][name] - cell["infer_ms_per_token"].get(name, 0.0)
                                     for name in cell["cpu_ms_per_token"]}
    del cell["answers"]
    return cell


def profiled(url: str, procs: dict, tokens: int, out: Path) -> dict[str, dict[str, float]]:
    """A 1-user run sampled by py-spy: ms per token per category for each process (fractions of its
    samples times its measured CPU ms per token)."""
    out.mkdir(parents=True, exist_ok=True)
    rate = run_users(url, 1, 16, procs)["aggregate_tok_s"]  # how long the profiled run will take
    seconds = max(5, int(tokens / rate) + 1)
    spies = profile({name: p.pid for name, p in procs.items()}, seconds + 2, out)
    time.sleep(1.0)  # py-spy attached
    cpu = run_users(url, 1, tokens, procs)["cpu_ms_per_token"]
    for spy in spies.values():
        spy.wait(timeout=seconds + 60)
    result = {}
    for name in procs:
        fractions = breakdown(out / f"{name.replace(' ', '_')}.txt")
        result[name] = {cat: share * cpu[name] for cat, share in fractions.items()}
    return result


def both_cores(build: Path, tokens: int) -> list[float]:
    """Decode tok/s of the whole model on every core at once, one process per core (``baseline``'s):
    what the cores give together when all are busy (they share caches and memory bandwidth)."""
    cores = range(os.cpu_count() or 1)
    with ThreadPoolExecutor(len(cores)) as pool:
        return [r["decode_tok_s"] for r in pool.map(lambda core: baseline(build, tokens, core), cores)]


def print_baseline(base: dict | None) -> float | None:
    """The whole model's lines (or why there is none); returns its tok/s."""
    if base is None:
        print("\nno whole-model baseline: the build folder has no 1-stage build (give a GGUF or HF folder to make one)")
        return None
    ref = base["decode_tok_s"]
    print(f"\nwhole model, 1 process, 1 core: {ref:.1f} tok/s = {1000 / ref:.1f} ms per token (mean of a run before "
          f"and after the fleets: {base['before']:.1f}, {base['after']:.1f}; the machine's load drifts)")
    both = base.get("both_cores_tok_s", [])
    print(f"whole model on each of the {len(both)} cores at once: " + " + ".join(f"{r:.1f}" for r in both)
          + f" = {sum(both):.1f} tok/s ({sum(both) / ref:.2f}x one alone: the most users on separate cores can get here)")
    return ref


def thread_table(c: dict) -> str:
    """A 1-user cell's CPU ms per token by thread group and process, the chunk-running threads split into
    ``run_chunk`` (the worker's own infer CPU) and the rest, and the overhead (all but ``run_chunk``)."""
    names = [n for n in c["threads_ms_per_token"] if n != "client"]
    split = {"event loop": "event_loop", "inference thread": "inference"}  # threads that run chunks
    rows = []
    for group in next(iter(c["threads_ms_per_token"].values())):
        spent = [c["threads_ms_per_token"][n][group] for n in names]
        if group in split:
            infer = [c.get("infer_ms_per_token_by_thread", {}).get(n, {}).get(split[group], 0.0) for n in names]
            rows += [[f"{group}: run_chunk", *(f"{v:.2f}" for v in infer)],
                     [f"{group}: the rest", *(f"{v - i:.2f}" for v, i in zip(spent, infer))]]
        else:
            rows.append([group, *(f"{v:.2f}" for v in spent)])
    rows.append(["overhead (all but run_chunk)", *(f"{c['overhead_ms_per_token'][n]:.2f}" for n in names)])
    return harness.table(["thread", *names], rows, pad=True)


def print_tables(base: dict | None, cells: list[dict], profiles: dict) -> None:
    """The baseline, every cell's CPU per process, the 1-user cells by thread and the py-spy breakdowns."""
    ref = print_baseline(base)
    rows = []
    for c in cells:
        parts = [f"{name} {ms:.1f}" + (f" ({infer:.1f} + {ms - infer:.1f})" if infer is not None else "")
                 for name, ms in c["cpu_ms_per_token"].items() for infer in [c["infer_ms_per_token"].get(name)]]
        rows.append([f"{c['stages']}-stage", c["users"], f"{c['aggregate_tok_s']:.1f}",
                     f"{c['aggregate_tok_s'] / ref:.2f}" if ref else None, ", ".join(parts)])
    print(harness.table(["fleet", "users", "tok/s", "x whole", "CPU ms per token (infer + overhead)"], rows, pad=True))
    for c in cells:
        if c["users"] == 1:
            print(f"\n{c['stages']}-stage fleet, 1 user, CPU ms per token by thread (/proc, measured)")
            print(thread_table(c))
    for stages, prof in profiles.items():
        names = list(prof)
        print(f"\n{stages}-stage fleet, 1 user, CPU ms per token by category (py-spy samples x measured CPU)")
        rows = [[cat, *(f"{prof[n][cat]:.2f}" for n in names)] for cat in [c for c, _ in CATEGORIES] + ["other Python"]]
        rows.append(["total", *(f"{sum(prof[n].values()):.2f}" for n in names)])
        print(harness.table(["category", *names], rows, pad=True))


def main(argv: list[str] | None = None) -> int:
    """Measure every cell (module docstring); prints the tables, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models.add_model_option(parser)
    parser.add_argument("--stages", type=counts, help="fleet stage counts (default 2,3; a build: its own)")
    parser.add_argument("--users", type=counts, default=[1, 2, 4])
    parser.add_argument("--tokens", type=positive_int, default=128)
    parser.add_argument("--cache", type=Path, default=harness.CACHE)
    parser.add_argument("--profile", dest="do_profile", action="store_true",
                        help="also sample each process with py-spy (Python frames) for a breakdown by category")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.stages = models.stage_counts(args.model, args.stages, [2, 3]) if args.model else args.stages or [2, 3]
    try:
        if args.model:
            models.check_stages(args.model, args.stages)
    except models.ModelError as exc:
        parser.error(str(exc))
    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = models.from_args(args.model, cache)
    builds = models.builds(model, cache, args.stages, optional=(1,))
    first = baseline(builds[1], args.tokens) if 1 in builds else None
    both = both_cores(builds[1], args.tokens) if 1 in builds else []
    cells, profiles = [], {}
    for stages in args.stages:
        fleet, metrics = start_fleet(builds[stages], stages, logs)
        with fleet:
            url, procs = fleet.url, fleet.processes()
            for users in args.users:
                cell = {"stages": stages, **measure(url, procs, metrics, users, args.tokens)}
                cells.append(cell)
                print(f"  {stages}-stage, {users} users: {cell['aggregate_tok_s']:.1f} tok/s; CPU ms/token "
                      + ", ".join(f"{n} {ms:.2f}" for n, ms in cell["cpu_ms_per_token"].items())
                      + "; overhead " + ", ".join(f"{n} {ms:.2f}" for n, ms in cell["overhead_ms_per_token"].items()),
                      flush=True)
            if args.do_profile:
                profiles[stages] = profiled(url, procs, args.tokens * 2, logs / f"hop-profile-{stages}stage")
    last = baseline(builds[1], args.tokens) if first else None
    base = {"decode_tok_s": (first["decode_tok_s"] + last["decode_tok_s"]) / 2, "before": first["decode_tok_s"],
            "after": last["decode_tok_s"], "both_cores_tok_s": both} if first and last else None
    print_tables(base, cells, profiles)
    harness.write_json(args.json, "hop_overhead", {
        "model": model.name, "model_path": str(model.path), "model_kind": model.kind, "tokens": args.tokens,
        "baseline": base, "cells": cells, "profiles": {str(k): v for k, v in profiles.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
