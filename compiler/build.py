"""``fleet-compiler build``: HF folder or GGUF -> stateful IR shards + tokenizer + manifest, no torch.

The source is opened by compiler/source.py (headers and metadata only). Each stage is built by
compiler/export.py straight from the memory-mapped weights and written at once (compiler/save.py),
one tensor in memory at a time (fp16, int8 and int4 by NNCF's own lowering, a GGUF's own blocks); only
int4 stages with Mixture-of-Experts layers are compressed by NNCF from the fp16 stage IR read back
memory-mapped. So builds peak at about one tensor, not the model (see bench/builds/build_memory.py). The build is
written into a hidden folder beside ``out`` and moved into place only when complete: a failed build
(bad file, full disk, Ctrl-C) leaves ``out`` as it was and nothing half-written.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import openvino as ov

from fleet_common import PROTOCOL_VERSION
from fleet_common.kernels import KERNELS_VERSION
from fleet_common.manifest import (FORMAT_VERSION, KERNELS_FORMAT, MANIFEST_NAME, Architecture, Manifest, StageEntry,
                                   sha256_file)

from .arch import ModelConfig
from .calibrate import Calibration
from .compress import WeightSpec, parse_stage_weights, resolve
from .draft import check_self_draft, draft_name, export_draft
from .export import StageSpec, linear_weights, stage_tensors
from .plan import balanced_split, decode_weights, parse_layers
from .save import BuildError, Progress, disk_errors, human_size, save_stage, stage_fp16_bytes
from .source import TOKENIZER_FILES, Source, open_source
from .sparse_build import Limits, calibrate_on_dense, hold_to_limits
from .sparse_ffn import SparseFfn, check_sparse_ffn
from .weights import WeightsError

log = logging.getLogger(__name__)

def eos_ids(folder: Path, config: ModelConfig) -> tuple[int, ...]:
    """End-of-sequence ids of config.json and generation_config.json together."""
    ids = set(config.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


def estimated_bytes(cfg: ModelConfig, ranges: list[tuple[int, int]], drafts: int) -> int:
    """Bytes a build writes at most: every stage in fp16 (compressed stages pass through fp16 one at a
    time), plus each draft as a whole model."""
    stages = sum(stage_fp16_bytes(cfg, StageSpec(i, a, b, cfg.num_layers)) for i, (a, b) in enumerate(ranges))
    return stages + drafts * cfg.parameters() * 2


def _staging_dir(out: Path) -> Path:
    """A fresh hidden folder beside ``out`` to build into (same filesystem, so it can be renamed).
    Raises ``BuildError`` when ``out``'s folder cannot be written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as exc:
        raise BuildError(f"cannot write the build beside {out}: {exc.strerror or exc} ({exc.filename or out.parent}); "
                         "choose another -o folder") from None
    staging.chmod(0o755)
    return staging


def kept_formats(weights, cfg: ModelConfig, stage: StageSpec) -> dict[str, object]:  # noqa: ANN001
    """What a stage built from a GGUF stores, for the manifest: tensors per stored form (a kept block type,
    f16, f32) and the GGUF types dequantized to f16."""
    from collections import Counter

    from .gguf import KEPT

    names = stage_tensors(cfg, stage)
    kinds = Counter(weights.kind(n) for n in names)
    dequantized = Counter(weights.tensors[n].qtype for n in names
                          if weights.kind(n) == "f16" and weights.tensors[n].qtype not in ("F16", "BF16"))
    return {"source": "gguf", "tensors": dict(sorted(kinds.items())), "kept_types": list(KEPT),
            "dequantized_to_f16": dict(sorted(dequantized.items()))}


def check_layers(weights, cfg: ModelConfig, where: str) -> None:  # noqa: ANN001 - a Source's weights
    """Refuse (``WeightsError``) weights of decoder layers the config does not have: a config cut short
    would otherwise build a truncated model without a word."""
    extra = sorted({int(n.split(".")[2]) for n in weights.tensors
                    if n.startswith("model.layers.") and n.split(".")[2].isdigit()
                    and int(n.split(".")[2]) >= cfg.num_layers})
    if extra:
        raise WeightsError(f"{weights.folder} holds weights of layers {extra[0]}..{extra[-1]}, but {where} says "
                           f"num_hidden_layers {cfg.num_layers}: config and weights do not match")


def _install(staging: Path, out: Path) -> None:
    """Replace ``out`` (absent, empty or a previous fleet build) by the finished ``staging`` build."""
    if out.exists():
        if any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
            raise BuildError(f"{out} is not empty and holds no fleet build; choose another -o folder")
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        log.info("replaced the previous build in %s", out)
    else:
        staging.rename(out)


def stage_ranges(cfg: ModelConfig, shards: int, layers: str | None) -> list[tuple[int, int]]:
    """Layer ranges: ``layers`` ("0:12,12:30") or ``shards`` stages balancing weight reads per token
    (the LM head counting on the last stage; a Mixture-of-Experts layer reads its chosen experts only,
    ``ModelConfig.read_intermediate_size``). Raises ``ValueError`` for a bad spec."""
    if layers:
        return parse_layers(layers, cfg.num_layers)
    layer_cost, head_cost = decode_weights(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           cfg.read_intermediate_size, cfg.vocab_size)
    return balanced_split(cfg.num_layers, shards, layer_cost, head_cost)


def build(
    src: Path,
    out: Path,
    shards: int = 2,
    layers: str | None = None,
    kv_cache_precision: str = "f16",
    model_id: str | None = None,
    drafts: tuple[str, ...] = (),
    weights: str | None = None,
    stage_weights: str | None = None,
    symmetric: bool | None = None,
    group_size: int | None = None,
    ratio: float | None = None,
    draft_weights: str = "fp16",
    progress: bool = False,
    devices: tuple[str, ...] | None = None,
    sparse_ffn: bool = False,
    ffn_sparsity: float | None = None,
    calibration_text: Path | None = None,
    limits: Limits = Limits(),
) -> Manifest:
    """Build ``src`` as ``shards`` stages (or the explicit ``layers`` spec) into ``out``.

    Writes ``stage_<i>/openvino_model.{xml,bin}``, the tokenizer files and ``manifest.json`` with
    the sha256 of every file, plus each of ``drafts`` (``self-int8``/``self-int4`` or a model path,
    compiler/draft.py) under ``drafts/<name>/``. Returns the manifest.
    Weights (compiler/compress.py): every stage stores ``weights`` (fp16, int8, int4) unless
    ``stage_weights`` (``"0=int8,1=int4"``) names its own; int4 and int8 take the model's size
    class defaults, overridden by ``symmetric``, ``group_size`` and ``ratio`` (int4 only) where not
    None; model drafts store ``draft_weights`` the same way. ``progress``: a progress bar on stderr.
    ``devices`` (one per stage, e.g. a plan's; None: every stage on the CPU): a GGUF's CPU stages multiply its
    blocks as they lie in the file with fleet's kernels (fleet_common/kernels.py), an HF folder's fp16 CPU stages
    its matrices as stored (F16, BF16, F32); GPU/NPU stages keep OpenVINO's own forms (the GPU plugin runs no
    CPU extension op). ``sparse_ffn`` (ReLU) or ``ffn_sparsity`` S (SwiGLU; thresholds calibrated on
    ``calibration_text``, the build held to ``limits``): each dense MLP computes only the neurons that fire
    (compiler/sparse_ffn.py, compiler/sparse_build.py; ``SparseFfnError``, ``BuildError`` where it cannot).
    Raises ``ValueError`` (``UnsupportedModel``, ``WeightsError``, ``BuildError``, ``VocabularyMismatch``)
    for a bad layer or weights spec, an unsupported architecture, a corrupt, truncated or missing weights
    file, weights that do not match the config, a full disk or a draft with another vocabulary; ``out``
    is left as it was.
    """
    out = Path(out)
    _check_output(out, drafts)
    with tempfile.TemporaryDirectory() as tmp:
        source = open_source(Path(src), Path(tmp))
        cfg = source.config
        ranges = _checked_ranges(source, shards, layers, drafts)
        overrides = {"symmetric": symmetric, "group_size": group_size, "ratio": ratio}
        specs, keep_stage = _stage_specs(source, len(ranges), weights, stage_weights, overrides)
        kernels = _on_kernels(source, specs, keep_stage, devices)
        staging = _staging_dir(out)
        dense = staging.with_name(staging.name.replace(".partial-", ".dense-"))  # a sparse build's reference
        try:
            sparse, calibration = _sparse_ffn(
                cfg.mlp_act, all(kernels), sparse_ffn, ffn_sparsity, calibration_text, dense,
                lambda d: build(src, d, shards, layers, kv_cache_precision, weights=weights,
                                stage_weights=stage_weights, devices=devices, **overrides))
            _check_space(estimated_bytes(cfg, ranges, len(drafts)), staging, out)
            with Progress(progress) as bar:
                # drafts first: a draft with another vocabulary fails the build before the long part
                draft_entries = [export_draft(spec, source, staging, kv_cache_precision, Path(tmp), bar,
                                              draft_weights, **overrides) for spec in drafts]
                stages = [_write_stage(source, StageSpec(i, a, b, cfg.num_layers), specs[i], keep_stage[i],
                                       kernels[i], staging, kv_cache_precision, bar, sparse)
                          for i, (a, b) in enumerate(ranges)]
            with disk_errors(staging / MANIFEST_NAME):
                _copy_tokenizer(source.folder, staging)
                manifest = _manifest(staging, cfg, src, model_id, stages, draft_entries, kv_cache_precision,
                                     eos_ids(source.folder, cfg))
            if calibration is not None:
                manifest = hold_to_limits(staging, dense, calibration, manifest, limits)
            _install(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(dense, ignore_errors=True)
    log.info("wrote %d stage(s) to %s", len(stages), out)
    return manifest


def _sparse_ffn(mlp_act: str, kernels_everywhere: bool, exact: bool, sparsity: float | None, text: Path | None,
                dense_dir: Path, build_dense) -> tuple[SparseFfn | None, Calibration | None]:  # noqa: ANN001
    """The build's sparse FFN, checked (``check_sparse_ffn``): exact ReLU masks (``exact``), thresholds calibrated for
    ``sparsity`` on ``text`` over ``build_dense(dense_dir)`` (compiler/sparse_build.py), or None (dense)."""
    if not exact and sparsity is None:
        return None, None
    check_sparse_ffn(mlp_act, kernels_everywhere, sparsity)
    if sparsity is None:
        return SparseFfn(), None
    calibration = calibrate_on_dense(build_dense, dense_dir, sparsity, text)
    return SparseFfn(calibration.thresholds), calibration


def _on_kernels(source: Source, specs: dict[int, WeightSpec], keep_stage: dict[int, bool],
                devices: tuple[str, ...] | None) -> list[bool]:
    """Per stage, whether fleet's kernels multiply its matrices: a CPU stage of a GGUF's own blocks or of an HF
    folder's matrices as stored (fp16 format)."""
    on_cpu = [True] * len(specs) if devices is None else [d.split(".")[0].upper() == "CPU" for d in devices]
    return [on_cpu[i] and (keep_stage[i] or not source.gguf and specs[i].format == "fp16") for i in range(len(specs))]


def _check_space(need: int, staging: Path, out: Path) -> None:
    """``BuildError`` when ``staging``'s disk has less than ``need`` bytes free."""
    free = shutil.disk_usage(staging).free
    if need > free:
        raise BuildError(f"{out.parent} has {human_size(free)} free, the build needs about {human_size(need)}: "
                         "free space or choose another -o folder")


def _copy_tokenizer(folder: Path, staging: Path) -> None:
    """The source's tokenizer files (``TOKENIZER_FILES`` it has) into the build."""
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, staging / name)


def _check_output(out: Path, drafts: tuple[str, ...]) -> None:
    """Refuse, before anything is read, drafts that share a name (``ValueError``) and an ``out`` that is a
    file or a folder holding something other than a fleet build (``BuildError``)."""
    names = [draft_name(d) for d in drafts]
    if len(set(names)) != len(names):
        raise ValueError(f"two drafts share a name: {names}")
    if out.exists() and not out.is_dir():
        raise BuildError(f"-o {out} is a file, not a folder: choose another -o folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise BuildError(f"{out} is not empty and holds no fleet build; choose another -o folder")


def _checked_ranges(source: Source, shards: int, layers: str | None,
                    drafts: tuple[str, ...]) -> list[tuple[int, int]]:
    """The stages' layer ranges (``stage_ranges``), once everything a build needs of ``source`` is checked
    from its headers: self drafts it may have, no layers beyond its config, a tokenizer.json, and every
    tensor of every stage there and shaped as the config says."""
    cfg = source.config
    for spec in drafts:
        check_self_draft(spec, cfg)
    ranges = stage_ranges(cfg, shards, layers)
    check_layers(source.weights, cfg, str(source.folder / "config.json"))
    if not (source.folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{source.folder} has no tokenizer.json (fast tokenizer) to ship with the build")
    for index, (start, end) in enumerate(ranges):
        source.weights.check(stage_tensors(cfg, StageSpec(index, start, end, cfg.num_layers)),
                             str(source.folder / "config.json"))
    return ranges


def _stage_specs(source: Source, stages: int, weights: str | None, stage_weights: str | None,
                 overrides: dict) -> tuple[dict[int, WeightSpec], dict[int, bool]]:
    """Each stage's weight spec (``weights``, or its own in ``stage_weights``, with ``overrides``) and whether
    it keeps a GGUF's own blocks (a GGUF built without ``weights`` and not named in ``stage_weights``)."""
    keep = source.gguf and weights is None  # a GGUF's own blocks, unless other weights are asked for
    if source.gguf and not keep:
        log.warning("--weights %s: the GGUF's quantized blocks are dequantized and compressed again (without "
                    "--weights they are kept as they are)", weights)
    named = parse_stage_weights(stage_weights or "", stages)
    formats = {i: weights or "fp16" for i in range(stages)} | named
    specs = {i: resolve(fmt, source.config.parameters(), **overrides) for i, fmt in formats.items()}
    return specs, {i: keep and i not in named for i in formats}


def _write_stage(source: Source, stage: StageSpec, spec: WeightSpec, keep_blocks: bool, kernels: bool,
                 staging: Path, kv_cache_precision: str, bar: Progress,
                 sparse_ffn: SparseFfn | None = None) -> StageEntry:
    """Build ``stage`` into ``staging/stage_<i>/`` (``save_stage``; ``kernels``: its linear weights for fleet's
    kernels); return its manifest entry, which names the kernels' version when the stage holds their op."""
    rel = f"stage_{stage.index}/openvino_model"
    (staging / f"stage_{stage.index}").mkdir()
    fmt = "gguf" if keep_blocks else spec.format
    save_stage(source.config, source.weights, stage, staging / f"{rel}.xml", spec, kv_cache_precision, bar,
               f"stage {stage.index} [{stage.start}:{stage.end}) {fmt}", keep_blocks=keep_blocks, kernels=kernels,
               sparse_ffn=sparse_ffn)
    compression = kept_formats(source.weights, source.config, stage) if keep_blocks else spec.parameters()
    uses = kernels and any(source.weights.kernel_type(n) is not None for n in linear_weights(source.config, stage))
    return StageEntry(index=stage.index, start=stage.start, end=stage.end, xml=f"{rel}.xml", bin=f"{rel}.bin",
                      weights=fmt, compression=compression, kernels=KERNELS_VERSION if uses else None)


def _manifest(folder: Path, cfg: ModelConfig, src: Path, model_id: str | None, stages: list[StageEntry],
              drafts: list, kv_cache_precision: str, eos: tuple[int, ...]) -> Manifest:
    """Write ``folder/manifest.json`` hashing every file there; return it."""
    files = {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST_NAME}
    manifest = Manifest(
        model_id=model_id or (Path(src).stem if Path(src).suffix == ".gguf" else Path(src).resolve().name),
        architecture=Architecture(model_type=cfg.model_type, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, max_context=cfg.max_context,
                                  sliding_window=cfg.sliding_window,
                                  sliding_layers=tuple(i for i, local in enumerate(cfg.sliding_layers) if local)),
        stages=tuple(stages),
        openvino_version=ov.get_version(),
        protocol_version=PROTOCOL_VERSION,
        weights=stages[0].weights if len({s.weights for s in stages}) == 1 else "mixed",
        kv_cache_precision=kv_cache_precision,
        eos_token_ids=eos,
        files=files,
        drafts=tuple(drafts),
        format=KERNELS_FORMAT if any(s.kernels for s in stages) else FORMAT_VERSION,
    )
    (folder / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest
