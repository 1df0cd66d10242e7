"""Quality of NNCF weight-compression recipes on the demo model: the table the size-class defaults
(compiler/compress.py) and the quality floors (compiler/quality.py) were set from.

For each recipe, a 1-stage build of SmolLM2-135M-Instruct (``fleet-compiler build --shards 1
--weights ...``) is measured against the fp16 build with ``compiler.quality.compare``: perplexity
on the shipped public-domain text, teacher-forced greedy agreement, identical free-running answers,
and the stage's bytes. About a minute per recipe on 2 cores (builds and measurements are cached
under ``--cache``).

    python bench/builds/weights_sweep.py [--json PATH] [--recipes int8,int4:asym:32:0.8] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import harness

# format[:sym|asym[:group[:ratio]]]; the int4 ones without options take the demo's size-class default
RECIPES = ("int8:asym", "int8:sym",
           "int4:asym:32:0.8", "int4:asym:32:0.6", "int4:sym:32:0.8", "int4:sym:128:0.8",
           "int4:asym:32:1.0", "int4:asym:64:1.0", "int4:asym:128:1.0",
           "int4:sym:32:1.0", "int4:sym:64:1.0", "int4:sym:128:1.0")


def recipe_options(recipe: str) -> tuple[str, ...]:
    """``fleet-compiler build`` options of ``recipe`` (``format[:sym|asym[:group[:ratio]]]``)."""
    fmt, *opts = recipe.split(":")
    out = () if fmt == "fp16" else ("--weights", fmt)
    out += ({"sym": ("--symmetric",), "asym": ("--asymmetric",)}[opts[0]] if opts else ())
    out += ("--group-size", opts[1]) if len(opts) > 1 else ()
    return out + (("--ratio", opts[2]) if len(opts) > 2 else ())


def build_recipe(hf: Path, cache: Path, recipe: str) -> Path:
    """The 1-stage build of ``recipe`` in ``cache`` (``harness.ensure_build``: once per compiler version)."""
    return harness.ensure_build(hf, cache, 1, options=recipe_options(recipe))


def main(argv: list[str] | None = None) -> int:
    """Build and measure every recipe against fp16; prints the table, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--recipes", help=f"comma-separated (default: {','.join(RECIPES)})")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: fetched into CACHE/SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE, help="builds are cached here")
    args = parser.parse_args(argv)

    from compiler.quality import compare, measure
    from fleet_common.manifest import load_manifest

    hf = harness.demo_hf(args.hf, args.cache)
    reference = build_recipe(hf, args.cache, "fp16")
    ref = measure(reference)
    ref_bytes = (reference / load_manifest(reference).manifest.stages[0].bin).stat().st_size
    rows = [{"recipe": "fp16", "weights": ref.weights[0], "mbytes": ref_bytes / 1e6, "perplexity": ref.perplexity,
             "ppl_increase": 0.0, "agreement": 1.0, "identical": len(ref.greedy)}]
    for recipe in (args.recipes.split(",") if args.recipes else RECIPES):
        build = build_recipe(hf, args.cache, recipe)
        mine, c = compare(build, reference)
        size = (build / load_manifest(build).manifest.stages[0].bin).stat().st_size / 1e6
        rows.append({"recipe": recipe, "weights": mine.weights[0], "mbytes": size, "perplexity": mine.perplexity,
                     "ppl_increase": c.ppl_increase, "agreement": c.agreement, "identical": c.identical,
                     "prompts": c.prompts})
        print(f"  {mine.weights[0]}: perplexity {mine.perplexity:.3f} ({c.ppl_increase:+.2%})", flush=True)
    print(harness.table(["weights", "MB", "perplexity", "vs fp16", "agreement", "identical"],
                        [[r["weights"], f"{r['mbytes']:.1f}", f"{r['perplexity']:.3f}",
                          f"{r['ppl_increase']:+.2%}" if r["recipe"] != "fp16" else None,
                          f"{r['agreement']:.3f}" if r["recipe"] != "fp16" else None,
                          f"{r['identical']}/{r['prompts']}" if r["recipe"] != "fp16" else None] for r in rows],
                        pad=True))
    harness.write_json(args.json, "weights_sweep", {"tokens": ref.tokens, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
