"""One process, one model, per weight type: fleet's 1-stage IR beside llama.cpp on the same GGUF, decode tok/s and
a 512-token prefill's tok/s and peak RSS at 1 and 2 threads, table + JSON; with ``--profile``, OpenVINO's per-op profile (``PERF_COUNT``) of each
fleet build, the decode step's time by op type and by matrix role (q, k, v, o, gate, up, down, head).

The GGUFs are random-weight files of a real model's dimensions (``bench/real_gguf.py``: F16 by gguf-py, every other
type by ``llama-quantize``), or ``--model PATH`` (any GGUF). Per type:

* fleet: ``fleet-compiler build FILE.gguf --shards 1`` (blocks kept as compiler/gguf.py keeps them; ``int8`` and
  ``int4`` are ``--weights int8|int4`` builds of the F16 file), run in its own process pinned to cores
  ``0..T-1`` with ``INFERENCE_NUM_THREADS=T``, compiled and loaded as a worker does (``compile_config``: "auto"
  precision, f32 activations for compressed weights; ``--also-precision bf16,f32`` adds the worker's other
  settings, f32 being the exact one, with the plugin's int8 activations off): a prompt of ``--prompt`` tokens prefilled, then ``--tokens``
  greedy steps, three times; the cell is the median decode tok/s. Peak RSS is the process's VmHWM.
* llama.cpp: ``llama-bench -m FILE -p 0 -n TOKENS -t T -r 3`` (its mean over 3 runs, from an empty context:
  its ``-d`` crashes this build; the same core pinning), and its peak RSS: VmHWM polled while it runs (it
  memory-maps the file, as our worker maps its ``.bin``).

Both sides run one after the other per cell, ``--rounds`` times (3), the order swapped each round, so load from
elsewhere hits them alike; the ratio is the median of the rounds' fleet ÷ llama.cpp (with its range). On a machine
shared with other work, ``--realtime`` (root) runs the cells at SCHED_FIFO priority, so that nothing else preempts
them on their cores (memory bandwidth is still shared).

    python bench/kernels/kernel_bench.py [--model llama-3.2-1b | --model FILE.gguf] [--layers N] [--rounds 3] [--realtime]
                                 [--types Q4_0,Q4_K_M,...] [--threads 1,2] [--tokens 48] [--profile] [--json PATH]
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

from bench import harness, real_gguf

TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "int8", "int4")
NNCF = {"int8": "int8", "int4": "int4"}  # built from the F16 file with --weights
ROLES = {"/offset/": "offsets (Q4_K, Q4_1)", "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
         "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "lm_head": "head", "embed_tokens": "head"}
# compiler/export.py name_products names each MatMul after its weight: model.layers.3.mlp.down_proj.weight/matmul


def ensure_build(gguf: Path, weights: str | None, cache: Path) -> Path:
    """``fleet-compiler build GGUF --shards 1 [--weights W]`` into ``cache``, once per compiler version
    (``harness.ensure_build``)."""
    return harness.ensure_build(gguf, cache, 1, options=("--weights", weights) if weights else ())


PREFILL = 512  # the prefill column's prompt (tokens)
FLEET_RUN = r"""
import json, os, sys, time
import numpy as np, openvino as ov
build, threads, tokens, prompt, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
precision, PREFILL = sys.argv[6], int(sys.argv[7])
from fleet_common.residency import resident_mib, settle
from fleet_common.manifest import load_manifest
from fleet_common.runtime import compile_config, kernels_at, runs_compressed, stage_core
os.sched_setaffinity(0, set(range(threads)))
entry = load_manifest(build).manifest.stages[0]
config = compile_config(threads, precision, runs_compressed("CPU", entry))  # as a worker compiles it
if profile:
    config["PERF_COUNT"] = True
core = stage_core()
model = core.read_model(build + "/stage_0/openvino_model.xml")
compiled = core.compile_model(kernels_at(model, "f32") if precision == "f32" else model, "CPU", config)
one = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 1), np.int64),
       "position_ids": np.zeros((1, 1), np.int64), "beam_idx": np.zeros(1, np.int32), "logits_index": np.zeros(1, np.int64)}
if entry.kernels:  # as a worker loads: fleet's kernels read the mapped .bin, nothing is repacked or given back
    compiled.create_infer_request().infer(one)
else:
    settle(lambda: compiled.create_infer_request().infer(one), [build + "/stage_0/openvino_model.bin"])
req = compiled.create_infer_request()
rng = np.random.default_rng(0)
prefill_s = []
for run in range(2):  # a prompt of PREFILL tokens in one chunk
    req.reset_state()
    ids = rng.integers(0, 49152, (1, PREFILL))
    t0 = time.perf_counter()
    req.infer({"input_ids": ids, "attention_mask": np.ones((1, PREFILL), np.int64),
               "position_ids": np.arange(PREFILL, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32),
               "logits_index": np.array([PREFILL - 1], np.int64)})
    prefill_s.append(time.perf_counter() - t0)
rates, ops = [], {}
for run in range(3):
    req.reset_state()
    chunk, past, out = list(rng.integers(0, 49152, prompt)), 0, []
    while len(out) < tokens:
        seq = len(chunk)
        logits = req.infer({"input_ids": np.array([chunk], dtype=np.int64),
            "attention_mask": np.ones((1, past + seq), dtype=np.int64),
            "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32), "logits_index": np.array([seq - 1], dtype=np.int64)})[0]
        out.append(int(logits[0, -1].argmax()))
        if past == 0:
            first = time.perf_counter()
        elif profile and run == 2:
            for p in req.profiling_info:
                key = (p.node_type, p.exec_type, p.node_name)
                ops[key] = ops.get(key, 0.0) + p.real_time.total_seconds()
        chunk, past = out[-1:], past + seq
    rates.append((len(out) - 1) / (time.perf_counter() - first))
mib = resident_mib()
steps = tokens - 1
print(json.dumps({"tok_s": sorted(rates)[1], "runs": rates, "prefill_tok_s": PREFILL / min(prefill_s), "peak_rss_mib": mib["VmHWM"], "rss_mib": mib["VmRSS"],
                  "anon_mib": mib["RssAnon"], "file_mib": mib["RssFile"],
                  "ops": [[t, e, n, s * 1000 / steps] for (t, e, n), s in ops.items()]}))
"""


def fleet_cell(build: Path, threads: int, tokens: int, prompt: int, profile: bool, precision: str = "auto") -> dict:
    """Decode tok/s, memory and (``profile``) per-op ms per step of ``build`` in its own process, loaded as a
    worker loads it (fleet_common/residency.py: the weights repacked at load, the mapped .bin given back)."""
    run = subprocess.run([sys.executable, "-c", FLEET_RUN, str(build), str(threads), str(tokens), str(prompt),
                          "1" if profile else "0", precision, str(PREFILL)], capture_output=True, text=True, cwd=harness.ROOT,
                         env=harness.repo_env())
    if run.returncode:
        raise RuntimeError(f"fleet run of {build} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def poll_peak(proc: subprocess.Popen, peak: list[float]) -> None:
    """Keep ``peak[0]`` at the largest VmHWM (MiB) seen of ``proc`` while it runs (every 50 ms)."""
    while proc.poll() is None:
        status = harness.proc_status(proc.pid)
        if not status:
            return
        peak[0] = max(peak[0], status.get("VmHWM", 0) / (1 << 20))
        time.sleep(0.05)


def llama_cell(gguf: Path, threads: int, tokens: int) -> dict:
    """llama-bench's decode tok/s (``tg`` of ``tokens`` from an empty context), its prefill tok/s (``pp`` of
    ``PREFILL`` tokens) and its peak RSS."""
    cmd = ["taskset", "-c", ",".join(map(str, range(threads))), str(harness.llama_cpp_tool("llama-bench")),
           "-m", str(gguf), "-p", str(PREFILL), "-n", str(tokens), "-t", str(threads), "-r", "3", "-o", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]
    poller = threading.Thread(target=poll_peak, args=(proc, peak), daemon=True)
    poller.start()
    out, err = proc.communicate()
    poller.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    rows = [r for r in json.loads(out) if r.get("n_gen")]
    prefill = [r for r in json.loads(out) if r.get("n_prompt") and not r.get("n_gen")]
    return {"tok_s": rows[0]["avg_ts"], "stddev": rows[0]["stddev_ts"], "prefill_tok_s": prefill[0]["avg_ts"],
            "peak_rss_mib": peak[0], "command": cmd}


def paired_cells(build: Path, gguf: Path | None, threads: int, args: argparse.Namespace) -> dict:
    """fleet's cell (and its ``--also-precision`` ones) beside llama.cpp's (``gguf``; None: none), ``args.rounds``
    times, the order of the two swapped every round so that load from elsewhere hits them alike. Each side's
    tok/s is its median over rounds (``rounds_tok_s``: every round's); ``ratio`` is the median of the rounds'
    fleet ÷ llama.cpp, ``ratio_range`` their smallest and largest."""
    runs: dict[str, list[dict]] = {}
    if args.realtime:  # the cells' processes inherit it (not the builds: their threads spin-wait on each other)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    for r in range(args.rounds):
        sides = [("fleet", "auto"), *((f"fleet_{p}", p) for p in args.also_precision)]
        if gguf is not None:
            sides = sides[::-1] + [("llama_cpp", None)] if r % 2 else [("llama_cpp", None), *sides]
        for key, precision in sides:
            cell = llama_cell(gguf, threads, args.tokens) if precision is None else \
                fleet_cell(build, threads, args.tokens, args.prompt, False, precision)
            runs.setdefault(key, []).append({k: v for k, v in cell.items() if k != "ops"})
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    out = {}
    for key, cells in runs.items():
        rates = [c["tok_s"] for c in cells]
        out[key] = {**sorted(cells, key=lambda c: c["tok_s"])[(len(cells) - 1) // 2], "rounds_tok_s": rates,
                    "peak_rss_mib": max(c["peak_rss_mib"] for c in cells)}
    if gguf is not None:
        ratios = sorted(f["tok_s"] / l["tok_s"] for f, l in zip(runs["fleet"], runs["llama_cpp"]))
        out["ratio"], out["ratio_range"] = statistics.median(ratios), [ratios[0], ratios[-1]]
        out["prefill_ratio"] = statistics.median(f["prefill_tok_s"] / l["prefill_tok_s"]
                                                 for f, l in zip(runs["fleet"], runs["llama_cpp"]))
    return out


def role(name: str) -> str:
    """The matrix role (q, k, ..., head) an FC node's name names (``q+k+v`` for one op of several), or ``other``."""
    return "+".join(r for key, r in ROLES.items() if key in name) or "other"


def profile_summary(ops: list) -> dict:
    """ms per decode step by op type and, for FullyConnected, by matrix role; the FC kernels' exec types."""
    by_type, by_role, execs = {}, {}, {}
    for node_type, exec_type, name, ms in ops:
        by_type[node_type] = by_type.get(node_type, 0.0) + ms
        if node_type.startswith("FullyConnected"):
            r = role(name)
            by_role[r] = by_role.get(r, 0.0) + ms
            execs[exec_type] = execs.get(exec_type, 0) + 1
    top = dict(sorted(by_type.items(), key=lambda kv: -kv[1])[:8])
    return {"total_ms": sum(by_type.values()), "by_type_ms": top, "fc_by_role_ms": by_role, "fc_exec_types": execs}


def ratio_cell(row: dict, key: str) -> str:
    """fleet ÷ llama.cpp: the median of the rounds' ratios with their range (``key`` "fleet"), else of the medians."""
    if key == "fleet" and "ratio" in row:
        low, high = row["ratio_range"]
        return f"{row['ratio']:.2f} ({low:.2f}-{high:.2f})" if low != high else f"{row['ratio']:.2f}"
    return f"{row[key]['tok_s'] / row['llama_cpp']['tok_s']:.2f}"


def prefill_ratio_cell(row: dict, key: str) -> str:
    """Prefill fleet ÷ llama.cpp: the median of the rounds' ratios (``key`` "fleet"), else of the cells shown."""
    if key == "fleet" and "prefill_ratio" in row:
        return f"{row['prefill_ratio']:.2f}"
    return f"{row[key]['prefill_tok_s'] / row['llama_cpp']['prefill_tok_s']:.2f}"


def table(rows: list[dict]) -> str:
    """One line per type and thread count (and fleet's other precisions, ``fleet_<hint>``)."""
    out = []
    for r in rows:
        l = r.get("llama_cpp") or {}
        for key in [k for k in r if k == "fleet" or k.startswith("fleet_")]:
            f = r[key]
            out.append([r["type"], r["threads"], key.partition("_")[2] or "default", f"{f['tok_s']:.1f}",
                        f"{l.get('tok_s', float('nan')):.1f}", ratio_cell(r, key) if l else "–",
                        f"{f['prefill_tok_s']:.1f}", f"{l.get('prefill_tok_s', float('nan')):.1f}",
                        prefill_ratio_cell(r, key) if l else "–",
                        f"{f['peak_rss_mib']:.0f} ({f['anon_mib']:.0f} + {f['file_mib']:.0f})",
                        f"{l.get('peak_rss_mib', float('nan')):.0f}",
                        f"{f['peak_rss_mib'] / l['peak_rss_mib']:.2f}" if l else "–", f"{r['bin_mb']:.0f}"])
    return harness.table(["type", "threads", "fleet", "tok/s", "llama.cpp tok/s", "fleet ÷ llama.cpp",
                          f"prefill {PREFILL} tok/s", "llama.cpp prefill tok/s", "prefill ÷",
                          "fleet peak RSS MiB (anon + file)", "llama.cpp peak RSS MiB", "RSS ÷", "stage bin MB"], out)


def profile_lines(rows: list[dict]) -> str:
    """Each profiled row's ms per step by op type and by matrix role, and its FullyConnected kernels."""
    out = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        roles = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["fc_by_role_ms"].items(), key=lambda kv: -kv[1]))
        types = ", ".join(f"{k} {v:.1f}" for k, v in p["by_type_ms"].items())
        out.append(f"{r['type']} ({r['threads']} thr): {p['total_ms']:.1f} ms/step; by op: {types}; FC by role: "
                   f"{roles}; FC kernels: {p['fc_exec_types']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Every type and thread count, fleet beside llama.cpp (module docstring); prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b", help=f"a real_gguf shape ({', '.join(real_gguf.SHAPES)}) "
                        "or a GGUF file (then --types is that file's own type)")
    parser.add_argument("--layers", type=int, help="layer count of a real_gguf shape (default: the model's)")
    parser.add_argument("--types", default="Q4_K_M,Q4_0", help=f"comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=8, help="context tokens before the timed decode")
    parser.add_argument("--profile", action="store_true", help="also PERF_COUNT each fleet build (1 thread)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--also-precision", default="", type=lambda t: [p for p in t.split(",") if p],
                        help="also run fleet at these --inference-precision settings (bf16, f32; default: auto)")
    parser.add_argument("--rounds", type=int, default=3, help="fleet/llama.cpp pairs per cell, order swapped "
                        "each round; the ratio is the median of the rounds'")
    parser.add_argument("--realtime", action="store_true", help="run the cells at SCHED_FIFO priority (root): "
                        "other processes on the pinned cores no longer preempt them")
    parser.add_argument("--cache", type=Path, default=real_gguf.CACHE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]

    files = {}
    if Path(args.model).is_file():
        files[Path(args.model).stem] = (Path(args.model), None)
    else:
        for t in args.types.split(","):
            if t not in TYPES:
                parser.error(f"unknown type {t!r}; known: {', '.join(TYPES)}")
            gguf = real_gguf.ensure(args.model, "F16" if t in NNCF else t, args.layers, args.cache)
            files[t] = (gguf, NNCF.get(t))
    rows = []
    for t, (gguf, weights) in files.items():
        build = ensure_build(gguf, weights, args.cache / "builds")
        bin_mb = sum(p.stat().st_size for p in build.glob("stage_*/*.bin")) / 1e6
        for n in threads:
            row = {"type": t, "threads": n, "gguf": str(gguf), "build": str(build), "bin_mb": bin_mb,
                   "gguf_mb": gguf.stat().st_size / 1e6}
            llama = not args.no_llama_cpp and weights is None
            row.update(paired_cells(build, gguf if llama else None, n, args))
            if args.profile and n == 1:
                row["profile"] = profile_summary(fleet_cell(build, 1, min(args.tokens, 21), args.prompt, True)["ops"])
            rows.append(row)
            print("\n".join(table(rows[-1:]).splitlines()[2:]), flush=True)
    print(f"\nkernel bench: {args.model}, {args.tokens} greedy tokens after {args.prompt}, nproc {os.cpu_count()}")
    print(table(rows))
    if args.profile:
        print("\nper-op profile, ms per decode step:\n" + profile_lines(rows))
    harness.write_json(args.json, "kernel_bench", {"model": args.model, "tokens": args.tokens, "prompt": args.prompt,
                                                   "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
