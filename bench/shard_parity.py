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
  SDPA``, the graph the CPU plugin does not fuse; design.md §4). Same weights, same outputs at batch 1.

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

    python bench/shard_parity.py [--json PATH] [--quick] [--formats fp16,int8,int4] [--contexts 128,1024]
                                 [--steps 32] [--rounds 6] [--threads 0] [--no-memory] [--hf DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain script: make the repo's packages importable

import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402

from compiler.inspect import inspect  # noqa: E402
from compiler.quality import EVAL_TEXT, StageChain  # noqa: E402
from fleet_common.manifest import MANIFEST_NAME, load_manifest, sha256_file  # noqa: E402
from fleet_common.runtime import compile_ir  # noqa: E402

BIN = Path(sys.executable).parent
FORMATS = ("fp16", "int8", "int4")
STAGES = (1, 2, 3)
TEST_MODELS = Path(os.environ.get("FLEET_TEST_MODELS", ROOT / "models" / "test"))  # tests/conftest.py's cache
# What a stage's IR is made by; the split (compiler/plan.py) and build.py's orchestration are left out of
# the cache key so that work on the planner does not rebuild 9 models: the table shows each stage's layers.
COMPILER_FILES = ("export.py", "compress.py", "source.py")
TARGET_PARITY = 1.05  # N-stage / whole, at most
TARGET_NO_HINTS = 1.5  # no-hints / hints, at least
TARGET_MEMORY = 1.25  # worker RSS / (shard weights + KV), at most
WARM_UP_STEPS = 8  # untimed decode steps after each prefill
PREFILL_CHUNK = 256  # tokens per Forward when filling a worker's KV (the coordinator's default is 64: fewer calls)


# ---------------------------------------------------------------- builds, cached between runs

def compiler_key() -> str:
    """Builds are cached per version of the exporter, compressor and model loader (``COMPILER_FILES``)."""
    return hashlib.sha256(b"".join((ROOT / "compiler" / n).read_bytes() for n in COMPILER_FILES)).hexdigest()[:8]


def ensure_build(hf: Path, cache: Path, shards: int, weights: str) -> Path:
    """``fleet-compiler build HF --shards N --weights F`` into ``cache`` unless already there."""
    out = cache / f"smollm2-{shards}stage-{weights}-{compiler_key()}"
    if not (out / MANIFEST_NAME).is_file():
        cmd = [str(BIN / "fleet-compiler"), "build", str(hf), "--shards", str(shards), "--weights", weights,
               "-o", str(out)]
        print(f"building {out.name} ...", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        print(f"  built in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


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
    core = ov.Core()
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


# ---------------------------------------------------------------- in-process decode

class Whole:
    """The unsharded model's IR fed directly from numpy, the reference: no fleet runtime in between.
    Same interface as ``compiler.quality.StageChain``."""

    def __init__(self, xml: Path, threads: int) -> None:
        compiled, _, _ = compile_ir(xml, "CPU", threads)
        self.request = compiled.create_infer_request()

    def start(self, max_context: int) -> None:
        self.request.reset_state()

    def forward(self, ids: list[int], position: int, logits_index: np.ndarray) -> np.ndarray:
        seq = len(ids)
        return self.request.infer({
            "input_ids": np.asarray([ids], dtype=np.int64),  # [1, S]
            "attention_mask": np.ones((1, position + seq), dtype=np.int64),  # [1, P+S]
            "position_ids": np.arange(position, position + seq, dtype=np.int64)[None, :],  # [1, S]
            "beam_idx": np.zeros(1, dtype=np.int32),  # [1]
            "logits_index": logits_index,  # [K]
        })[0][0]  # [K, V]


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
        if not self.stages:
            return f"{self.weights} whole"
        return f"{self.weights} {self.stages}-stage" + ("" if self.hints else " no-hints")

    @property
    def fused(self) -> bool:
        return all(f["fused"] for f in self.fusion)

    def fusion_text(self) -> str:
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


def requests(model: Whole | StageChain) -> list[ov.InferRequest]:
    """The stateful infer requests whose KV state ``model`` decodes with (one per stage)."""
    return model.requests if isinstance(model, StageChain) else [model.request]


def save_kv(model: Whole | StageChain) -> list[dict[str, np.ndarray]]:
    """A copy of every KV state of ``model``, per stage: {state name: [1, kv_heads, slots, head_dim]}."""
    return [{s.name: s.state.data.copy() for s in r.query_state()} for r in requests(model)]


def load_kv(model: Whole | StageChain, saved: list[dict[str, np.ndarray]], length: int) -> None:
    """Put ``saved`` (``length`` slots, all visible) back into ``model``'s KV states, as
    ``fleet_common.runtime.compact`` writes a state."""
    for request, kv in zip(requests(model), saved):
        for state in request.query_state():
            state.state = ov.Tensor(kv[state.name])  # copied
    for session in getattr(model, "sessions", []):
        session.length = length
        session.visible[:] = 0
        session.visible[:, :length] = 1


LAST = np.zeros(1, dtype=np.int64)  # logits_index of a one-token step


def step(model: Whole | StageChain, tokens: list[int], pos: int) -> tuple[int, float]:
    """One teacher-forced decode step at KV length ``pos`` (feeds ``tokens[pos]``): (argmax, ms)."""
    t0 = time.perf_counter()
    logits = model.forward(tokens[pos:pos + 1], pos, LAST)  # [1, V]
    top1 = int(logits[0].argmax())
    return top1, (time.perf_counter() - t0) * 1000


def decode(model: Whole | StageChain, tokens: list[int], start: int, steps: int) -> dict:
    """``steps`` decode steps from KV length ``start``: {"ms": [per step], "top1": [argmax per step]}."""
    top1, ms = zip(*(step(model, tokens, pos) for pos in range(start, start + steps)))
    return {"ms": list(ms), "top1": list(top1)}


def prefill(model: Whole | StageChain, tokens: list[int], contexts: list[int], steps: int,
            max_context: int) -> tuple[dict, dict]:
    """Prefill to each context in turn (one chunk), keep a copy of the KV there, and decode ``steps``
    from it (untimed warm-up). Returns ({context: saved KV}, {context: {"prefill_ms", "ms", "top1"}})."""
    model.start(max_context)
    saved, run, pos = {}, {}, 0
    for ctx in contexts:
        t0 = time.perf_counter()
        model.forward(tokens[pos:ctx], pos, np.array([ctx - pos - 1], dtype=np.int64))
        prefill_ms = (time.perf_counter() - t0) * 1000
        saved[ctx] = save_kv(model)
        run[ctx] = {"prefill_ms": prefill_ms, **decode(model, tokens, ctx, steps)}
        pos = ctx + steps
    return saved, run


def measure(configs: list[Config], tokens: list[int], contexts: list[int], steps: int, rounds: int) -> list[float]:
    """Prefill the whole model and every hinted chain, keeping their KV at each context; a no-hints
    chain starts from its hinted twin's (same weights, same state names: a prefill saved, and the
    slowest one). Warm every config up, then ``rounds`` rounds (rotated by one config each round)
    of decoding from the saved KV at each context, step by step in turn over the configs of one weight
    format; returns the load average after each round."""
    print(f"prefill and warm-up: {len(configs)} configurations ...", flush=True)
    max_context = contexts[-1] + steps
    warm_up = min(steps, WARM_UP_STEPS)
    saved = {}
    for c in configs:
        if c.hints:
            saved[c.name], c.prefilled = prefill(c.model, tokens, contexts, warm_up, max_context)
    hinted = {(c.weights, c.stages): c for c in configs if c.hints}
    for c in configs:
        if not c.hints:
            twin = hinted[(c.weights, c.stages)]
            saved[c.name], c.prefilled = saved[twin.name], twin.prefilled
            c.model.start(max_context)
            for ctx in contexts:
                load_kv(c.model, saved[c.name][ctx], ctx)
                decode(c.model, tokens, ctx, warm_up)
    loadavg = []
    groups = [[c for c in configs if c.weights == w] for w in dict.fromkeys(c.weights for c in configs)]
    for r in range(rounds):
        t0 = time.perf_counter()
        for group in groups:
            runs = {c.name: {} for c in group}
            order = group[r % len(group):] + group[: r % len(group)]
            for ctx in contexts:
                for c in order:
                    load_kv(c.model, saved[c.name][ctx], ctx)
                    runs[c.name][ctx] = {"ms": [], "top1": []}
                gc.collect()
                for pos in range(ctx, ctx + steps):  # one step of each config in turn: a burst of load hits all
                    for c in order:
                        top1, ms = step(c.model, tokens, pos)
                        runs[c.name][ctx]["top1"].append(top1)
                        runs[c.name][ctx]["ms"].append(ms)
            for c in group:
                c.runs.append(runs[c.name])
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


# ---------------------------------------------------------------- worker memory

def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (= RssAnon + RssFile + RssShmem), its parts and VmHWM (peak RSS) of ``pid`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def mapped_weights(pid: int) -> int:
    """Resident bytes of ``pid``'s mappings of weight files (an IR's ``.bin``, a compiled ``.blob``): page
    cache the kernel can drop and re-read, counted in RSS while mapped."""
    total, weights = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                weights = line.rstrip().endswith((".bin", ".blob"))
            elif weights and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def runtime_baseline() -> int:
    """VmRSS of a worker process that has loaded nothing: Python, gRPC, the worker's modules and
    OpenVINO's CPU plugin (loaded by asking the device for a property)."""
    code = ("import openvino as ov, worker.cli, worker.server; "
            "ov.Core().get_property('CPU', 'FULL_DEVICE_NAME'); "
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) * 1024


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc`` (a worker we started), SIGKILL if it is still there after 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def worker_memory(build: Path, tokens: list[int], context: int, steps: int, flags: list[str],
                  logs: Path) -> list[dict]:
    """Serve every stage of ``build`` with a real ``fleet-worker`` (``--no-announce`` and ``flags``),
    run one session through the chain as the speed part does (prefill to ``context`` in chunks of
    ``PREFILL_CHUNK``, then ``steps`` one-token steps), and read each worker's memory; one row per stage."""
    import grpc

    from fleet_common import fleet_pb2 as pb
    from fleet_common import fleet_pb2_grpc as pb_grpc
    from fleet_common.wire import to_tensor

    loaded = load_manifest(build)
    stages = loaded.manifest.stages
    procs: list[subprocess.Popen] = []
    channels: list[grpc.Channel] = []
    try:
        addresses, ready = [], []
        for s in stages:
            log = logs / f"shard-parity-{build.name}-worker{s.index}.log"
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(
                    [str(BIN / "fleet-worker"), "--shard", str(s.index), "--model", str(build), "--no-announce",
                     *flags], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 180
            while not (m := re.search(r"serving on ([\d.]+:\d+)", log.read_text(errors="replace"))):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {s.index} of {build.name} did not start; see {log}")
                time.sleep(0.1)
            addresses.append(m.group(1))
            ready.append(proc_status(procs[-1].pid)["VmRSS"])
        channels = [grpc.insecure_channel(a, options=[("grpc.max_send_message_length", 64 << 20),
                                                      ("grpc.max_receive_message_length", 64 << 20)])
                    for a in addresses]
        stubs = [pb_grpc.StageStub(ch) for ch in channels]
        sid = "shard-parity-memory"
        for stub in stubs:
            stub.OpenSession(pb.OpenSessionRequest(session_id=sid, max_context=context + steps,
                                                   manifest_sha256=loaded.sha256), timeout=30)
        starts = [*range(0, context, PREFILL_CHUNK), *range(context, context + steps)]
        for step, (pos, end) in enumerate(zip(starts, [*starts[1:], context + steps])):
            chunk = np.asarray([tokens[pos:end]], dtype=np.int64)  # [1, S]
            stubs[0].Forward(pb.ForwardRequest(session_id=sid, step_id=step, stage=0, input=to_tensor(chunk),
                                               past_length=pos, start_position=pos, route=addresses[1:],
                                               logits_count=0, manifest_sha256=loaded.sha256), timeout=120)
        rows = []
        for s, stub, proc, rss0 in zip(stages, stubs, procs, ready):
            info = stub.Info(pb.InfoRequest(), timeout=10)
            mem = proc_status(proc.pid)
            weights = (build / s.bin).stat().st_size
            rows.append({"build": build.name, "weights": loaded.manifest.weights, "stages": len(stages),
                         "stage": s.index, "layers": [s.start, s.end], "weight_bytes": weights,
                         "kv_bytes": info.kv_bytes, "kv_slots": context + steps, "rss_ready_bytes": rss0,
                         "rss_bytes": mem["VmRSS"], "rss_anon_bytes": mem["RssAnon"], "rss_file_bytes": mem["RssFile"],
                         "mapped_weights_bytes": mapped_weights(proc.pid), "peak_rss_bytes": mem["VmHWM"],
                         "load_source": info.load_source})
        for stub in stubs:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        return rows
    finally:
        for ch in channels:
            ch.close()
        for proc in procs:
            stop(proc)


# ---------------------------------------------------------------- report

def speed_table(configs: list[Config], contexts: list[int]) -> tuple[str, list[dict]]:
    """The markdown table (one row per weights, N and context) and its rows for the JSON."""
    by = {(c.weights, c.stages, c.hints): c for c in configs}
    head = ("| weights | N | context | whole ms/tok | N-stage ms/tok | N-stage / whole | no-hints ms/tok "
            "| no-hints / hints | same top-1 as whole | fused: hints / no-hints |")
    lines = [head, "|" + "|".join("---" for _ in head.split("|")[1:-1]) + "|"]
    rows = []
    for weights in dict.fromkeys(c.weights for c in configs):
        whole = by[(weights, 0, True)]
        for n in sorted({c.stages for c in configs if c.stages}):
            hint, bare = by[(weights, n, True)], by[(weights, n, False)]
            for ctx in contexts:
                row = {"weights": weights, "stages": n, "context": ctx, "whole_ms": cell(whole, ctx),
                       "chain_ms": cell(hint, ctx), "chain_over_whole": paired_ratio(hint, whole, ctx),
                       "no_hints_ms": cell(bare, ctx), "no_hints_over_hints": paired_ratio(bare, hint, ctx),
                       "top1_agreement_chain": agreement(hint, whole, ctx),
                       "top1_agreement_no_hints": agreement(bare, whole, ctx),
                       "fused_hints": hint.fused, "fused_no_hints": bare.fused}
                row["parity_met"] = row["chain_over_whole"] <= TARGET_PARITY
                row["no_hints_met"] = row["no_hints_over_hints"] >= TARGET_NO_HINTS
                rows.append(row)
                lines.append(
                    f"| {weights} | {n} | {ctx} | {row['whole_ms']:.2f} | {row['chain_ms']:.2f} | "
                    f"{row['chain_over_whole']:.3f}{'' if row['parity_met'] else ' (miss)'} | "
                    f"{row['no_hints_ms']:.2f} | {row['no_hints_over_hints']:.2f}x"
                    f"{'' if row['no_hints_met'] else ' (miss)'} | "
                    f"{row['top1_agreement_chain']:.0%} / {row['top1_agreement_no_hints']:.0%} | "
                    f"{hint.fusion_text()} / {bare.fusion_text()} |")
    return "\n".join(lines), rows


def memory_table(rows: list[dict], baseline: int) -> str:
    """Markdown table of the workers' RSS against their shard's weights + KV (MiB); ``baseline``: bytes
    of a worker process with nothing loaded."""
    mib = 1 << 20
    head = ("| weights | N | stage | layers | loaded from | shard weights MiB | KV MiB | RSS MiB "
            "| RSS / (weights + KV) | weights file mapped MiB | (RSS - runtime - mapped file) / (weights + KV) |")
    lines = [head, "|" + "|".join("---" for _ in head.split("|")[1:-1]) + "|"]
    for r in rows:
        lines.append(
            f"| {r['weights']} | {r['stages']} | {r['stage']} | {r['layers'][0]}-{r['layers'][1]} | "
            f"{r['load_source']} | {r['weight_bytes'] / mib:.1f} | {r['kv_bytes'] / mib:.1f} | "
            f"{r['rss_bytes'] / mib:.0f} | {r['rss_ratio']:.2f}{'' if r['memory_met'] else ' (miss)'} | "
            f"{r['mapped_weights_bytes'] / mib:.0f} | {r['own_ratio']:.2f} |")
    lines.append(f"\nruntime: a worker process with nothing loaded has {baseline / mib:.0f} MiB RSS")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--cache", type=Path, default=ROOT / "models" / "bench", help="builds are cached here")
    args = parser.parse_args(argv)
    formats = ["fp16"] if args.quick else args.formats.split(",")
    contexts = [128] if args.quick else [int(c) for c in args.contexts.split(",")]
    steps, rounds = (8, 2) if args.quick else (args.steps, args.rounds)
    if bad := [f for f in formats if f not in FORMATS]:
        parser.error(f"unknown weight format(s) {bad}; choose from {', '.join(FORMATS)}")
    if steps < 1 or rounds < 1 or any(b < a + steps for a, b in zip(contexts, contexts[1:])) or contexts[0] < 1:
        parser.error("need --steps >= 1, --rounds >= 1 and contexts that grow by at least --steps each")

    from compiler.source import fetch_demo, is_converted
    from coordinator.tokenizer import ChatTokenizer

    cache = args.cache.resolve()
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    hf = args.hf or next((d for d in (TEST_MODELS / "SmolLM2-135M-Instruct", cache / "SmolLM2-135M-Instruct")
                          if is_converted(d)), cache / "SmolLM2-135M-Instruct")
    hf = fetch_demo(hf)
    builds = {(w, n): ensure_build(hf, cache, n, w) for w in formats for n in STAGES}
    tokens = ChatTokenizer(builds[(formats[0], 1)]).encode(EVAL_TEXT.read_text())
    if len(tokens) < contexts[-1] + steps:
        parser.error(f"the text has {len(tokens)} tokens, fewer than the last context + steps")

    configs = []
    for w in formats:
        configs.append(Config(w, 0, True, builds[(w, 1)]))
        for n in STAGES:
            configs += [Config(w, n, True, builds[(w, n)]), Config(w, n, False, ensure_unhinted(builds[(w, n)]))]
    print(f"shard parity: {', '.join(formats)} x N = 1, 2, 3 x contexts {contexts}, {steps} steps, {rounds} rounds, "
          f"threads {args.threads or 'default'}, nproc {os.cpu_count()}, openvino {ov.get_version()}", flush=True)
    splits = {n: load_manifest(builds[(formats[0], n)]).manifest.stages for n in STAGES}
    print("layers per stage: " + "; ".join(f"{n}-stage " + " + ".join(f"[{s.start}, {s.end})" for s in stages)
                                           for n, stages in splits.items()), flush=True)
    print("checking fusion and compiling ...", flush=True)
    t0 = time.perf_counter()
    fusion: dict[Path, list[dict]] = {}
    for c in configs:
        if c.build not in fusion:  # the whole model and the 1-stage chain share a build
            fusion[c.build] = fusion_of(c.build)
        c.fusion = fusion[c.build]
        loaded = load_manifest(c.build)
        c.model = Whole(c.build / loaded.manifest.stages[0].xml, args.threads) if not c.stages else \
            StageChain(loaded, args.threads, "auto")
    print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
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

    memory_rows, baseline = [], 0
    if args.memory:
        print(f"\nworker memory: one fleet-worker per stage, a session prefilled to {contexts[-1]} tokens and "
              f"{steps} decoded ...", flush=True)
        baseline = runtime_baseline()
        # A worker compiles its IR on its first start and imports it from OpenVINO's model cache on the
        # next ones (a blob is imported the same way): both are measured, the cache in a folder of ours.
        modes = (["--no-blobs", "--no-model-cache"], ["--no-blobs", "--cache-dir", str(cache / "openvino-cache")])
        for build in builds.values():
            for flags in modes:
                flags = [*flags, "--threads", str(args.threads)]
                rows = worker_memory(build, tokens, contexts[-1], steps, flags, logs)
                if "--cache-dir" in flags and any(r["load_source"] != "model-cache" for r in rows):
                    rows = worker_memory(build, tokens, contexts[-1], steps, flags, logs)  # that start filled it
                memory_rows += rows
        for r in memory_rows:
            base = r["weight_bytes"] + r["kv_bytes"]
            r["rss_ratio"] = r["rss_bytes"] / base
            r["own_ratio"] = (r["rss_bytes"] - baseline - r["mapped_weights_bytes"]) / base
            r["memory_met"] = r["rss_ratio"] <= TARGET_MEMORY
        print(f"\nworker memory with one session of {contexts[-1] + steps} tokens (target: RSS <= {TARGET_MEMORY}x "
              "shard weights + KV)\n")
        print(memory_table(memory_rows, baseline))

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
    if args.json:
        core = ov.Core()
        report = {
            "benchmark": "shard_parity", "model": "SmolLM2-135M-Instruct", "command": " ".join(sys.argv),
            "formats": formats, "contexts": contexts, "steps": steps, "rounds": rounds, "threads": args.threads,
            "targets": {"chain_over_whole_max": TARGET_PARITY, "no_hints_over_hints_min": TARGET_NO_HINTS,
                        "rss_over_weights_plus_kv_max": TARGET_MEMORY},
            "targets_met": met,
            "machine": {"nproc": os.cpu_count(), "cpu": core.get_property("CPU", "FULL_DEVICE_NAME"),
                        "cpu_capabilities": core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
                        "platform": platform.platform(), "openvino": ov.get_version()},
            "speed_seconds": speed_s, "loadavg_per_round": loadavg,
            "speed": speed_rows,
            "configs": [{"name": c.name, "weights": c.weights, "stages": c.stages, "hints": c.hints,
                         "build": str(c.build), "fusion": c.fusion,
                         "restore_agreement": {str(ctx): restore_agreement(c, ctx) for ctx in contexts},
                         "warm_up": {str(k): v for k, v in c.prefilled.items()},
                         "runs": [{str(k): v for k, v in run.items()} for run in c.runs]} for c in configs],
            "memory": {"runtime_baseline_bytes": baseline, "rows": memory_rows},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
