"""Worker cold start: process start -> "serving on" with a pre-compiled blob vs the IR compiled vs the IR
imported from OpenVINO's model cache, per stage, several runs each (medians).

The build is hard-linked into a temporary folder (the original is never written) and pre-compiled there
for the workers' settings (``fleet-compiler precompile``); the model cache is a fresh folder, filled by
one untimed start. Each timed run starts ``fleet-worker`` (``--no-announce``: no mDNS records from a
benchmark) and stops it by its pid once it logs "serving on"; the modes take turns run by run, so load
from other processes hits them alike. ``load s`` is the import/compile time the worker reports (Info
RPC ``load_s``), ``peak RSS`` its VmHWM when ready. Files are in the page cache for every mode (the
blob was just written, the IR just read): this measures compile/import, not the disk.

    python bench/builds/cold_start.py --model BUILD [--runs 5] [--threads 1] [--inference-precision f32] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench import harness
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest

MODES = {  # mode -> fleet-worker flags (the cache folder is appended for model-cache)
    "ir": ["--no-blobs", "--no-model-cache"],
    "model-cache": ["--no-blobs"],
    "blob": ["--no-model-cache"],
}


def start_once(build: Path, stage: int, flags: list[str], log: Path) -> dict:
    """Start one worker, time it to "serving on", ask its Info, stop it; one result row."""
    cmd = [*harness.tool("fleet-worker"), "--shard", str(stage), "--model", str(build), "--no-announce", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=harness.repo_env())
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving on ([\d.]+:\d+)", line):
                ready_s = time.perf_counter() - t0
                break
        else:
            raise RuntimeError(f"worker exited ({proc.wait()}):\n{''.join(lines)[-2000:]}")
        rss = harness.proc_status(proc.pid).get("VmHWM", float("nan")) / (1 << 20)
        with grpc.insecure_channel(m.group(1)) as channel:
            info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        log.write_text("".join(lines) + (rest or ""))
    return {"ready_s": ready_s, "load_s": info.load_s, "source": info.load_source, "peak_rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    """Time every mode's cold starts per stage (module docstring); prints the medians, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a fleet-compiler build (not modified)")
    parser.add_argument("--runs", type=int, default=5, help="timed starts per mode and stage")
    parser.add_argument("--threads", type=int, default=0, help="the workers' --threads (blobs are made for it)")
    parser.add_argument("--inference-precision", default="auto", choices=["auto", "f32", "bf16", "f16"])
    parser.add_argument("--stage", type=int, action="append", help="only this stage (repeatable; default all)")
    parser.add_argument("--json", type=Path, help="write every run and the medians here")
    args = parser.parse_args(argv)

    stages = args.stage or list(range(load_manifest(args.model).manifest.num_stages))
    settings = ["--threads", str(args.threads), "--inference-precision", args.inference_precision]
    with tempfile.TemporaryDirectory(prefix="fleet-cold-start-") as tmp:
        work = Path(tmp)
        build = work / "build"
        shutil.copytree(args.model, build, copy_function=os.link)
        (build / "manifest.json").unlink()
        shutil.copy2(args.model / "manifest.json", build / "manifest.json")
        t0 = time.perf_counter()
        subprocess.run([*harness.tool("fleet-compiler"), "precompile", str(build), *settings], check=True,
                       capture_output=True, env=harness.repo_env())
        precompile_s = time.perf_counter() - t0
        cache = work / "cache"
        flags = {mode: [*f, *settings, *(["--cache-dir", str(cache)] if mode == "model-cache" else [])]
                 for mode, f in MODES.items()}
        fill = {s: start_once(build, s, flags["model-cache"], work / f"fill{s}.log") for s in stages}
        runs = []
        for i in range(args.runs):
            for stage in stages:
                for mode in MODES:
                    row = start_once(build, stage, flags[mode], work / f"{mode}{stage}-{i}.log")
                    if row["source"] != mode:
                        raise RuntimeError(f"{mode} run loaded from {row['source']}: see {work}")
                    runs.append({"mode": mode, "stage": stage, "run": i, **row})
                    print(f"  stage {stage} {mode:<11} ready {row['ready_s']:.2f} s (load {row['load_s']:.2f} s)",
                          flush=True)

    cells = []
    for stage in stages:
        for mode in MODES:
            rows = [r for r in runs if r["stage"] == stage and r["mode"] == mode]
            cells.append({"stage": stage, "mode": mode, "runs": len(rows),
                          **{k: statistics.median(r[k] for r in rows) for k in ("ready_s", "load_s", "peak_rss_mb")},
                          "ready_min_s": min(r["ready_s"] for r in rows),
                          "ready_max_s": max(r["ready_s"] for r in rows)})
    print(f"\nworker cold start, {args.model.name}, --threads {args.threads} --inference-precision "
          f"{args.inference_precision}, median of {args.runs} runs (process start -> 'serving on')")
    print(harness.table(["stage", "mode", "ready s", "min-max s", "load s", "peak RSS MB"],
                        [[c["stage"], c["mode"], f"{c['ready_s']:.2f}",
                          f"{c['ready_min_s']:.2f}-{c['ready_max_s']:.2f}", f"{c['load_s']:.2f}",
                          f"{c['peak_rss_mb']:.0f}"] for c in cells], pad=True))
    print(f"(precompile of {len(stages)} stage(s): {precompile_s:.1f} s; first start writing the model cache: "
          + ", ".join(f"stage {s} {fill[s]['ready_s']:.2f} s (load {fill[s]['load_s']:.2f} s)" for s in stages) + ")")
    harness.write_json(args.json, "cold_start", {
        "model": str(args.model), "threads": args.threads, "inference_precision": args.inference_precision,
        "precompile_s": precompile_s, "cache_fill": fill, "cells": cells, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
