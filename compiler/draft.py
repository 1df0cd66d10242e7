"""Draft models for speculative decoding, compiled whole for the coordinator.

Two kinds (``fleet-compiler build ... --draft SPEC``, repeatable):

* ``self-int4`` / ``self-int8``: the target itself with NNCF weight compression, data-free
  (compiler/compress.py, ``SELF_DRAFT_SPECS``): INT4 symmetric, group size 64, every linear layer
  (embeddings/LM head at int8, NNCF's backup mode), or INT8 asymmetric per channel. Same tokenizer
  by construction; cheaper where decoding is memory-bound and the CPU has fast low-bit kernels.
  Measured on the demo model on an AVX2-only CPU (no VNNI/AMX): INT4 decodes slower than the f32
  target (49.9 vs 34.0 ms/token, greedy agreement 0.71), INT8 faster (23.8 ms/token, agreement
  0.97); so the demo serves ``self-int8``.
* a separate small model (HF folder or ``.gguf``) that shares the target's tokenizer, stored fp16 or
  compressed like the stages (``build --draft-weights``). A draft whose vocabulary differs is
  refused: its token ids would mean other strings.

Both export as one stateful IR (all layers, embedding and LM head) with the same input contract as
the shards (compiler/export.py), so the coordinator runs them with ``fleet_common.runtime``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from fleet_common.manifest import DraftEntry

from .arch import ModelConfig
from .compress import SELF_DRAFT_SPECS, resolve
from .export import StageSpec
from .save import save_stage
from .source import Source, open_source

log = logging.getLogger(__name__)

SELF_DRAFTS = ("self-int4", "self-int8")


class VocabularyMismatch(ValueError):
    """The draft's tokenizer does not map the same strings to the same ids as the target's."""


def _vocabulary(hf_dir: Path) -> dict[str, int]:
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise VocabularyMismatch(f"{hf_dir} has no tokenizer.json, so its vocabulary cannot be checked "
                                 "against the target's; a draft must share the target's tokenizer")
    tok = json.loads(path.read_text())
    vocab = dict(tok.get("model", {}).get("vocab", {}))
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    return vocab


def check_vocabulary(target_dir: Path, target_vocab_size: int, draft_dir: Path, draft_vocab_size: int) -> None:
    """Raise ``VocabularyMismatch`` (naming the first difference) unless both tokenizers map every
    string to the same id and both LM heads have the same number of rows."""
    target, draft = _vocabulary(target_dir), _vocabulary(draft_dir)
    if draft_vocab_size != target_vocab_size:
        raise VocabularyMismatch(f"draft {draft_dir.name} has {draft_vocab_size} logits per position, the target "
                                 f"{target_vocab_size}: speculative decoding needs the same vocabulary")
    if draft != target:
        diff = sorted(set(draft.items()) ^ set(target.items()), key=lambda kv: kv[1])[0]
        raise VocabularyMismatch(
            f"draft {draft_dir.name}'s tokenizer differs from the target's ({len(draft)} vs {len(target)} tokens; "
            f"first difference: {diff[0]!r} -> id {draft.get(diff[0])} in the draft, {target.get(diff[0])} in the "
            "target): speculative decoding needs the same tokenizer")


def draft_name(spec: str) -> str:
    """The name a draft is served under (``--draft NAME`` at the coordinator)."""
    if spec in SELF_DRAFTS:
        return spec
    path = Path(spec)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem if path.suffix == ".gguf" else path.resolve().name)


SELF_DRAFT_MAX_PARAMETERS = 3e9  # above this a self draft is a second copy of a big target on the coordinator


def check_self_draft(spec: str, target: ModelConfig) -> None:
    """Refuse (``ValueError``) a ``self-int8``/``self-int4`` draft of a target above ~3B parameters,
    naming the alternatives."""
    if spec in SELF_DRAFTS and target.parameters() > SELF_DRAFT_MAX_PARAMETERS:
        raise ValueError(
            f"--draft {spec} would put a whole {target.parameters() / 1e9:.1f}B-parameter copy of the target on the "
            "coordinator; for a model this size draft with a small model of the same tokenizer (--draft PATH, built "
            "the same way, e.g. Llama-3.2-1B for Llama-3.1-8B) or serve with --draft ngram (no model)")


def export_draft(spec: str, target: Source, out: Path, kv_cache_precision: str, workdir: Path,
                 progress, weights: str = "fp16", **overrides) -> DraftEntry:  # noqa: ANN001 - a save.Progress
    """Build draft ``spec`` (``self-int4``, ``self-int8`` or a model path) as one whole-model stage in
    ``out/drafts/<name>/``.

    ``target`` is the opened target (``compiler.source.Source``: its config, weights, folder). A self
    draft is compressed as its name says (``SELF_DRAFT_SPECS``); a model draft stores ``weights``
    (fp16, int8, int4: its size class's defaults with ``overrides``, see ``compiler.compress.resolve``).
    Raises ``VocabularyMismatch`` for a draft with another tokenizer, ``FileNotFoundError`` /
    ``ValueError`` for an unusable source or a self draft of a big target (``check_self_draft``).
    """
    name = draft_name(spec)
    if spec in SELF_DRAFTS:
        check_self_draft(spec, target.config)
        source = target
        wspec = SELF_DRAFT_SPECS[spec.removeprefix("self-")]
    else:
        source = open_source(Path(spec), workdir / name)
        check_vocabulary(target.folder, target.config.vocab_size, source.folder, source.config.vocab_size)
        wspec = resolve(weights, source.config.parameters(), **overrides)
    layers = source.config.num_layers
    rel = f"drafts/{name}/openvino_model"
    (out / f"drafts/{name}").mkdir(parents=True, exist_ok=True)
    save_stage(source.config, source.weights, StageSpec(0, 0, layers, layers), out / f"{rel}.xml", wspec,
               kv_cache_precision, progress, f"draft {name} {wspec.format}")
    log.info("draft %s: %d layers, %s weights -> %s", name, layers, wspec.format, out / f"{rel}.xml")
    return DraftEntry(name=name, xml=f"{rel}.xml", bin=f"{rel}.bin", num_layers=layers, weights=wspec.format,
                      vocab_size=source.config.vocab_size, max_context=source.config.max_context,
                      compression=wspec.parameters())
