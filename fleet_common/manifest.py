"""``manifest.json``: what a compiled fleet model is, and the hashes that pin it.

Written once by ``fleet-compiler build``; read by workers (to load their shard and announce the
build's identity) and by the coordinator (tokenizer, dims, stage count). The identity of a build is
the sha256 of the manifest file itself, which covers every other file through its hashes (less the
list of pre-compiled blobs, which each PC may add for itself: ``build_identity``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .sliding_kv import SlidingKV, sliding_kv

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # 2: per-stage and per-draft weight format + compression parameters
DEVICES_FORMAT = 3  # 3: a stage names the device it was planned and compiled for (written only when not CPU)
KERNELS_FORMAT = 4  # 4: a stage names the version of fleet's kernels it needs (written only when one does)
READABLE_FORMATS = (1, 2, 3, 4)  # format 1 builds are fp16 throughout; 1 and 2 are CPU throughout


class ManifestError(ValueError):
    """A model directory whose manifest is missing, malformed, or whose files do not match it."""


@dataclass(frozen=True)
class Architecture:
    """Dimensions of the decoder-only model (from its HF config)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_context: int  # max_position_embeddings: the longest sequence the model was trained for
    # Gemma 3's, gpt-oss's local layers: they see keys fewer than ``sliding_window`` logical positions back, and
    # their KV states may drop older slots (fleet_common/sliding_kv.py ``SlidingKV``); 0 and () for other models
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()  # indices of the local layers


@dataclass(frozen=True)
class StageEntry:
    """One shard: layers ``[start, end)``; stage 0 also owns the embedding, the last the norm + LM head."""

    index: int
    start: int
    end: int
    xml: str  # path relative to the model directory
    bin: str
    weights: str = "fp16"  # "fp16", "int8" or "int4" (compiler/compress.py)
    compression: dict = field(default_factory=dict)  # nncf.compress_weights arguments; empty for fp16
    device: str = "CPU"  # OpenVINO device the plan gave this stage (fleet-compiler build --plan); not a constraint
    # the version of fleet's kernels (fleet_common/kernels.py KERNELS_VERSION) whose op the stage holds; None: none
    kernels: str | None = None

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DraftEntry:
    """A whole draft model for speculative decoding, run by the coordinator (compiler/draft.py)."""

    name: str  # "self-int4" or the draft source's name; chosen with ``fleet-coordinator serve --draft``
    xml: str
    bin: str
    num_layers: int
    weights: str  # "int4", "fp16", ...
    vocab_size: int
    max_context: int
    compression: dict = field(default_factory=dict)  # nncf.compress_weights arguments; empty for fp16


@dataclass(frozen=True)
class BlobEntry:
    """A stage compiled ahead of time for one device (``fleet-compiler precompile``): the output of
    ``CompiledModel.export_model``, which a worker imports instead of compiling the IR when ``key``
    matches it (IR, device, OpenVINO version, device identity, compile config; fleet_common/blobs.py)."""

    stage: int
    file: str  # path relative to the model directory
    sha256: str
    key: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SparseFfnEntry:
    """A SwiGLU build's calibrated sparse FFN (``fleet-compiler build --sparse-ffn S``, compiler/calibrate.py): what it
    skips, what that was measured to cost against the dense build of the same weights, and the loss it was held to."""

    activation: str  # "silu": a neuron is skipped where |silu(gate)| <= its layer's threshold
    sparsity: float  # the fraction of each layer's neurons at or under its threshold on the calibration text
    thresholds: tuple[float, ...]  # per layer of the model, in order
    calibration: str  # the calibration text's name
    calibration_sha256: str  # of its UTF-8 bytes
    calibration_tokens: int
    quality_tokens: int  # evaluation-text tokens the perplexity was measured on (compiler/quality.py)
    ppl_increase: float  # perplexity / the dense build's - 1
    agreement: float  # teacher-forced greedy agreement with the dense build, 0..1
    max_ppl_increase: float  # the stated loss the build was held to
    min_agreement: float


@dataclass(frozen=True)
class Manifest:
    """The whole build: architecture, stages, tokenizer and the sha256 of every file."""

    model_id: str
    architecture: Architecture
    stages: tuple[StageEntry, ...]
    openvino_version: str
    protocol_version: int
    weights: str  # the stages' weight format ("fp16", "int8", "int4"), or "mixed"
    kv_cache_precision: str  # written into each IR's rt_info runtime_options
    eos_token_ids: tuple[int, ...]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256 hex
    drafts: tuple[DraftEntry, ...] = ()
    blobs: tuple[BlobEntry, ...] = ()  # not part of the build's identity (see ``build_identity``)
    format: int = FORMAT_VERSION
    sparse_ffn: SparseFfnEntry | None = None  # written only by a calibrated sparse build

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def kv_bytes_per_token(self, stage: int, bytes_per_value: int = 4) -> int:
        """KV cache bytes one token occupies in ``stage`` (K and V, all its layers)."""
        a = self.architecture
        return 2 * self.stages[stage].num_layers * a.num_key_value_heads * a.head_dim * bytes_per_value

    def sliding_kv_bytes_per_token(self, stage: int, bytes_per_value: int = 4) -> int:
        """The part of ``kv_bytes_per_token`` that ``stage``'s sliding-window layers take (0 without them)."""
        a, sliding = self.architecture, self.sliding_kv(stage)
        return len(sliding.states) * a.num_key_value_heads * a.head_dim * bytes_per_value if sliding else 0

    def sliding_kv(self, stage: int) -> SlidingKV | None:
        """The sliding-window layers of ``stage`` whose KV states hold only their last slots
        (fleet_common/sliding_kv.py); None when it has none."""
        entry, a = self.stages[stage], self.architecture
        return sliding_kv(a.sliding_window, [i for i in a.sliding_layers if entry.start <= i < entry.end])

    def draft(self, name: str) -> DraftEntry:
        """The draft called ``name``; raises ``ManifestError`` listing the ones this build has."""
        for d in self.drafts:
            if d.name == name:
                return d
        have = ", ".join(d.name for d in self.drafts) or "none (build with fleet-compiler build --draft)"
        raise ManifestError(f"this build has no draft {name!r}; it has: {have}")

    def to_json(self) -> str:
        """The manifest file's text. A stage on the CPU writes no ``device``, one without fleet's kernels no
        ``kernels`` (and a build without blobs no ``blobs``), so such builds read as they did before: older fleets
        load them."""
        raw = asdict(self)
        if not raw["blobs"]:
            del raw["blobs"]
        if raw["sparse_ffn"] is None:
            del raw["sparse_ffn"]
        if not raw["architecture"]["sliding_window"]:  # a model without local layers reads as before
            del raw["architecture"]["sliding_window"], raw["architecture"]["sliding_layers"]
        for stage in raw["stages"]:
            if stage["device"] == "CPU":
                del stage["device"]
            if stage["kernels"] is None:
                del stage["kernels"]
        return json.dumps(raw, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse manifest JSON; raises ``ManifestError`` when fields are missing or of the wrong type."""
        try:
            raw = json.loads(text)
            if raw.get("format") not in READABLE_FORMATS:
                raise ManifestError(
                    f"manifest format {raw.get('format')!r}: this fleet reads formats "
                    f"{', '.join(map(str, READABLE_FORMATS))}; rebuild with this fleet-compiler, or "
                    "upgrade fleet where the build is newer")
            return cls(
                model_id=str(raw["model_id"]),
                architecture=Architecture(**raw["architecture"] | {
                    "sliding_layers": tuple(int(i) for i in raw["architecture"].get("sliding_layers", ()))}),
                stages=tuple(StageEntry(**s) for s in raw["stages"]),
                openvino_version=str(raw["openvino_version"]),
                protocol_version=int(raw["protocol_version"]),
                weights=str(raw["weights"]),
                kv_cache_precision=str(raw["kv_cache_precision"]),
                eos_token_ids=tuple(int(t) for t in raw["eos_token_ids"]),
                files=dict(raw["files"]),
                drafts=tuple(DraftEntry(**d) for d in raw.get("drafts", ())),
                blobs=tuple(BlobEntry(**b) for b in raw.get("blobs", ())),
                format=int(raw["format"]),
                sparse_ffn=_sparse_ffn(raw.get("sparse_ffn"), int(raw["architecture"]["num_layers"])),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc


def _sparse_ffn(raw: dict | None, layers: int) -> SparseFfnEntry | None:
    """The manifest's ``sparse_ffn`` entry, checked field by field (``ManifestError`` naming the first bad one)."""
    if raw is None:
        return None
    entry = SparseFfnEntry(**raw | {"thresholds": tuple(raw["thresholds"])})
    numbers = {"sparsity": entry.sparsity, "ppl_increase": entry.ppl_increase, "agreement": entry.agreement,
               "max_ppl_increase": entry.max_ppl_increase, "min_agreement": entry.min_agreement}
    for name, value in (numbers | {f"thresholds[{i}]": t for i, t in enumerate(entry.thresholds)}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ManifestError(f"malformed manifest: sparse_ffn.{name} is {value!r}, not a finite number")
    if entry.activation != "silu" or len(entry.thresholds) != layers:
        raise ManifestError(f"malformed manifest: sparse_ffn holds {len(entry.thresholds)} {entry.activation!r} "
                            f"thresholds; this fleet reads {layers} 'silu' ones, a layer each")
    return entry


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class LoadedManifest:
    """A manifest with its directory and build identity (the sha256 of ``manifest.json``)."""

    manifest: Manifest
    directory: Path
    sha256: str


def build_identity(data: bytes) -> str:
    """The build's identity from the bytes of its ``manifest.json``: their sha256, leaving out the
    ``blobs`` list. Blobs are compiled per machine (``fleet-compiler precompile`` on each PC), so a
    build with blobs added stays the same build as its copies without them (the manifest is written
    with sorted keys and indent 2, so dropping the list and re-serialising gives the original bytes)."""
    raw = json.loads(data)
    if "blobs" not in raw:
        return hashlib.sha256(data).hexdigest()
    del raw["blobs"]
    return hashlib.sha256((json.dumps(raw, indent=2, sort_keys=True) + "\n").encode()).hexdigest()


def load_manifest(directory: Path) -> LoadedManifest:
    """Read ``directory/manifest.json`` (no file hashing; see ``verify_files``).

    Raises ``ManifestError`` when it is missing or malformed.
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path} not found: is {directory} a fleet-compiler build output?")
    data = path.read_bytes()
    manifest = Manifest.from_json(data.decode())
    return LoadedManifest(manifest, Path(directory), build_identity(data))


def verify_files(loaded: LoadedManifest, only: list[str] | None = None) -> list[str]:
    """Hash the build's files (or just ``only``) against the manifest; return one problem per bad file."""
    problems = []
    for rel, expected in sorted(loaded.manifest.files.items()):
        if only is not None and rel not in only:
            continue
        path = loaded.directory / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif (actual := sha256_file(path)) != expected:
            problems.append(f"{rel}: sha256 {actual[:12]}... != manifest {expected[:12]}...")
    return problems
