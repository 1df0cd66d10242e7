"""Two builds of fleet's kernels timed side by side in one process: the ratio of their times on the same product
in the same seconds, on a host whose speed changes by 1.5x for minutes at a time.

Each side is a git revision's ``kernels/`` (``--a``, default ``HEAD``) or the working tree's (``--b``, default
``worktree``), compiled with the flags ``kernels/CMakeLists.txt`` gives its core (``-O3 -ffp-contract=off``, each
instruction set's file with its own ``-m`` flags) beside ``bench/kernels/ab/time_product.cpp`` into a shared
library of its own. ``ab/alternate.cpp`` loads both and calls them in turn, ``--rounds`` times for each type and
row count: one thread, the fastest instruction set this CPU runs (``FLEET_KERNEL_ISA`` forces one), activations
quantized as the default precision runs them, random blocks of ``--n`` x ``--k`` (default Llama-3.2-1B's gate,
8192 x 2048). A/B > 1 means B is faster. Reported: each side's best round and the median of the rounds' ratios
(a ratio from one round compares two runs a few milliseconds apart).

    python bench/kernels/kernel_ab.py [--a HEAD~1] [--b worktree] [--types Q4_K,Q6_K] [--rows 1,8,64,512]
        [--rounds 10] [--realtime] [--json PATH]

Not OpenVINO's path (``kernel_ops.py`` times the op, ``kernel_bench.py`` a whole model); no llama.cpp (its
``llama-bench`` runs in other seconds than fleet's, which is what this bench avoids).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[2]
AB = Path(__file__).resolve().parent / "ab"
COMMON = ["-std=c++17", "-O3", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
          "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {"isa_avxvnni.cpp": ["-mavxvnni"],
             "isa_avx512vnni.cpp": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"]}


def kernels_source(side: str, into: Path) -> Path:
    """``kernels/`` of git revision ``side`` (or the working tree's, ``worktree``) copied under ``into``."""
    into.mkdir(parents=True)
    if side == "worktree":
        shutil.copytree(ROOT / "kernels", into / "kernels")
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", side, "kernels"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "kernels"


def build_side(side: str, work: Path) -> Path:
    """The shared library of ``side``'s kernels and time_product.cpp; raises CalledProcessError with the
    compiler's message when a source does not build."""
    src = kernels_source(side, work / "src")
    cmake = (src / "CMakeLists.txt").read_text()
    sources = re.search(r"set\(CORE_SOURCES([^)]*)\)", cmake).group(1).split()

    def compile_one(source: Path) -> Path:
        obj = work / (source.stem + ".o")
        subprocess.run(["g++", *COMMON, *ISA_FLAGS.get(source.name, []), "-I", str(src / "core"), "-c", str(source),
                        "-o", str(obj)], check=True, capture_output=True, text=True)
        return obj

    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(compile_one, [src / s for s in sources] + [AB / "time_product.cpp"]))
    library = work / "kernels_ab.so"
    subprocess.run(["g++", "-shared", *map(str, objects), "-o", str(library)], check=True, capture_output=True, text=True)
    return library


def measure(timer: Path, libraries: list[Path], kind: str, n: int, k: int, rows: int, rounds: int,
            realtime: bool) -> dict:
    """``rounds`` alternating timings of one product on both sides: each side's best and the rounds' ratios."""
    reps = 5 if rows <= 8 else 1
    cmd = [str(timer), *map(str, libraries), kind, str(n), str(k), str(rows), str(rounds), str(reps)]
    if realtime:
        cmd = ["chrt", "-f", "50", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"type": kind, "rows": rows, "error": out.stderr.strip()}
    pairs = [tuple(map(float, line.split())) for line in out.stdout.splitlines()]
    a, b = min(p[0] for p in pairs), min(p[1] for p in pairs)
    return {"type": kind, "rows": rows, "a_us": a * 1e6, "b_us": b * 1e6, "best_ratio": a / b,
            "median_ratio": statistics.median(p[0] / p[1] for p in pairs), "rounds": len(pairs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="HEAD", help="a git revision, or worktree")
    p.add_argument("--b", default="worktree", help="a git revision, or worktree")
    p.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q5_K,Q6_K")
    p.add_argument("--rows", default="1,8,64,512", help="activation rows of each product (1: decode)")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--realtime", action="store_true", help="SCHED_FIFO priority (root)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        work = Path(tmp)
        try:
            libraries = [build_side(side, work / name) for name, side in (("a", args.a), ("b", args.b))]
            timer = work / "alternate"
            subprocess.run(["g++", "-O2", str(AB / "alternate.cpp"), "-o", str(timer), "-ldl"], check=True,
                           capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            print(f"kernel_ab: a build failed: {' '.join(exc.cmd[:3])}...\n{exc.stderr}", file=sys.stderr)
            return 1
        cells = [measure(timer, libraries, kind, args.n, args.k, rows, args.rounds, args.realtime)
                 for kind in args.types.split(",") for rows in map(int, args.rows.split(","))]
    rows = [[c["type"], c["rows"], f"{c['a_us']:.1f}", f"{c['b_us']:.1f}", f"{c['best_ratio']:.2f}x",
             f"{c['median_ratio']:.2f}x"] if "error" not in c else [c["type"], c["rows"], None, None, None, c["error"]]
            for c in cells]
    print(f"A = {args.a}, B = {args.b}; {args.n} x {args.k}, one thread, {args.rounds} rounds")
    print(harness.table(["type", "rows", "A µs", "B µs", "A/B best", "A/B median of rounds"], rows, pad=True))
    if args.json:
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "shape": [args.n, args.k], "cells": cells}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
