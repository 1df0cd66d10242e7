"""Peak memory of ``fleet-compiler build`` on a model with Llama-3-8B layer dimensions, beside the old
torch path's on the same model, and a 4-stage fleet of it answering through real workers; or
(``--source qwen3-30b-a3b``) on a Mixture-of-Experts GGUF of Qwen3-30B-A3B's shape.

    python bench/builds/build_memory.py --json results.json        # ~20 minutes on 2 cores, ~17 GB of disk
    python bench/builds/build_memory.py --source qwen3-30b-a3b --layers 4 --shards 2 --no-fleet --json moe.json

1. **The model**: a synthetic Llama with Llama-3.1-8B's dimensions (hidden 4096, 32 query and 8 KV
   heads, head 128, intermediate 14336, vocabulary 128256, untied head, ``llama3`` RoPE scaling) and
   ``--layers`` of its 32 layers (default 10: 6.4 GB of bf16), random bf16 weights, written as HF
   shards it (``model-0000N-of-0000M.safetensors`` of at most 2 GB + ``model.safetensors.index.json``),
   with a word-level tokenizer of 128256 tokens and a chat template, so a fleet can serve it.
2. **Builds**: ``fleet-compiler build --shards 4``, fp16, ``--weights int8`` and ``int4``, each a separate
   process whose peak RSS is sampled (psutil, every 50 ms, the process and its children) and read
   from ``/usr/bin/time -v``'s "Maximum resident set size". The goal: peak <= 1.25 x the largest
   stage's output + 1 GiB.
3. **The old path** (``--old-ref``, default the last commit before the builder): the same build by the
   torch exporter (transformers loads the whole model in f32, then each stage is traced), from a git
   worktree of that commit, killed when its RSS passes ``--old-cap-gib`` (it would need ~3x the bf16
   model); the table shows its peak or where it was stopped.
4. **The fleet**: the int8 build served by 4 ``fleet-worker`` processes (no mDNS, loopback) and a
   coordinator; one chat request of ``--tokens`` tokens; each worker's peak RSS.

``--source qwen3-30b-a3b``: instead of 1., ``bench/real_gguf.py``'s random F16 GGUF of Qwen3-30B-A3B's shape
(hidden 2048, 128 experts of 768 a layer, 8 chosen, 32/4 heads of 128, untied head; the demo's 49,152-token
vocabulary) with ``--layers`` layers (default 4: 1.2 GB of stacked experts a layer, 5.2 GB in all), made once
into real_gguf's cache; built as 2. (``--shards``), with no old path (the torch exporter built no MoE).

Prints a table; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench import harness

ROOT = harness.ROOT

GIB = 1 << 30
OLD_REF = "d507294"  # the last commit whose fleet-compiler built through torch
DIMS = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 128256}
SHARD_BYTES = 2 * 10**9
MOE_SOURCE = "qwen3-30b-a3b"  # bench/real_gguf.py's shape


def _bf16_noise(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random bf16 bit patterns [shape] uint16 of magnitude 2^-10..2^-6 (a trained model's weight scale),
    random sign: every tensor distinct (the IR writer deduplicates identical constants)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    exponent = (117 + (bits >> 13) % 5).astype(np.uint16)  # 2^(e-127)
    return (bits & np.uint16(0x807F)) | (exponent << np.uint16(7))


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> None:
    """Write ``{name: (dtype, shape, raw array)}`` as a safetensors file (the format's header + data)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for _, _, data in tensors.values():
            fh.write(np.ascontiguousarray(data).tobytes())


def make_model(folder: Path, layers: int) -> Path:
    """The synthetic model in ``folder`` (reused when its index is there). Returns ``folder``."""
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    h, kv, i, v = DIMS["hidden_size"], DIMS["num_key_value_heads"] * DIMS["head_dim"], DIMS["intermediate_size"], \
        DIMS["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if size and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            data = np.full(shape, 0x3F80, np.uint16) if name.endswith("norm.weight") else _bf16_noise(rng, shape)
            tensors[name] = ("BF16", shape, data)
            weight_map[name] = file
        _write_safetensors(tmp / file, tensors)
        print(f"  wrote {file} ({sum(t[2].nbytes for t in tensors.values()) / 1e9:.2f} GB)", flush=True)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **DIMS, "num_hidden_layers": layers,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
              "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192},
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(tmp, DIMS["vocab_size"])
    tmp.rename(folder)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>``, then ``w3``...) with
    a plain chat template: enough for a coordinator to serve random weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{n}": n for n in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": template}))


class PeakRSS:
    """Samples the RSS of a process tree every ``interval_s`` (psutil) in a thread, and its anonymous part (RSS
    less the file-backed and shared pages: a memory-mapped source's pages are file-backed); kills the tree when
    it passes ``cap_bytes``."""

    def __init__(self, pid: int, cap_bytes: int | None = None, interval_s: float = 0.05) -> None:
        import psutil

        self.proc, self.cap, self.interval = psutil.Process(pid), cap_bytes, interval_s
        self.peak, self.peak_anon, self.capped_at = 0, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list:
        import psutil

        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _run(self) -> None:
        import psutil

        start = time.monotonic()
        while not self._stop.is_set():
            rss = anon = 0
            for p in self._tree():
                try:
                    info = p.memory_info()
                except psutil.NoSuchProcess:
                    continue
                rss, anon = rss + info.rss, anon + info.rss - info.shared
            self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
            if self.cap and rss > self.cap and self.capped_at is None:
                self.capped_at = time.monotonic() - start
                for p in self._tree():
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
            time.sleep(self.interval)

    def stop(self) -> int:
        """Stop sampling; the peak RSS seen, bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak


def timed_build(cmd: list[str], log: Path, cwd: Path, cap_bytes: int | None = None) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``; return wall s, peak RSS (time -v and sampled), return code."""
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, "PYTHONPATH": str(cwd)})
        sampler = PeakRSS(proc.pid, cap_bytes)
        rc = proc.wait()
        sampled = sampler.stop()
    text = log.read_text(errors="replace")
    maxrss = next((int(line.split(":")[1]) * 1024 for line in text.splitlines()
                   if "Maximum resident set size" in line), 0)
    return {"wall_s": round(time.monotonic() - t0, 1), "returncode": rc, "peak_rss_bytes": max(maxrss, sampled),
            "peak_anonymous_bytes": sampler.peak_anon,
            "killed_at_cap_after_s": None if sampler.capped_at is None else round(sampler.capped_at, 1),
            "log_tail": text.splitlines()[-3:] if rc else []}


def stage_sizes(build: Path) -> list[int]:
    """Each stage's ``.bin`` bytes in ``build``."""
    manifest = json.loads((build / "manifest.json").read_text())
    return [(build / s["bin"]).stat().st_size for s in manifest["stages"]]


def serve(build: Path, logs: Path, tokens: int) -> dict:
    """The build served by one worker per stage and a coordinator on loopback; one chat request."""
    import httpx
    import psutil

    t0 = time.monotonic()
    with harness.Fleet(build, logs, worker_args=("--max-context", "512"), prefix="bm-", worker_timeout_s=900,
                       coordinator=False) as fleet:
        ready_s = time.monotonic() - t0
        _, url = fleet.add_coordinator()
        body = {"messages": [{"role": "user", "content": "w5 w17 w400 w99"}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        t1 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        answer_s = time.monotonic() - t1
        rss = [psutil.Process(p.pid).memory_info().rss for p, _ in fleet.workers]
        reply = r.json()
        return {"status": r.status_code, "workers_ready_s": round(ready_s, 1), "answer_s": round(answer_s, 2),
                "completion_tokens": reply.get("usage", {}).get("completion_tokens"),
                "text": reply.get("choices", [{}])[0].get("message", {}).get("content", r.text)[:200],
                "decode_tokens_per_s": reply.get("fleet", {}).get("decode_tokens_per_s"), "worker_rss_bytes": rss}


def old_worktree(ref: str, where: Path) -> Path:
    """A git worktree of ``ref`` at ``where`` (reused)."""
    if not (where / "compiler" / "export.py").is_file():
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                       capture_output=True)
    return where


def make_source(source: str, work: Path, layers: int) -> tuple[Path, int, dict]:
    """(the model to build, its bytes, its dimensions) for ``--source``: the synthetic Llama (``make_model``) or
    the MoE GGUF (``MOE_SOURCE``, bench/real_gguf.py)."""
    if source == MOE_SOURCE:
        from dataclasses import asdict

        from bench import real_gguf

        print(f"MoE source: {layers} layers of {source}'s shape (real_gguf, F16)", flush=True)
        gguf = real_gguf.ensure(source, "F16", layers)
        return gguf, gguf.stat().st_size, asdict(real_gguf.SHAPES[source]) | {"layers": layers}
    print(f"synthetic model: {layers} layers of Llama-3-8B dimensions in {work / 'model'}", flush=True)
    model = make_model(work / "model", layers)
    return model, sum(p.stat().st_size for p in model.glob("*.safetensors")), DIMS


def main(argv: list[str] | None = None) -> int:
    """Make the model, build it per format (and by the old path), serve the int8 build; prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=("llama-8b", MOE_SOURCE), default="llama-8b",
                    help="the synthetic Llama-3.1-8B-shaped HF folder, or an MoE GGUF of Qwen3-30B-A3B's shape")
    ap.add_argument("--layers", type=int, help="decoder layers of the model (default 10; the MoE 4)")
    ap.add_argument("--shards", type=int, default=4, help="stages to build (default 4)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "models" / "build-memory")
    ap.add_argument("--old-ref", default=OLD_REF, help="git commit of the torch build path ('' to skip)")
    ap.add_argument("--old-cap-gib", type=float, default=16.0, help="stop the old path past this RSS")
    ap.add_argument("--formats", default="fp16,int8,int4", help="weight formats to build (comma-separated)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens the fleet generates")
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the builds (the model is always kept)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    moe = args.source == MOE_SOURCE
    layers = args.layers or (4 if moe else 10)
    model, model_bytes, dims = make_source(args.source, work, layers)
    compiler = [sys.executable, "-m", "compiler.cli", "build", str(model), "--shards", str(args.shards)]
    rows = []
    for label in args.formats.split(","):
        extra = [] if label == "fp16" else ["--weights", label]
        out = work / f"build-{label}"
        print(f"building {label} ...", flush=True)
        run = timed_build([*compiler, *extra, "-o", str(out)], work / f"build-{label}.log", ROOT)
        sizes = stage_sizes(out) if run["returncode"] == 0 else []
        goal = 1.25 * max(sizes) + GIB if sizes else None
        rows.append({"path": "builder", "weights": label, **run, "stage_bytes": sizes, "goal_bytes": goal,
                     "meets_goal": bool(goal and run["peak_rss_bytes"] <= goal)})
    if args.old_ref and not moe:
        tree = old_worktree(args.old_ref, work / "old-tree")
        print(f"building fp16 with the torch path of {args.old_ref} (stopped past {args.old_cap_gib} GiB) ...",
              flush=True)
        run = timed_build([sys.executable, "-m", "compiler.cli", "build", str(model), "--shards", str(args.shards),
                           "-o", str(work / "build-old")], work / "build-old.log", tree, int(args.old_cap_gib * GIB))
        rows.append({"path": f"torch ({args.old_ref})", "weights": "fp16", **run,
                     "stage_bytes": stage_sizes(work / "build-old") if run["returncode"] == 0 else []})
        shutil.rmtree(work / "build-old", ignore_errors=True)
    int8 = next((r for r in rows if r["weights"] == "int8" and r["path"] == "builder"), None)
    fleet = None if args.no_fleet or not int8 or int8["returncode"] else serve(work / "build-int8", work, args.tokens)

    what = "F16 GGUF of Qwen3-30B-A3B's shape" if moe else "bf16 safetensors"
    print(f"\nmodel: {model_bytes / 1e9:.2f} GB of {what}, {layers} layers, {args.shards} stages")
    print(f"{'path':<18} {'weights':>7} {'wall s':>7} {'peak RSS GiB':>13} {'anonymous':>9} {'largest stage GiB':>18} "
          f"{'goal GiB':>9} {'peak/goal':>9}")
    for r in rows:
        largest = max(r["stage_bytes"]) / GIB if r["stage_bytes"] else float("nan")
        goal = r.get("goal_bytes")
        peak = f"{r['peak_rss_bytes'] / GIB:.2f}" + ("" if r["killed_at_cap_after_s"] is None else
                                                     f" (stopped at {r['killed_at_cap_after_s']} s)")
        print(f"{r['path']:<18} {r['weights']:>7} {r['wall_s']:>7} {peak:>13} {r['peak_anonymous_bytes'] / GIB:>9.2f} "
              f"{largest:>18.2f} "
              f"{goal / GIB if goal else float('nan'):>9.2f} {r['peak_rss_bytes'] / goal if goal else float('nan'):>9.2f}")
    for r in rows:
        if r["returncode"] and r["killed_at_cap_after_s"] is None:
            print(f"{r['path']} {r['weights']} failed (exit {r['returncode']}): " + " | ".join(r["log_tail"]))
    if fleet:
        print(f"\n4-stage int8 fleet: HTTP {fleet['status']}, {fleet['completion_tokens']} tokens in "
              f"{fleet['answer_s']} s ({fleet['decode_tokens_per_s']} tok/s decode), workers ready after "
              f"{fleet['workers_ready_s']} s, worker RSS GiB "
              + ", ".join(f"{b / GIB:.2f}" for b in fleet["worker_rss_bytes"]))
    harness.write_json(args.json, "build_memory", {"source": args.source, "model_bytes": model_bytes,
                                                   "layers": layers, "shards": args.shards, "dims": dims,
                                                   "builds": rows, "fleet": fleet})
    if not args.keep:
        for label in args.formats.split(","):
            shutil.rmtree(work / f"build-{label}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
