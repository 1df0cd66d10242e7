"""The quality floors of docs/compression.md at full length: ``fleet-compiler inspect BUILD --reference FP16`` on
the demo's 2-stage int8 and int4 builds (the recipes tests/integration/test_weights.py builds) against its 1-stage
fp16 build, each measured afresh (``uncached``: never from a stored quality.json), on the whole evaluation text
(5,902 tokens) and all 8 prompts. Prints the table, writes ``--json``; exits 1 when a build misses its floor.

The suite checks the same floors through the same command on the text's first 1,024 tokens (``inspect --tokens
1024``), all 8 prompts, one thread. Measured on the test builds (2026-12-06, 1 thread): int8 +0.21% (2,048 tokens
+0.13%, whole text +0.17%), int4 +16.38% (+14.69%, +14.58%) against the floors' +1% and +20%; the agreement (0.953
and 0.781 against 0.90 and 0.75) is the whole run's, the prompts being all there. The whole text costs ~155 CPU
s (1 thread), the fp16 reference the most: ~11 CPU s per 1,024-token window against ~5.5 for int8 or int4.

    python bench/builds/quality_floors.py [--json PATH] [--tokens N] [--threads N] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bench import harness

WEIGHTS = ("int8", "int4")  # 2-stage builds at the size-class defaults, as the suite's


def uncached(build: Path, folder: Path) -> Path:
    """``build`` seen through ``folder``: a symlink to each of its files but quality.json, so that inspect
    measures afresh (and writes its report there, not into the build)."""
    folder.mkdir(parents=True)
    for entry in build.iterdir():
        if entry.name != "quality.json":
            (folder / entry.name).symlink_to(entry)
    return folder


def inspect(build: Path, reference: Path, tokens: int = 0, threads: int = 0) -> tuple[subprocess.CompletedProcess,
                                                                                      dict]:
    """``fleet-compiler inspect BUILD --reference REFERENCE --threads THREADS --tokens TOKENS`` (0 tokens: the
    whole evaluation text); returns the run and ``build``'s quality.json ({} when inspect wrote none)."""
    cmd = [*harness.tool("fleet-compiler"), "inspect", str(build), "--reference", str(reference), "--threads",
           str(threads), "--tokens", str(tokens)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=harness.ROOT, env=harness.repo_env())
    report = build / "quality.json"
    return run, json.loads(report.read_text()) if report.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    """Measure each of ``WEIGHTS`` against fp16 afresh; print the table, write ``--json``; 1 if a floor fails."""
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--tokens", type=int, default=0, help="the text's first N tokens only (the suite: 1024)")
    parser.add_argument("--threads", type=int, default=0, help="inspect's --threads (0: all cores)")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: the tests' copy or CACHE's)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE, help="builds are cached here")
    args = parser.parse_args(argv)

    hf = harness.demo_hf(args.hf, args.cache)
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="quality-floors-") as tmp:
        reference = uncached(harness.ensure_build(hf, args.cache, 1), Path(tmp) / "fp16" / "build")
        for weights in WEIGHTS:
            build = harness.ensure_build(hf, args.cache, 2, options=("--weights", weights))
            run, report = inspect(uncached(build, Path(tmp) / weights / "build"), reference, args.tokens, args.threads)
            print(run.stdout, run.stderr, sep="", flush=True)
            if run.returncode not in (0, 1) or "comparison" not in report:
                raise SystemExit(f"inspect of the {weights} build failed ({run.returncode})")
            m, c = report["measurement"], report["comparison"]
            rows.append({"weights": weights, "tokens": m["tokens"], "perplexity": m["perplexity"],
                         "reference_perplexity": c["reference_perplexity"], "ppl_increase": c["ppl_increase"],
                         "agreement": c["agreement"], "identical": c["identical"], "prompts": c["prompts"],
                         "floor": c["floor"], "passed": c["passed"], "seconds": m["seconds"]})
            ok = ok and c["passed"] and run.returncode == 0
    print(harness.table(["weights", "tokens", "perplexity", "fp16", "vs fp16", "floor", "agreement", "floor",
                         "identical", "status"],
                        [[r["weights"], r["tokens"], f"{r['perplexity']:.3f}", f"{r['reference_perplexity']:.3f}",
                          f"{r['ppl_increase']:+.2%}", f"<= {r['floor']['max_ppl_increase']:+.0%}",
                          f"{r['agreement']:.3f}", f">= {r['floor']['min_agreement']:.2f}",
                          f"{r['identical']}/{r['prompts']}", "ok" if r["passed"] else "FAIL"] for r in rows],
                        pad=True))
    harness.write_json(args.json, "quality_floors", {"tokens_asked": args.tokens, "threads": args.threads,
                                                     "rows": rows}, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
