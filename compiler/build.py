"""``fleet-compiler build``: HF folder or GGUF -> stateful IR shards + tokenizer + manifest."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import openvino as ov

from fleet_common import PROTOCOL_VERSION
from fleet_common.manifest import MANIFEST_NAME, Architecture, Manifest, StageEntry, sha256_file

from .compress import compress, parse_stage_weights, resolve
from .draft import draft_name, export_draft
from .export import StageSpec, export_stage
from .plan import balanced_split, decode_weights, parse_layers
from .quality import REPORT_NAME as QUALITY_REPORT

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")


def load_source(src: Path, workdir: Path):  # noqa: ANN201 - returns (hf model, hf folder)
    """Load ``src`` (an HF folder, or a ``.gguf`` file converted into ``workdir``) as an f32 HF model.

    Raises ``FileNotFoundError`` / ``ValueError`` with the path when the source is not usable.
    """
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(src)
    if src.suffix == ".gguf":
        from .source import gguf_to_hf

        src = gguf_to_hf(src, workdir / "hf")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is neither a .gguf file nor a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return model.eval(), src


def _prepare_output(out: Path) -> None:
    """Clear a previous build in ``out`` (so no stale stage ships); refuse a non-empty non-build folder."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / MANIFEST_NAME).is_file():
        raise ValueError(f"{out} is not empty and holds no fleet build; choose another -o folder")
    log.info("replacing the previous build in %s", out)
    for path in out.iterdir():
        if path.is_dir() and (path.name.startswith("stage_") or path.name == "drafts"):
            shutil.rmtree(path)
        elif path.name in (MANIFEST_NAME, QUALITY_REPORT) or path.name in TOKENIZER_FILES:
            path.unlink()


def build(
    src: Path,
    out: Path,
    shards: int = 2,
    layers: str | None = None,
    kv_cache_precision: str = "f16",
    model_id: str | None = None,
    drafts: tuple[str, ...] = (),
    weights: str = "fp16",
    stage_weights: str | None = None,
    symmetric: bool | None = None,
    group_size: int | None = None,
    ratio: float | None = None,
    draft_weights: str = "fp16",
) -> Manifest:
    """Export ``src`` as ``shards`` stages (or the explicit ``layers`` spec) into ``out``.

    Writes ``stage_<i>/openvino_model.{xml,bin}``, the tokenizer files and ``manifest.json`` with
    the sha256 of every file, plus each of ``drafts`` (``self-int4`` or a model path,
    compiler/draft.py) under ``drafts/<name>/``. Returns the manifest.
    Weights (compiler/compress.py): every stage stores ``weights`` (fp16, int8, int4) unless
    ``stage_weights`` (``"0=int8,1=int4"``) names its own; int4 and int8 take the model's size
    class defaults, overridden by ``symmetric``, ``group_size`` and ``ratio`` (int4 only) where not
    None; model drafts store ``draft_weights`` the same way.
    Raises ``ValueError`` for a bad layer or weights spec, unsupported architecture or a draft whose
    vocabulary differs from the target's.
    """
    out = Path(out)
    names = [draft_name(d) for d in drafts]
    if len(set(names)) != len(names):
        raise ValueError(f"two drafts share a name: {names}")
    _prepare_output(out)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf_dir = load_source(Path(src), Path(tmp))
        cfg = model.config
        num_layers = cfg.num_hidden_layers
        if layers:
            ranges = parse_layers(layers, num_layers)
        else:  # balance the stages' weight reads per token: the LM head counts on the last stage
            heads = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            layer_cost, head_cost = decode_weights(cfg.hidden_size, heads, getattr(cfg, "num_key_value_heads", heads),
                                                   head_dim, cfg.intermediate_size, cfg.vocab_size)
            ranges = balanced_split(num_layers, shards, layer_cost, head_cost)
        overrides = {"symmetric": symmetric, "group_size": group_size, "ratio": ratio}
        formats = {i: weights for i in range(len(ranges))} | parse_stage_weights(stage_weights or "", len(ranges))
        specs = {i: resolve(fmt, model.num_parameters(), **overrides) for i, fmt in formats.items()}
        out.mkdir(parents=True, exist_ok=True)
        # drafts first: a draft with another vocabulary fails the build before the long part
        draft_entries = [export_draft(spec, model, hf_dir, out, kv_cache_precision, Path(tmp), draft_weights,
                                      **overrides) for spec in drafts]
        stages = []
        for index, (start, end) in enumerate(ranges):
            ov_model = compress(export_stage(model, StageSpec(index, start, end, num_layers), kv_cache_precision),
                                specs[index])
            rel = f"stage_{index}/openvino_model"
            (out / f"stage_{index}").mkdir(exist_ok=True)
            ov.save_model(ov_model, out / f"{rel}.xml", compress_to_fp16=True)
            stages.append(StageEntry(index=index, start=start, end=end, xml=f"{rel}.xml", bin=f"{rel}.bin",
                                     weights=specs[index].format, compression=specs[index].parameters()))
            del ov_model
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, out / name)
        if not (out / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{hf_dir} has no tokenizer.json (fast tokenizer) to ship with the build")

    eos = cfg.eos_token_id
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = sorted({t for e in (eos, gen_eos) if e is not None for t in (e if isinstance(e, list) else [e])})
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    files = {
        str(p.relative_to(out)): sha256_file(p)
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = Manifest(
        model_id=model_id or (Path(src).stem if Path(src).suffix == ".gguf" else Path(src).resolve().name),
        architecture=Architecture(
            model_type=cfg.model_type,
            num_layers=num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_position_embeddings,
        ),
        stages=tuple(stages),
        openvino_version=ov.get_version(),
        protocol_version=PROTOCOL_VERSION,
        weights=stages[0].weights if len({s.weights for s in stages}) == 1 else "mixed",
        kv_cache_precision=kv_cache_precision,
        eos_token_ids=tuple(eos_ids),
        files=files,
        drafts=tuple(draft_entries),
    )
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    log.info("wrote %d stage(s) to %s", len(stages), out)
    return manifest
