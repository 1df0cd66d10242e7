"""Every GGUF block type the builder keeps (compiler/gguf.py ``KEPT``: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1,
Q5_K, Q3_K, Q2_K, MXFP4), side by side on the
demo model, against the fp16 build of its HF folder: size, stored forms, decode speed, worker memory, quality.

The GGUFs are made here, nothing is downloaded. The source is the demo's Q4_1 GGUF that ``fetch_demo`` keeps
in its HF folder (the folder's f32 safetensors are its dequantization, so the values are the same; the GGUF
already holds llama.cpp's Q/K row order and the tokenizer metadata). Each made file copies its metadata and
has every layer matrix (``blk.N.attn_q/k/v/output``, ``ffn_gate/up/down``) in one type; the token embedding
(the tied head) stays Q8_0 as in the demo's file, norms F32:

* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4: gguf-py's ``gguf.quants.quantize`` of the f32 dequantization (Q4_1 gives the
  demo's own blocks back, byte for byte: checked, ``same_as_demo``);
* Q4_K, Q6_K, Q5_K, Q3_K, Q2_K: llama.cpp's ``llama-quantize --pure --token-embedding-type q8_0`` (every tensor
  that type, no k-quant mixture) of an F32 GGUF written as above (``bench/build_llama_cpp.sh`` builds it).

Each is built with ``fleet-compiler build X.gguf --shards 1``, the reference with ``fleet-compiler build HF
--shards 1`` (fp16). Per build:

* ``stage_0`` ``.bin`` bytes and the manifest's ``compression`` (tensors per stored form);
* the compiled model's FullyConnected nodes (``CompiledModel.get_runtime_model()``): element type of their
  weight input and their ``runtimePrecision``. Compressed kernels show the packed type (u4/i4/i8) with f32
  scale inputs; a dequantized copy would show f32/bf16/f16 weights;
* decode ms per token at 128 tokens of context, one thread, at the default precision and at f32: every
  build x precision compiled in this process (1-stage IR fed from numpy, ``bench/kernels/decoding.Whole``),
  prefilled once on the quality text with the KV kept, then ``--rounds`` rounds of ``--steps`` teacher-forced
  steps from that KV, every configuration one step in turn (rotated each round) so load from other
  processes hits them alike; a cell is the median step, its ratio the median over rounds of the per-round
  ratio of medians against fp16 at the same precision;
* a real ``fleet-worker`` (``--threads 1``, IR compiled, no blob or model cache) per build and precision,
  a session prefilled to 128 tokens and ``--steps`` decoded over gRPC: peak RSS (VmHWM), RSS, and its own
  part (RSS minus a worker that loaded nothing minus the mapped ``.bin``'s resident pages), the memory that
  tells packed weights (~0.6 B/weight for 4-bit) from an f32 copy (4 B/weight);
* perplexity, teacher-forced greedy agreement and identical answers against fp16 (``compiler.quality``,
  what ``fleet-compiler inspect --quality --reference FP16`` prints; f32 inference; cached per build).

    python bench/builds/gguf_forms.py [--json PATH] [--forms Q8_0,Q4_0,Q5_0,Q3_K] [--steps 64] [--rounds 5]
                               [--no-memory] [--no-quality] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench import harness
from bench.kernels.decoding import WARM_UP_STEPS, Whole, load_kv, prefill, step
from compiler.gguf_read import read_gguf_file

FORMS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q4_K+Q4_1", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "MXFP4")
BY_LLAMA_QUANTIZE = ("Q4_K", "Q4_K+Q4_1", "Q6_K", "Q5_K", "Q3_K", "Q2_K")  # gguf-py has no quantizer for k-quants
# A k-quant block holds 256 weights of a row; the demo's rows of 576 (hidden size) do not divide, so
# llama-quantize falls back there (llama-quant.cpp: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K/Q2_K -> Q4_0, all
# kept) and only ffn_down (rows of 1536) is a k-quant. "Q4_K+Q4_1" asks for Q4_1 in those matrices instead.
NARROW = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")  # rows of hidden_size
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FILE_TYPE = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "MXFP4": 38}  # gguf.LlamaFileType
PRECISIONS = ("auto", "f32")
CONTEXT = 128
REFERENCE = "fp16"
MB = 1e6


# ---------------------------------------------------------------- making the GGUFs

def is_layer_matrix(name: str) -> bool:
    """Whether GGUF tensor ``name`` is a decoder layer's linear weight (``blk.N.attn_q.weight``, ...)."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in MATRICES and parts[3] == "weight"


def write_gguf(source: Path, out: Path, matrix_type: str) -> Path:
    """Write ``out``: ``source``'s metadata (``general.file_type`` set for ``matrix_type``) and tensors, every
    layer matrix re-quantized with gguf-py to ``matrix_type`` ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4") or
    dequantized to "F32"; with "F32" every other quantized tensor is dequantized to f32 too (llama-quantize's
    input), else the others are copied as they are. Written beside ``out`` and renamed when complete. Returns
    ``out``."""
    import gguf

    target = gguf.GGMLQuantizationType[matrix_type]
    reader = read_gguf_file(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value = FILE_TYPE[matrix_type] if field.name == "general.file_type" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        raw = np.asarray(t.data)
        if not is_layer_matrix(t.name) and (qtype == gguf.GGMLQuantizationType.F32 or matrix_type != "F32"):
            writer.add_tensor(t.name, raw, raw_dtype=qtype)
            continue
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32)  # [rows, cols]
        writer.add_tensor(t.name, values if matrix_type == "F32" else gguf.quants.quantize(values, target),
                          raw_dtype=None if matrix_type == "F32" else target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def llama_quantize(f32: Path, out: Path, form: str, logs: Path) -> Path:
    """``llama-quantize --pure --token-embedding-type q8_0 F32 OUT TYPE``: every tensor (the embedding:
    Q8_0) that type where its rows allow, no k-quant mixture; ``TYPE+OTHER`` adds ``--tensor-type M=OTHER``
    for the ``NARROW`` matrices. Written beside ``out`` and renamed when complete."""
    tmp = out.with_name(out.name + ".partial")
    qtype, _, other = form.partition("+")
    overrides = [a for m in NARROW for a in ("--tensor-type", f"{m}={other.lower()}")] if other else []
    cmd = [str(harness.llama_cpp_tool("llama-quantize")), "--pure", "--token-embedding-type", "q8_0", *overrides,
           str(f32), str(tmp), qtype, "2"]
    log = logs / f"llama-quantize-{form}.log"
    with open(log, "w") as fh:
        if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed; see {log}")
    tmp.rename(out)
    return out


def ensure_gguf(demo: Path, cache: Path, form: str, logs: Path) -> Path:
    """The demo as a GGUF whose layer matrices are all ``form`` (``cache/SmolLM2-135M-Instruct.FORM.gguf``)."""
    out = cache / f"SmolLM2-135M-Instruct.{form}.gguf"
    if out.is_file():
        return out
    print(f"making {out.name} ...", flush=True)
    if form not in BY_LLAMA_QUANTIZE:
        return write_gguf(demo, out, form)
    f32 = cache / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.is_file():
        write_gguf(demo, f32, "F32")
    return llama_quantize(f32, out, form, logs)


def tensor_types(path: Path) -> dict[str, int]:
    """Tensors per GGML type in GGUF ``path``."""
    import gguf

    return dict(Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in read_gguf_file(str(path)).tensors))


def same_tensors(a: Path, b: Path) -> bool:
    """Whether GGUFs ``a`` and ``b`` hold the same tensors: names, types and bytes."""
    ta, tb = read_gguf_file(str(a)).tensors, read_gguf_file(str(b)).tensors
    return len(ta) == len(tb) and all(x.name == y.name and x.tensor_type == y.tensor_type
                                      and np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(ta, tb))


# ---------------------------------------------------------------- what runs: the compiled model

def fully_connected(compiled) -> dict:  # noqa: ANN001 - an ov.CompiledModel
    """The CPU plugin's FullyConnected nodes in ``compiled.get_runtime_model()``: {"nodes": count,
    "weights": {element type of the weight input, with " gN" when the node has a decompression scale input of
    one scale per N weights of a row (the compressed-weight FullyConnected, weights decompressed inside the
    kernel): count}, "runtime_precision": {runtimePrecision: count}, "decompression_inputs": such nodes}."""
    weights, precision, decompression, nodes = Counter(), Counter(), 0, 0
    for node in compiled.get_runtime_model().get_ordered_ops():
        rt = node.get_rt_info()
        if "layerType" not in rt or rt["layerType"].astype(str) != "FullyConnected":
            continue
        nodes += 1
        inputs = node.inputs()
        kind = inputs[1].get_element_type().get_type_name()
        if len(inputs) > 3 and inputs[3].get_element_type().get_type_name() != "dynamic":  # [rows, groups] scales
            decompression += 1
            kind += f" g{inputs[1].get_partial_shape()[-1].get_length() // inputs[3].get_partial_shape()[-1].get_length()}"
        weights[kind] += 1
        precision[rt["runtimePrecision"].astype(str)] += 1
    return {"nodes": nodes, "weights": dict(weights), "runtime_precision": dict(precision),
            "decompression_inputs": decompression}


# ---------------------------------------------------------------- decode speed

class Config:
    """One build at one inference precision, compiled in this process, and its timed steps per round."""

    def __init__(self, form: str, build: Path, precision: str, threads: int) -> None:
        from fleet_common.manifest import load_manifest

        self.form, self.build, self.precision = form, build, precision
        self.model = Whole(build / load_manifest(build).manifest.stages[0].xml, threads, precision)
        self.runtime = fully_connected(self.model.compiled)
        self.runs: list[list[float]] = []  # per round: ms per step
        self.top1: list[list[int]] = []

    @property
    def name(self) -> str:
        """``FORM @PRECISION``."""
        return f"{self.form} @{self.precision}"


def time_decode(configs: list[Config], tokens: list[int], steps: int, rounds: int) -> list[float]:
    """Prefill every config to ``CONTEXT`` tokens, keep its KV, warm up; then ``rounds`` rounds of ``steps``
    teacher-forced steps from that KV, one step of each config in turn (rotated by one each round).
    Returns the load average after each round."""
    saved = {}
    for c in configs:
        kv, _ = prefill(c.model, tokens, [CONTEXT], WARM_UP_STEPS, CONTEXT + steps)
        saved[c.name] = kv[CONTEXT]
    loadavg = []
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        ms, top1 = {c.name: [] for c in configs}, {c.name: [] for c in configs}
        for c in order:
            load_kv(c.model, saved[c.name], CONTEXT)
        gc.collect()
        for pos in range(CONTEXT, CONTEXT + steps):
            for c in order:
                t, m = step(c.model, tokens, pos)
                top1[c.name].append(t)
                ms[c.name].append(m)
        for c in configs:
            c.runs.append(ms[c.name])
            c.top1.append(top1[c.name])
        loadavg.append(os.getloadavg()[0])
        print(f"  round {r + 1}/{rounds}, load average {loadavg[-1]:.2f}", flush=True)
    return loadavg


def speed_cells(configs: list[Config]) -> dict[str, dict[str, dict]]:
    """{form: {precision: {"ms", "over_fp16", "top1_same_as_fp16"}}}: the median step, the median over
    rounds of (this config's median / fp16's at the same precision), the share of steps ranking fp16's top
    token first."""
    ref = {c.precision: c for c in configs if c.form == REFERENCE}
    cells: dict[str, dict[str, dict]] = {}
    for c in configs:
        r = ref[c.precision]
        same = [a == b for ra, rb in zip(c.top1, r.top1) for a, b in zip(ra, rb)]
        cells.setdefault(c.form, {})[c.precision] = {
            "ms": statistics.median(m for run in c.runs for m in run),
            "over_fp16": statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(c.runs, r.runs)),
            "top1_same_as_fp16": sum(same) / len(same)}
    return cells


# ---------------------------------------------------------------- memory, quality

def worker_memory(builds: dict[str, Path], tokens: list[int], steps: int, logs: Path) -> tuple[dict, int]:
    """{form: {precision: worker row}} of a real ``fleet-worker`` serving each 1-stage build (one thread,
    the IR compiled: no blob, no model cache) through one session of ``CONTEXT`` + ``steps`` tokens
    (``bench/kernels/worker_memory.py``), each row with ``own_bytes`` = RSS - the runtime's - mapped ``.bin``; and
    the runtime's RSS (a worker process that loaded nothing)."""
    from bench.kernels.worker_memory import runtime_baseline
    from bench.kernels.worker_memory import worker_memory as serve

    baseline = runtime_baseline()
    out: dict[str, dict] = {}
    for form, build in builds.items():
        for precision in PRECISIONS:
            flags = ["--no-blobs", "--no-model-cache", "--threads", "1", "--inference-precision", precision]
            row = serve(build, tokens, CONTEXT, steps, flags, logs)[0]
            row["own_bytes"] = row["rss_bytes"] - baseline - row["mapped_weights_bytes"]
            out.setdefault(form, {})[precision] = row
            print(f"  {form} @{precision}: peak RSS {row['peak_rss_bytes'] / MB:.0f} MB", flush=True)
    return out, baseline


def quality(builds: dict[str, Path]) -> dict[str, dict]:
    """{form: {"perplexity", "ppl_increase", "agreement", "identical", "prompts"}} against the fp16 build
    (``compiler.quality.compare``, cached in each build's quality.json)."""
    from compiler.quality import compare, measure

    ref = measure(builds[REFERENCE])
    out = {REFERENCE: {"perplexity": ref.perplexity, "ppl_increase": 0.0, "agreement": 1.0,
                       "identical": len(ref.greedy), "prompts": len(ref.greedy)}}
    for form, build in builds.items():
        if form != REFERENCE:
            mine, c = compare(build, builds[REFERENCE])
            out[form] = {"perplexity": mine.perplexity, "ppl_increase": c.ppl_increase, "agreement": c.agreement,
                         "identical": c.identical, "prompts": c.prompts}
        print(f"  {form}: perplexity {out[form]['perplexity']:.3f}", flush=True)
    return out


# ---------------------------------------------------------------- report

def form_rows(forms: list[str], facts: dict[str, dict], speed: dict, memory: dict, qual: dict) -> list[dict]:
    """One row per build (fp16 first): ``facts[form]`` (``bin_bytes``, ``gguf_types``, ``compression``,
    ``runtime`` per precision, ...) with its speed cells, worker rows and quality merged in."""
    return [{"form": f, **facts[f], "speed": speed.get(f, {}), "memory": memory.get(f, {}), "quality": qual.get(f)}
            for f in [REFERENCE, *forms]]


def _fc(runtime: dict) -> str:
    """FullyConnected weight types, e.g. ``u4 210, i8 1`` (``fully_connected``)."""
    return ", ".join(f"{t} {n}" for t, n in sorted(runtime["weights"].items(), key=lambda kv: -kv[1]))


def table(rows: list[dict]) -> str:
    """The markdown table of ``form_rows``: one row per build, speed ratios against fp16 at the same
    precision, peak worker RSS at the default precision / f32, own = RSS - runtime - mapped .bin."""
    out = []
    for r in rows:
        q, s, m = r["quality"], r["speed"], r["memory"]
        qual = [f"{q['perplexity']:.3f}", f"{q['ppl_increase']:+.2%}",
                f"{q['agreement']:.3f}, {q['identical']}/{q['prompts']}"] if q else [None] * 3
        cells = [x for p in PRECISIONS for x in ((f"{s[p]['ms']:.2f}", f"{s[p]['over_fp16']:.2f}") if p in s
                                                 else (None, None))]
        mem = [" / ".join(f"{m[p][k] / MB:.0f}" if p in m else "-" for p in PRECISIONS)
               for k in ("peak_rss_bytes", "own_bytes")]
        fc = " / ".join(_fc(r["runtime"][p]) for p in PRECISIONS if p in r["runtime"]) or None
        out.append([r["label"], f"{r['bin_bytes'] / MB:.0f}", fc, *qual, *cells, *mem])
    return harness.table(["build", "stage .bin MB", "FullyConnected weights (default / f32)", "perplexity",
                          "vs fp16", "agreement", "ms/token default", "x fp16", "ms/token f32", "x fp16",
                          "peak RSS MB default / f32", "own MB default / f32"], out)


def run_speed(builds: dict[str, Path], tokens: list[int], args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Compile every build at both precisions, time decode (``time_decode``): (speed cells, runtime facts
    {form: {precision: fully_connected}}, timing facts for the JSON)."""
    print(f"compiling {len(builds)} builds x {len(PRECISIONS)} precisions, {args.threads} thread(s) ...", flush=True)
    configs = [Config(f, b, p, args.threads) for f, b in builds.items() for p in PRECISIONS]
    print(f"decode: {len(configs)} configurations, {args.rounds} rounds of {args.steps} steps at {CONTEXT} tokens",
          flush=True)
    t0 = time.perf_counter()
    loadavg = time_decode(configs, tokens, args.steps, args.rounds)
    timing = {"seconds": time.perf_counter() - t0, "loadavg_per_round": loadavg,
              "runs": {c.name: c.runs for c in configs}}
    runtime: dict[str, dict] = {}
    for c in configs:
        runtime.setdefault(c.form, {})[c.precision] = c.runtime
    cells = speed_cells(configs)
    del configs
    gc.collect()
    return cells, runtime, timing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options, ``forms`` as a list; argparse's usage error for a bad value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every row, run and fact here")
    parser.add_argument("--forms", default=",".join(FORMS), help="kept GGUF types, comma-separated")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (every configuration in turn)")
    parser.add_argument("--threads", type=int, default=1, help="inference threads")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the worker memory part")
    parser.add_argument("--no-quality", dest="quality", action="store_false", help="skip perplexity/agreement")
    parser.add_argument("--hf", type=Path, help="demo HF folder (default: the tests' copy, else fetched into CACHE)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE / "gguf-forms",
                        help="GGUFs and builds are kept here")
    args = parser.parse_args(argv)
    args.forms = args.forms.split(",")
    if bad := [f for f in args.forms if f not in FORMS]:
        parser.error(f"unknown form(s) {bad}; choose from {', '.join(FORMS)}")
    if args.steps < 1 or args.rounds < 1:
        parser.error("need --steps >= 1 and --rounds >= 1")
    return args


def make_builds(hf: Path, demo: Path, forms: list[str], cache: Path) -> tuple[dict[str, Path], dict[str, dict]]:
    """The fp16 build of ``hf`` and a 1-stage build of each form's GGUF (made from ``demo``): ({form: build},
    {form: facts}: label, stage bytes, compression, weights and, for a GGUF, its size and tensor types)."""
    ggufs = {f: ensure_gguf(demo, cache, f, cache / "logs") for f in forms}
    builds = {REFERENCE: harness.ensure_build(hf, cache, 1)}
    builds |= {f: harness.ensure_build(g, cache, 1) for f, g in ggufs.items()}
    facts = {}
    for f, b in builds.items():
        stage = json.loads((b / "manifest.json").read_text())["stages"][0]
        facts[f] = {"label": "fp16 (HF folder)" if f == REFERENCE else f"{f} GGUF", "build": str(b),
                    "bin_bytes": (b / stage["bin"]).stat().st_size, "compression": stage.get("compression"),
                    "weights": stage["weights"]}
        if f != REFERENCE:
            facts[f] |= {"gguf": str(ggufs[f]), "gguf_bytes": ggufs[f].stat().st_size,
                         "gguf_types": tensor_types(ggufs[f])}
    if "Q4_1" in ggufs:
        facts["Q4_1"]["same_as_demo"] = same_tensors(ggufs["Q4_1"], demo)
    return builds, facts


def main(argv: list[str] | None = None) -> int:
    """Make the GGUFs and builds, measure them (module docstring); prints the table, writes ``--json``."""
    args = parse_args(argv)
    from compiler.quality import EVAL_TEXT
    from coordinator.tokenizer import ChatTokenizer

    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    hf = harness.demo_hf(args.hf, cache.parent)
    demo = harness.demo_gguf(hf)
    builds, facts = make_builds(hf, demo, args.forms, cache)
    tokens = ChatTokenizer(builds[REFERENCE]).encode(EVAL_TEXT.read_text())
    qual = {}
    if args.quality:
        print("quality against fp16 (f32 inference) ...", flush=True)
        qual = quality(builds)
    speed, runtime, timing = run_speed(builds, tokens, args)
    for f in builds:
        facts[f]["runtime"] = runtime[f]
    memory, baseline = {}, 0
    if args.memory:
        print("worker memory ...", flush=True)
        memory, baseline = worker_memory(builds, tokens, args.steps, logs)
    rows = form_rows(args.forms, facts, speed, memory, qual)
    print(f"\n1 stage, decode at {CONTEXT} tokens of context, {args.threads} thread(s), median of {args.rounds} x "
          f"{args.steps} steps taking turns; x fp16 at the same precision (median paired ratio); runtime of a "
          f"worker that loaded nothing: {baseline / MB:.0f} MB\n")
    print(table(rows))
    if "Q4_1" in facts:
        print(f"\nQ4_1 GGUF made here holds the demo's own tensors: {facts['Q4_1']['same_as_demo']}")
    harness.write_json(args.json, "gguf_forms", {
        "model": "SmolLM2-135M-Instruct", "context": CONTEXT, "steps": args.steps, "rounds": args.rounds,
        "threads": args.threads, "demo_gguf": str(demo), "runtime_baseline_bytes": baseline, "rows": rows,
        "timing": timing}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
