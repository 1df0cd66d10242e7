"""Reference models the tests and benchmarks compare fleet with, built from an HF folder with the
compiler's public pieces: the whole model as one stage (the single-device baseline), and an early-exit
draft (the first layers of a model, a separate same-tokenizer draft where no smaller sibling is at hand).
Not part of the product: fleet-compiler builds shards and drafts (compiler/build.py, compiler/draft.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from compiler.compress import WeightSpec
from compiler.export import StageSpec
from compiler.save import Progress, save_stage
from compiler.source import TOKENIZER_FILES, open_source
from compiler.weights import SafetensorsWeights


def save_whole_model(src: Path, xml: Path, kv_cache_precision: str = "f16", logits_index_input: bool = True) -> Path:
    """Build HF folder ``src`` whole (every layer, embedding and head) as one fp16 stage at ``xml``:
    the single-device model of benchmarks and tests. ``logits_index_input=False`` gives logits at every
    position (OpenVINO GenAI's ``LLMPipeline`` contract). Returns ``xml``; raises as ``open_source``."""
    source = open_source(Path(src), Path(xml).parent)
    layers = source.config.num_layers
    Path(xml).parent.mkdir(parents=True, exist_ok=True)
    with Progress(False) as bar:
        save_stage(source.config, source.weights, StageSpec(0, 0, layers, layers), Path(xml), WeightSpec("fp16"),
                   kv_cache_precision, bar, "model", logits_index_input=logits_index_input)
    return Path(xml)


def early_exit_model(src: Path, layers: int, out: Path) -> Path:
    """Save the first ``layers`` decoder layers of HF model ``src`` (with its final norm, LM head and
    tokenizer) as a separate HF model in ``out``: a small same-tokenizer draft where no smaller
    sibling model is at hand (the early-exit draft of LayerSkip, Elhoushi et al. 2024, without its
    fine-tuning, so acceptance is modest). Tensors are copied as stored (safetensors, one file).
    Returns ``out``; raises ``ValueError`` for a bad ``layers``.
    """
    from safetensors.numpy import save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 0 < layers < total:
        raise ValueError(f"an early-exit draft needs 1..{total - 1} layers, got {layers}")
    weights = SafetensorsWeights(src)
    keep = {}
    for name in weights.tensors:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= layers:
            continue
        keep[name] = weights.raw(name)
    config["num_hidden_layers"] = layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:layers]
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and name != "config.json":
            shutil.copy2(src / name, out / name)
    return out
