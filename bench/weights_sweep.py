"""Quality of NNCF weight-compression recipes on the demo model: the table the size-class defaults
(compiler/compress.py) and the quality floors (compiler/quality.py) were set from.

For each recipe, a 1-stage build of SmolLM2-135M-Instruct (``fleet-compiler build --shards 1
--weights ...``) is measured against the fp16 build with ``compiler.quality.compare``: perplexity
on the shipped public-domain text, teacher-forced greedy agreement, identical free-running answers,
and the stage's bytes. About a minute per recipe on 2 cores (builds and measurements are cached
under ``--cache``).

    python bench/weights_sweep.py [--json PATH] [--recipes int8,int4:asym:32:0.8] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain script: make the repo's packages importable

# format[:sym|asym[:group[:ratio]]]; the int4 ones without options take the demo's size-class default
RECIPES = ("int8:asym", "int8:sym",
           "int4:asym:32:0.8", "int4:asym:32:0.6", "int4:sym:32:0.8", "int4:sym:128:0.8",
           "int4:asym:32:1.0", "int4:asym:64:1.0", "int4:asym:128:1.0",
           "int4:sym:32:1.0", "int4:sym:64:1.0", "int4:sym:128:1.0")


def build_recipe(hf: Path, cache: Path, recipe: str) -> Path:
    """The 1-stage build of ``recipe`` in ``cache`` (built once per compiler version)."""
    import hashlib

    key = hashlib.sha256(b"".join((ROOT / "compiler" / n).read_bytes()
                                  for n in ("export.py", "build.py", "compress.py"))).hexdigest()[:8]
    out = cache / f"smollm2-1stage-{recipe.replace(':', '-')}-{key}"
    if not (out / "manifest.json").is_file():
        from compiler.build import build

        fmt, *opts = recipe.split(":")
        symmetric = {"sym": True, "asym": False}[opts[0]] if opts else None
        group = int(opts[1]) if len(opts) > 1 else None
        ratio = float(opts[2]) if len(opts) > 2 else None
        print(f"building {recipe} into {out} ...", flush=True)
        build(hf, out, shards=1, weights=fmt, symmetric=symmetric, group_size=group, ratio=ratio)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--recipes", help=f"comma-separated (default: {','.join(RECIPES)})")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: fetched into CACHE/SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", type=Path, default=ROOT / "models" / "bench", help="builds are cached here")
    args = parser.parse_args(argv)

    from compiler.quality import compare, measure
    from compiler.source import fetch_demo
    from fleet_common.manifest import load_manifest

    hf = fetch_demo(args.hf or args.cache / "SmolLM2-135M-Instruct")
    reference = build_recipe(hf, args.cache, "fp16")
    ref = measure(reference)
    ref_bytes = (reference / load_manifest(reference).manifest.stages[0].bin).stat().st_size
    rows = [{"recipe": "fp16", "weights": ref.weights[0], "mbytes": ref_bytes / 1e6, "perplexity": ref.perplexity,
             "ppl_increase": 0.0, "agreement": 1.0, "identical": len(ref.greedy)}]
    print(f"{'weights':<22} {'MB':>6} {'perplexity':>10} {'vs fp16':>8} {'agreement':>9} {'identical':>9}")
    print(f"{rows[0]['weights']:<22} {rows[0]['mbytes']:>6.1f} {ref.perplexity:>10.3f}")
    for recipe in (args.recipes.split(",") if args.recipes else RECIPES):
        build = build_recipe(hf, args.cache, recipe)
        mine, c = compare(build, reference)
        size = (build / load_manifest(build).manifest.stages[0].bin).stat().st_size / 1e6
        rows.append({"recipe": recipe, "weights": mine.weights[0], "mbytes": size, "perplexity": mine.perplexity,
                     "ppl_increase": c.ppl_increase, "agreement": c.agreement, "identical": c.identical})
        print(f"{mine.weights[0]:<22} {size:>6.1f} {mine.perplexity:>10.3f} {c.ppl_increase:>+8.2%} "
              f"{c.agreement:>9.3f} {f'{c.identical}/{c.prompts}':>9}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"tokens": ref.tokens, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
