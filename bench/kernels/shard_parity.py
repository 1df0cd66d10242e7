"""Shard parity: decode latency of an N-stage chain in one process vs the whole model, with and without
the fusion hints, and each worker's resident memory vs its shard's weights plus KV (issue 5, item 5).

Per weight format (fp16, int8, int4: ``fleet-compiler build --shards N --weights F``, N = 1, 2, 3) the
configurations are:

* ``whole``: the 1-stage build's IR fed directly from a numpy loop, as one would run the unsharded
  model without fleet (the reference; optimum-intel is not installed here, so the fleet's own export
  of all 30 layers stands in for its export: same graph contract, tested against transformers).
* ``N-stage``: every stage of the N-stage build compiled in this process and chained through the
  worker's code path (``compiler.quality.StageChain``: one ``fleet_common.runtime.KVSession`` per
  stage, ``run_chunk``), hidden states handed on as numpy arrays; no network.
* ``N-stage no-hints``: the same IR with the fusion hint bypassed (``strip_fusion_hints``: the
  ``Gather(beam_idx)`` after each ``ReadValue`` removed, so KV reads go ``ReadValue -> Concat ->
  SDPA``, the graph the CPU plugin does not fuse; compiler/export.py's docstring). Same weights, same outputs at
  batch 1.

The whole model and each hinted chain first prefill the first context's tokens (chapters I-II of
Alice, the quality text) in one chunk, keep a copy of their KV state, decode a few tokens (warm-up),
prefill on to the next context, and so on; a no-hints chain starts from its hinted twin's saved
states (same weights and state names). A timed run puts each saved state back (as a compaction writes
a state) and times ``--steps`` decode steps from it, fed the text's next tokens (teacher-forced, so
every configuration does the same work; each step's argmax is compared with the whole model's, and
with the warm-up right after the real prefill). Saving the prefilled state keeps a round cheap (a
1024-token prefill takes 5-10 s here, a config's decode steps well under 2 s), so there can be more
rounds. Within a weight format the configurations take turns step by step (whole, 1-stage, 1-stage
no-hints, 2-stage, ...: one step each, then the next step), starting one configuration later each
round, so a burst of load from other processes hits them alike. A cell's ms per token is the median
over every timed step; its ratios are medians over rounds of the per-round ratio of medians. Fusion
is read off each stage's compiled runtime model (``compiler.inspect``, the check ``fleet-compiler
inspect`` prints).

Memory: every stage of each N-stage build is served by a real ``fleet-worker`` (``--no-announce``),
once compiling its IR and once importing it from OpenVINO's model cache (a folder under ``--cache``);
one session runs through the chain (gRPC on loopback) like the speed part's (prefill to the largest
context in chunks of 256, then ``--steps`` one-token steps); then each worker's VmRSS is read against
its shard's ``.bin`` bytes plus the KV bytes it reports, with the resident part of the mapped weight
file (IR ``.bin`` or cached ``.blob``) beside it. A worker process that has loaded nothing (Python,
gRPC, OpenVINO's CPU plugin) is measured once as the fixed runtime.

Targets (issue 5; goals, not assertions): N-stage / whole <= 1.05 at both contexts; no-hints >= 1.5x
slower than hints; worker RSS <= 1.25x (shard weights + KV).

    python bench/kernels/shard_parity.py [--json PATH] [--quick] [--formats fp16,int8,int4] [--contexts 128,1024]
                                 [--steps 32] [--rounds 6] [--threads 0] [--no-memory] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import openvino as ov

from bench import harness
from bench.kernels.decoding import WARM_UP_STEPS, Whole, decode, load_kv, prefill, step
from bench.kernels.worker_memory import runtime_baseline, worker_memory
from compiler.inspect import inspect
from compiler.quality import EVAL_TEXT, StageChain
from fleet_common.manifest import MANIFEST_NAME, load_manifest, sha256_file
from fleet_common.runtime import stage_core

FORMATS = ("fp16", "int8", "int4")
STAGES = (1, 2, 3)
TARGET_PARITY = 1.05  # N-stage / whole, at most
TARGET_NO_HINTS = 1.5  # no-hints / hints, at least
TARGET_MEMORY = 1.25  # worker RSS / (shard weights + KV), at most


# ---------------------------------------------------------------- builds, cached between runs

def ensure_build(hf: Path, cache: Path, shards: int, weights: str) -> Path:
    """``fleet-compiler build HF --shards N --weights F`` into ``cache`` (``harness.ensure_build``; fp16, the
    default, is the same build as the other benches' plain one)."""
    return harness.ensure_build(hf, cache, shards, options=() if weights == "fp16" else ("--weights", weights))


def strip_fusion_hints(model: ov.Model) -> int:
    """Bypass the ``Gather(beam_idx, axis 0)`` right after each KV ``ReadValue`` of a fleet shard (the
    fusion hint, compiler/export.py), leaving ``ReadValue -> Concat -> SDPA``. Only the row reorder is
    lost (``beam_idx`` stays an input, unused), so outputs at batch 1 are unchanged.

    Returns the number of Gathers bypassed; raises ``ValueError`` when a ``ReadValue`` has none.
    """
    bypassed = 0
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        hints = [t.get_node() for t in op.output(0).get_target_inputs()
                 if t.get_node().get_type_name() == "Gather"
                 and "beam_idx" in t.get_node().input(1).get_source_output().get_names()]
        if not hints:
            raise ValueError(f"{op.get_friendly_name()} is not followed by Gather(beam_idx): not a fleet shard")
        for gather in hints:
            gather.output(0).replace(op.output(0))
            bypassed += 1
    model.validate_nodes_and_infer_types()
    return bypassed


def ensure_unhinted(build: Path) -> Path:
    """A copy of ``build`` whose stages have no fusion hints (``strip_fusion_hints``), next to it: a
    complete build (tokenizer hard-linked, manifest with the new files' sha256), so a worker could serve it."""
    out = build.parent / f"{build.name}-nohints"
    if (out / MANIFEST_NAME).is_file():
        return out
    tmp = build.parent / f"{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(build, tmp, copy_function=os.link)
    loaded = load_manifest(build)
    files = dict(loaded.manifest.files)
    core = stage_core()
    for stage in loaded.manifest.stages:
        model = core.read_model(str(build / stage.xml))
        strip_fusion_hints(model)
        for rel in (stage.xml, stage.bin):
            (tmp / rel).unlink()  # hard links to the original: never write through them
        ov.save_model(model, tmp / stage.xml, compress_to_fp16=False)  # weights are stored as they were read
        files.update({rel: sha256_file(tmp / rel) for rel in (stage.xml, stage.bin)})
    (tmp / MANIFEST_NAME).unlink()
    (tmp / MANIFEST_NAME).write_text(replace(loaded.manifest, files=files).to_json())
    tmp.rename(out)
    return out


# ---------------------------------------------------------------- configurations

@dataclass
class Config:
    """One measured configuration and everything measured on it."""

    weights: str
    stages: int  # 0 for the whole model
    hints: bool
    build: Path
    fusion: list[dict] = field(default_factory=list)  # per stage, from the compiled runtime model
    prefilled: dict = field(default_factory=dict)  # warm-up after the prefill: {context: {"prefill_ms", "ms", "top1"}}
    runs: list[dict] = field(default_factory=list)  # per round: {context: {"ms": [...], "top1": [...]}}
    model: Whole | StageChain | None = None  # while measuring

    @property
    def name(self) -> str:
        """``FORMAT whole``, ``FORMAT N-stage`` or ``FORMAT N-stage no-hints``."""
        if not self.stages:
            return f"{self.weights} whole"
        return f"{self.weights} {self.stages}-stage" + ("" if self.hints else " no-hints")

    @property
    def fused(self) -> bool:
        """Whether every stage's compiled model fused its attention."""
        return all(f["fused"] for f in self.fusion)

    def fusion_text(self) -> str:
        """``yes (30/30 SDPA+KV, 0 Softmax)``: fused, and the counts behind it."""
        kv = sum(f["sdpa_with_kv"] for f in self.fusion)
        layers = sum(f["layers"][1] - f["layers"][0] for f in self.fusion)
        softmax = sum(f["softmax"] for f in self.fusion)
        return f"{'yes' if self.fused else 'no'} ({kv}/{layers} SDPA+KV, {softmax} Softmax)"


def fusion_of(build: Path) -> list[dict]:
    """Each stage's fusion facts on CPU; raises when the build's files do not match its manifest."""
    problems, reports = inspect(build)
    if problems:
        raise RuntimeError(f"{build}: {'; '.join(problems)}")
    return [{"stage": r.index, "layers": list(r.layers), "sdpa_with_kv": r.sdpa_with_kv, "softmax": r.softmax,
             "fused": r.fused} for r in reports]


def warm_up(configs: list[Config], tokens: list[int], contexts: list[int], steps: int) -> dict[str, dict]:
    """Prefill the whole model and every hinted chain, keeping their KV at each context; a no-hints chain
    starts from its hinted twin's (same weights, same state names: a prefill saved, and the slowest one);
    every config decodes a few steps from each. Returns {config name: {context: saved KV}}."""
    print(f"prefill and warm-up: {len(configs)} configurations ...", flush=True)
    max_context = contexts[-1] + steps
    steps = min(steps, WARM_UP_STEPS)
    saved = {}
    for c in configs:
        if c.hints:
            saved[c.name], c.prefilled = prefill(c.model, tokens, contexts, steps, max_context)
    hinted = {(c.weights, c.stages): c for c in configs if c.hints}
    for c in configs:
        if not c.hints:
            twin = hinted[(c.weights, c.stages)]
            saved[c.name], c.prefilled = saved[twin.name], twin.prefilled
            c.model.start(max_context)
            for ctx in contexts:
                load_kv(c.model, saved[c.name][ctx], ctx)
                decode(c.model, tokens, ctx, steps)
    return saved


def timed_round(group: list[Config], saved: dict[str, dict], tokens: list[int], contexts: list[int], steps: int,
                turn: int) -> None:
    """One round of a weight format's configs (their order rotated by ``turn``): at each context every config
    decodes ``steps`` from its saved KV, one step of each in turn, so a burst of load hits all; appends each
    config's {context: {"ms", "top1"}} to its runs."""
    runs = {c.name: {} for c in group}
    order = group[turn % len(group):] + group[: turn % len(group)]
    for ctx in contexts:
        for c in order:
            load_kv(c.model, saved[c.name][ctx], ctx)
            runs[c.name][ctx] = {"ms": [], "top1": []}
        gc.collect()
        for pos in range(ctx, ctx + steps):
            for c in order:
                top1, ms = step(c.model, tokens, pos)
                runs[c.name][ctx]["top1"].append(top1)
                runs[c.name][ctx]["ms"].append(ms)
    for c in group:
        c.runs.append(runs[c.name])


def measure(configs: list[Config], tokens: list[int], contexts: list[int], steps: int, rounds: int) -> list[float]:
    """Warm every config up (:func:`warm_up`), then ``rounds`` rounds (:func:`timed_round`, rotated by one
    config each round) of decoding from the saved KV at each context over the configs of each weight
    format in turn; returns the load average after each round."""
    saved = warm_up(configs, tokens, contexts, steps)
    loadavg = []
    groups = [[c for c in configs if c.weights == w] for w in dict.fromkeys(c.weights for c in configs)]
    for r in range(rounds):
        t0 = time.perf_counter()
        for group in groups:
            timed_round(group, saved, tokens, contexts, steps, r)
        loadavg.append(os.getloadavg()[0])
        print(f"  round {r + 1}/{rounds}: {time.perf_counter() - t0:.0f} s, load average {loadavg[-1]:.2f}",
              flush=True)
    return loadavg


def cell(config: Config, ctx: int) -> float:
    """Median ms per token over every timed step of every round."""
    return statistics.median(ms for run in config.runs for ms in run[ctx]["ms"])


def paired_ratio(a: Config, b: Config, ctx: int) -> float:
    """Median over rounds of (median ms of ``a``) / (median ms of ``b``) in the same round."""
    return statistics.median(statistics.median(ra[ctx]["ms"]) / statistics.median(rb[ctx]["ms"])
                             for ra, rb in zip(a.runs, b.runs))


def restore_agreement(c: Config, ctx: int) -> float:
    """Share of timed steps (decoded from a restored KV state) whose argmax equals the warm-up's right
    after the real prefill (a no-hints chain: its hinted twin's): 1.0 unless restoring the state, or
    stripping the hints, changed what the model computes."""
    pairs = [(x, y) for run in c.runs for x, y in zip(run[ctx]["top1"], c.prefilled[ctx]["top1"])]
    return sum(x == y for x, y in pairs) / len(pairs)


def agreement(a: Config, b: Config, ctx: int) -> float:
    """Share of decode steps (all rounds) where ``a`` and ``b`` rank the same token first."""
    pairs = [(x, y) for ra, rb in zip(a.runs, b.runs) for x, y in zip(ra[ctx]["top1"], rb[ctx]["top1"])]
    return sum(x == y for x, y in pairs) / len(pairs)


# ---------------------------------------------------------------- report

def speed_row(weights: str, n: int, ctx: int, by: dict) -> dict:
    """The JSON row of one weight format, stage count and context: ms per token and ratios (whole, chain,
    no-hints), top-1 agreement with the whole model, fusion and whether the targets were met."""
    whole, hint, bare = by[(weights, 0, True)], by[(weights, n, True)], by[(weights, n, False)]
    row = {"weights": weights, "stages": n, "context": ctx, "whole_ms": cell(whole, ctx),
           "chain_ms": cell(hint, ctx), "chain_over_whole": paired_ratio(hint, whole, ctx),
           "no_hints_ms": cell(bare, ctx), "no_hints_over_hints": paired_ratio(bare, hint, ctx),
           "top1_agreement_chain": agreement(hint, whole, ctx), "top1_agreement_no_hints": agreement(bare, whole, ctx),
           "fused_hints": hint.fused, "fused_no_hints": bare.fused,
           "fusion_hints": hint.fusion_text(), "fusion_no_hints": bare.fusion_text()}
    row["parity_met"] = row["chain_over_whole"] <= TARGET_PARITY
    row["no_hints_met"] = row["no_hints_over_hints"] >= TARGET_NO_HINTS
    return row


def speed_table(configs: list[Config], contexts: list[int]) -> tuple[str, list[dict]]:
    """The markdown table (one row per weights, N and context) and its rows for the JSON."""
    by = {(c.weights, c.stages, c.hints): c for c in configs}
    rows = [speed_row(w, n, ctx, by) for w in dict.fromkeys(c.weights for c in configs)
            for n in sorted({c.stages for c in configs if c.stages}) for ctx in contexts]
    text = harness.table(
        ["weights", "N", "context", "whole ms/tok", "N-stage ms/tok", "N-stage / whole", "no-hints ms/tok",
         "no-hints / hints", "same top-1 as whole", "fused: hints / no-hints"],
        [[r["weights"], r["stages"], r["context"], f"{r['whole_ms']:.2f}", f"{r['chain_ms']:.2f}",
          f"{r['chain_over_whole']:.3f}" + ("" if r["parity_met"] else " (miss)"), f"{r['no_hints_ms']:.2f}",
          f"{r['no_hints_over_hints']:.2f}x" + ("" if r["no_hints_met"] else " (miss)"),
          f"{r['top1_agreement_chain']:.0%} / {r['top1_agreement_no_hints']:.0%}",
          f"{r['fusion_hints']} / {r['fusion_no_hints']}"] for r in rows])
    return text, rows


def memory_table(rows: list[dict], baseline: int) -> str:
    """Markdown table of the workers' RSS against their shard's weights + KV (MiB); ``baseline``: bytes
    of a worker process with nothing loaded."""
    mib = 1 << 20
    text = harness.table(
        ["weights", "N", "stage", "layers", "loaded from", "shard weights MiB", "KV MiB", "RSS MiB",
         "RSS / (weights + KV)", "weights file mapped MiB", "(RSS - runtime - mapped file) / (weights + KV)"],
        [[r["weights"], r["stages"], r["stage"], f"{r['layers'][0]}-{r['layers'][1]}", r["load_source"],
          f"{r['weight_bytes'] / mib:.1f}", f"{r['kv_bytes'] / mib:.1f}", f"{r['rss_bytes'] / mib:.0f}",
          f"{r['rss_ratio']:.2f}" + ("" if r["memory_met"] else " (miss)"), f"{r['mapped_weights_bytes'] / mib:.0f}",
          f"{r['own_ratio']:.2f}"] for r in rows])
    return text + f"\n\nruntime: a worker process with nothing loaded has {baseline / mib:.0f} MiB RSS"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options, ``--quick`` applied (fp16, context 128, 8 steps, 2 rounds) and ``formats`` and
    ``contexts`` as lists. Exits with argparse's usage error for a bad value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every cell, run and memory row here")
    parser.add_argument("--quick", action="store_true", help="smoke run: fp16 only, context 128, 8 steps, 2 rounds")
    parser.add_argument("--formats", default=",".join(FORMATS), help="weight formats, comma-separated")
    parser.add_argument("--contexts", default="128,1024", help="KV lengths decode is timed at, increasing")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per context and run")
    parser.add_argument("--rounds", type=int, default=6,
                        help="timed rounds (each: --steps steps of every configuration at every context)")
    parser.add_argument("--threads", type=int, default=0, help="inference threads (0: OpenVINO's default)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the worker memory part")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: the tests' copy, else fetched into CACHE)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE, help="builds are cached here")
    args = parser.parse_args(argv)
    args.formats = ["fp16"] if args.quick else args.formats.split(",")
    args.contexts = [128] if args.quick else [int(c) for c in args.contexts.split(",")]
    args.steps, args.rounds = (8, 2) if args.quick else (args.steps, args.rounds)
    if bad := [f for f in args.formats if f not in FORMATS]:
        parser.error(f"unknown weight format(s) {bad}; choose from {', '.join(FORMATS)}")
    contexts, steps = args.contexts, args.steps
    if steps < 1 or args.rounds < 1 or any(b < a + steps for a, b in zip(contexts, contexts[1:])) or contexts[0] < 1:
        parser.error("need --steps >= 1, --rounds >= 1 and contexts that grow by at least --steps each")
    args.parser = parser
    return args


def make_configs(builds: dict[tuple[str, int], Path], formats: list[str], threads: int) -> list[Config]:
    """Per weight format the whole model and each N-stage chain with and without hints, each with its fusion
    facts and compiled here (the whole model and the 1-stage chain share a build)."""
    configs = []
    for w in formats:
        configs.append(Config(w, 0, True, builds[(w, 1)]))
        for n in STAGES:
            configs += [Config(w, n, True, builds[(w, n)]), Config(w, n, False, ensure_unhinted(builds[(w, n)]))]
    print("checking fusion and compiling ...", flush=True)
    t0 = time.perf_counter()
    fusion: dict[Path, list[dict]] = {}
    for c in configs:
        if c.build not in fusion:
            fusion[c.build] = fusion_of(c.build)
        c.fusion = fusion[c.build]
        loaded = load_manifest(c.build)
        c.model = Whole(c.build / loaded.manifest.stages[0].xml, threads) if not c.stages else \
            StageChain(loaded, threads, "auto")
    print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    return configs


def run_memory(builds: dict[tuple[str, int], Path], tokens: list[int], args: argparse.Namespace,
               cache: Path) -> tuple[list[dict], int]:
    """Every build's workers, compiling their IR and importing it from OpenVINO's model cache (a folder of
    ours: the first start fills it), each row with its ratios; and the runtime baseline (bytes)."""
    context, steps = args.contexts[-1], args.steps
    print(f"\nworker memory: one fleet-worker per stage, a session prefilled to {context} tokens and "
          f"{steps} decoded ...", flush=True)
    baseline, rows = runtime_baseline(), []
    modes = (["--no-blobs", "--no-model-cache"], ["--no-blobs", "--cache-dir", str(cache / "openvino-cache")])
    for build in builds.values():
        for flags in modes:
            flags = [*flags, "--threads", str(args.threads)]
            got = worker_memory(build, tokens, context, steps, flags, cache / "logs")
            if "--cache-dir" in flags and any(r["load_source"] != "model-cache" for r in got):
                got = worker_memory(build, tokens, context, steps, flags, cache / "logs")  # that start filled it
            rows += got
    for r in rows:
        base = r["weight_bytes"] + r["kv_bytes"]
        r["rss_ratio"] = r["rss_bytes"] / base
        r["own_ratio"] = (r["rss_bytes"] - baseline - r["mapped_weights_bytes"]) / base
        r["memory_met"] = r["rss_ratio"] <= TARGET_MEMORY
    print(f"\nworker memory with one session of {context + steps} tokens (target: RSS <= {TARGET_MEMORY}x "
          "shard weights + KV)\n")
    print(memory_table(rows, baseline))
    return rows, baseline


def print_targets(configs: list[Config], contexts: list[int], speed_rows: list[dict], memory_rows: list[dict]) -> dict:
    """How many cells met each target, and warnings for fusion that is not as built or a restored KV state
    that ranks other tokens first; returns the counts."""
    met = {"parity": sum(r["parity_met"] for r in speed_rows), "no_hints": sum(r["no_hints_met"] for r in speed_rows),
           "memory": sum(r["memory_met"] for r in memory_rows)}
    print(f"\ntargets met: N-stage / whole <= {TARGET_PARITY} in {met['parity']}/{len(speed_rows)} cells, "
          f"no-hints >= {TARGET_NO_HINTS}x in {met['no_hints']}/{len(speed_rows)}"
          + (f", worker memory <= {TARGET_MEMORY}x in {met['memory']}/{len(memory_rows)}" if memory_rows else ""))
    if unfused := [c.name for c in configs if c.hints and not c.fused]:
        print(f"warning: not fused although built with hints: {', '.join(unfused)}")
    if fused := [c.name for c in configs if not c.hints and c.fused]:
        print(f"warning: fused although the hints were stripped: {', '.join(fused)}")
    if drift := [f"{c.name} @{ctx}" for c in configs for ctx in contexts if restore_agreement(c, ctx) < 1]:
        print(f"warning: decoding from a restored KV state ranked other tokens first than after the prefill in: "
              f"{', '.join(drift)}")
    return met


def main(argv: list[str] | None = None) -> int:
    """Build, measure speed and memory (module docstring); prints the tables, writes ``--json``."""
    args = parse_args(argv)
    formats, contexts, steps, rounds = args.formats, args.contexts, args.steps, args.rounds
    from coordinator.tokenizer import ChatTokenizer

    cache = args.cache.resolve()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    hf = harness.demo_hf(args.hf, cache)
    builds = {(w, n): ensure_build(hf, cache, n, w) for w in formats for n in STAGES}
    tokens = ChatTokenizer(builds[(formats[0], 1)]).encode(EVAL_TEXT.read_text())
    if len(tokens) < contexts[-1] + steps:
        args.parser.error(f"the text has {len(tokens)} tokens, fewer than the last context + steps")
    print(f"shard parity: {', '.join(formats)} x N = 1, 2, 3 x contexts {contexts}, {steps} steps, {rounds} rounds, "
          f"threads {args.threads or 'default'}, nproc {os.cpu_count()}, openvino {ov.get_version()}", flush=True)
    splits = {n: load_manifest(builds[(formats[0], n)]).manifest.stages for n in STAGES}
    print("layers per stage: " + "; ".join(f"{n}-stage " + " + ".join(f"[{s.start}, {s.end})" for s in stages)
                                           for n, stages in splits.items()), flush=True)
    configs = make_configs(builds, formats, args.threads)
    t0 = time.perf_counter()
    loadavg = measure(configs, tokens, contexts, steps, rounds)
    speed_s = time.perf_counter() - t0
    for c in configs:
        c.model = None  # release the compiled models before workers start
    gc.collect()
    table, speed_rows = speed_table(configs, contexts)
    print(f"\ndecode latency per token, median ms over {rounds} rounds x {steps} steps; ratios: median over rounds "
          f"of per-round medians (targets: N-stage / whole <= {TARGET_PARITY}, no-hints / hints >= "
          f"{TARGET_NO_HINTS}x)\n")
    print(table, flush=True)
    memory_rows, baseline = run_memory(builds, tokens, args, cache) if args.memory else ([], 0)
    met = print_targets(configs, contexts, speed_rows, memory_rows)
    harness.write_json(args.json, "shard_parity", {
        "model": "SmolLM2-135M-Instruct", "formats": formats, "contexts": contexts, "steps": steps, "rounds": rounds,
        "threads": args.threads, "targets": {"chain_over_whole_max": TARGET_PARITY,
                                             "no_hints_over_hints_min": TARGET_NO_HINTS,
                                             "rss_over_weights_plus_kv_max": TARGET_MEMORY},
        "targets_met": met, "speed_seconds": speed_s, "loadavg_per_round": loadavg, "speed": speed_rows,
        "configs": [{"name": c.name, "weights": c.weights, "stages": c.stages, "hints": c.hints,
                     "build": str(c.build), "fusion": c.fusion,
                     "restore_agreement": {str(ctx): restore_agreement(c, ctx) for ctx in contexts},
                     "warm_up": {str(k): v for k, v in c.prefilled.items()},
                     "runs": [{str(k): v for k, v in run.items()} for run in c.runs]} for c in configs],
        "memory": {"runtime_baseline_bytes": baseline, "rows": memory_rows}}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
