"""Worker cold start: process start -> "serving on" with a pre-compiled blob vs the IR compiled vs the IR
imported from OpenVINO's model cache, per stage, several runs each (medians).

The build is hard-linked into a temporary folder (the original is never written) and pre-compiled there
for the workers' settings (``fleet-compiler precompile``); the model cache is a fresh folder, filled by
one untimed start. Each timed run starts ``fleet-worker`` (``--no-announce``: no mDNS records from a
benchmark) and stops it by its pid once it logs "serving on"; the modes take turns run by run, so load
from other processes hits them alike. ``load s`` is the import/compile time the worker reports (Info
RPC ``load_s``), ``peak RSS`` its VmHWM when ready. Files are in the page cache for every mode (the
blob was just written, the IR just read): this measures compile/import, not the disk.

    python bench/cold_start.py --model BUILD [--runs 5] [--threads 1] [--inference-precision f32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain script: make the repo's packages importable

import grpc  # noqa: E402
import openvino as ov  # noqa: E402

from fleet_common import fleet_pb2 as pb  # noqa: E402
from fleet_common import fleet_pb2_grpc as pb_grpc  # noqa: E402
from fleet_common.manifest import load_manifest  # noqa: E402

BIN = Path(sys.executable).parent
MODES = {  # mode -> fleet-worker flags (the cache folder is appended for model-cache)
    "ir": ["--no-blobs", "--no-model-cache"],
    "model-cache": ["--no-blobs"],
    "blob": ["--no-model-cache"],
}


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_once(build: Path, stage: int, flags: list[str], log: Path) -> dict:
    """Start one worker, time it to "serving on", ask its Info, stop it; one result row."""
    cmd = [str(BIN / "fleet-worker"), "--shard", str(stage), "--model", str(build), "--no-announce", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving on ([\d.]+:\d+)", line):
                ready_s = time.perf_counter() - t0
                break
        else:
            raise RuntimeError(f"worker exited ({proc.wait()}):\n{''.join(lines)[-2000:]}")
        rss = peak_rss_mb(proc.pid)
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
        subprocess.run([str(BIN / "fleet-compiler"), "precompile", str(build), *settings], check=True,
                       capture_output=True)
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
    print(f"{'stage':>5}  {'mode':<11}  {'ready s':>7}  {'min-max s':>11}  {'load s':>6}  {'peak RSS MB':>11}")
    for c in cells:
        spread = f"{c['ready_min_s']:.2f}-{c['ready_max_s']:.2f}"
        print(f"{c['stage']:>5}  {c['mode']:<11}  {c['ready_s']:>7.2f}  {spread:>11}  {c['load_s']:>6.2f}"
              f"  {c['peak_rss_mb']:>11.0f}")
    print(f"(precompile of {len(stages)} stage(s): {precompile_s:.1f} s; first start writing the model cache: "
          + ", ".join(f"stage {s} {fill[s]['ready_s']:.2f} s (load {fill[s]['load_s']:.2f} s)" for s in stages) + ")")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": str(args.model), "threads": args.threads, "inference_precision": args.inference_precision,
            "openvino": ov.get_version(), "machine": {"cpu": platform.processor() or platform.machine(),
                                                      "nproc": os.cpu_count(), "load_avg": os.getloadavg()},
            "precompile_s": precompile_s, "cache_fill": fill, "cells": cells, "runs": runs}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
