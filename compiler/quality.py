"""Quality of a build's weights: perplexity on a fixed public-domain text and greedy agreement with
a reference build (``fleet-compiler inspect BUILD --quality --reference FP16_BUILD``).

Both are computed by chaining the build's stages in one process with OpenVINO, the way a fleet runs
them (``fleet_common.runtime``: stateful IR, KV state, ``logits_index``), at f32 inference and f32
KV cache so that the only difference between two builds of one model is their weights.

* **Perplexity**: exp of the mean negative log-likelihood of every token of ``data/alice_ch1-2.txt``
  (chapters I-II of Lewis Carroll's *Alice's Adventures in Wonderland*, 1865, as in Project
  Gutenberg eBook #11; public domain; 5,902 tokens of the demo tokenizer), scored in independent
  windows of ``WINDOW`` tokens that each start from ``<|endoftext|>``, the pretraining document
  separator (the windowed evaluation of Radford et al. 2019 and HF's "Perplexity of fixed-length
  models" guide, without overlap).
* **Greedy agreement**: each of ``PROMPTS`` is rendered with the build's chat template and the
  reference build answers it greedily (up to ``MAX_NEW_TOKENS``, stopping at an end-of-sequence
  token). Agreement is the fraction of the reference's answer tokens that this build also ranks
  first given the same context (teacher-forced, pooled over prompts): per-token agreement, as a
  speculative verifier sees it, which does not compound the way free-running text does (one early
  near-tie there makes the rest of an answer differ). ``identical`` counts the prompts whose
  free-running greedy answers are the same text, for what a user sees.

A build's own numbers are cached in ``BUILD/quality.json`` (keyed by the build's identity and the
evaluation set); ``fleet-compiler inspect`` adds the comparison and the floor (``FLOORS``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fleet_common.manifest import LoadedManifest, load_manifest
from fleet_common.runtime import KVSession, compile_ir, run_chunk

if TYPE_CHECKING:
    import openvino as ov

log = logging.getLogger(__name__)

EVAL_TEXT = Path(__file__).parent / "data" / "alice_ch1-2.txt"
EVAL_TEXT_TITLE = "Alice's Adventures in Wonderland, ch. I-II (Carroll 1865, Project Gutenberg #11)"
WINDOW = 1024  # tokens per perplexity window (each scored from a fresh KV state)
CHUNK = 256  # tokens per infer call: bounds the logits buffer (CHUNK x vocab f32)
MAX_NEW_TOKENS = 32
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Write a Python function that returns the square of a number.",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
)
PRECISION = "f32"
REPORT_NAME = "quality.json"
REPORT_FORMAT = 1


@dataclass(frozen=True)
class Floor:
    """The least quality a build must keep against its fp16 reference."""

    max_ppl_increase: float  # perplexity may be at most (1 + this) x the reference's
    min_agreement: float  # teacher-forced greedy agreement with the reference, 0..1


# Floors per the least precise weight format of a build, set from measurements on the demo model
# (docs/compression.md, "The floors": the table they come from and why).
FLOORS = {
    "fp16": Floor(0.001, 0.99),
    "gguf": Floor(0.001, 0.99),  # a GGUF's own blocks: the same values as an fp16 build of it, but not rounded
    "int8": Floor(0.01, 0.90),
    "int4": Floor(0.20, 0.75),
}
_ORDER = ("fp16", "gguf", "int8", "int4")


def floor_for(formats: list[str], sparse_ffn=None) -> Floor:  # noqa: ANN001 - a manifest SparseFfnEntry
    """The floor of a build whose stages store ``formats`` (the loosest one's), loosened by the loss a calibrated
    sparse FFN build states in its manifest (``sparse_ffn``: its perplexity limit added, the lower agreement)."""
    floor = FLOORS[max(formats, key=_ORDER.index)]
    if sparse_ffn is None:
        return floor
    return Floor(floor.max_ppl_increase + sparse_ffn.max_ppl_increase,
                 min(floor.min_agreement, sparse_ffn.min_agreement))


@dataclass(frozen=True)
class Measurement:
    """One build's own numbers on the evaluation set (cached in its ``quality.json``)."""

    build_sha256: str
    eval_sha256: str
    weights: list[str]  # per stage, e.g. "int4 asym g32 r1.0"
    perplexity: float
    tokens: int  # tokens scored
    greedy: list[list[int]]  # per prompt: the greedy answer's token ids
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """A build against its reference, and the floor it must meet."""

    reference: str  # the reference build's folder
    reference_sha256: str
    reference_weights: list[str]
    reference_perplexity: float
    ppl_increase: float  # perplexity / reference's - 1
    agreement: float  # teacher-forced: share of the reference's greedy tokens this build ranks first
    identical: int  # prompts whose free-running greedy answers are the same
    prompts: int
    floor: Floor

    @property
    def passed(self) -> bool:
        return self.ppl_increase <= self.floor.max_ppl_increase and self.agreement >= self.floor.min_agreement


class StageChain:
    """Every stage of a build compiled in this process; a sequence runs through them in order with
    one KV session per stage (the fleet's pipeline without the network). ``compiled``: the stages as the caller
    compiled them (compiler/calibrate.py: with more outputs), instead of ``compile_ir`` of each."""

    def __init__(self, loaded: LoadedManifest, threads: int = 0, precision: str = PRECISION,
                 kernels: str | None = None, compiled: list[ov.CompiledModel] | None = None) -> None:
        m = loaded.manifest
        self.compiled = compiled or [compile_ir(loaded.directory / s.xml, "CPU", threads, precision,
                                                m.kv_cache_precision, kernels=kernels)[0] for s in m.stages]
        self.requests = [c.create_infer_request() for c in self.compiled]
        self.sessions: list[KVSession] = []

    def start(self, max_context: int) -> None:
        """Begin a new sequence (empty KV state in every stage)."""
        self.sessions = [KVSession(f"quality-{i}", r, max_context) for i, r in enumerate(self.requests)]
        for s in self.sessions:
            s.reset()

    def forward(self, ids: list[int], position: int, logits_index: np.ndarray) -> np.ndarray:
        """Feed ``ids`` at logical ``position``..; returns logits [len(logits_index), V] float32 of
        those chunk positions."""
        x: np.ndarray = np.asarray([ids], dtype=np.int64)
        for i, session in enumerate(self.sessions):
            last = i == len(self.sessions) - 1
            x, _ = run_chunk(session, "input_ids" if i == 0 else "hidden_states", x, session.length, position, [],
                             logits_index if last else None)
        return x[0]

    def score(self, seq: list[int], first: int) -> np.ndarray:
        """Run ``seq`` from an empty state in chunks of ``CHUNK``; log-softmax [len(seq) - first, V]
        of the positions ``first``.. (each predicting the token after it)."""
        self.start(len(seq))
        out = []
        for c in range(0, len(seq), CHUNK):
            x = seq[c:c + CHUNK]
            lo = max(first, c) - c
            index = np.arange(lo, len(x), dtype=np.int64) if lo < len(x) else np.array([len(x) - 1], dtype=np.int64)
            logits = self.forward(x, c, index)
            if lo < len(x):
                out.append(_log_softmax(logits))
        return np.concatenate(out)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def perplexity(chain: StageChain, ids: list[int], start_token: int, window: int = WINDOW) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``ids`` in windows of ``window`` tokens, each preceded by
    ``start_token`` so that every token is predicted."""
    nll, count = 0.0, 0
    for w in range(0, len(ids), window):
        piece = ids[w:w + window]
        logp = chain.score([start_token, *piece[:-1]], 0)  # [len(piece), V]
        nll -= float(logp[np.arange(len(piece)), piece].sum())
        count += len(piece)
    return math.exp(nll / count), count


def greedy(chain: StageChain, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy answer to ``prompt`` (token ids): up to ``max_new`` tokens, the first eos included."""
    chain.start(len(prompt) + max_new)
    for c in range(0, len(prompt), CHUNK):
        x = prompt[c:c + CHUNK]
        logits = chain.forward(x, c, np.array([len(x) - 1], dtype=np.int64))
    out: list[int] = []
    while len(out) < max_new:
        out.append(int(logits[-1].argmax()))
        if out[-1] in eos:
            break
        logits = chain.forward(out[-1:], len(prompt) + len(out) - 1, np.zeros(1, dtype=np.int64))
    return out


def forced_agreement(chain: StageChain, prompt: list[int], answer: list[int]) -> int:
    """How many tokens of ``answer`` (another build's greedy answer to ``prompt``) this chain ranks
    first, each given the prompt and the answer before it."""
    if not answer:
        return 0
    logp = chain.score(prompt + answer[:-1], len(prompt) - 1)  # [len(answer), V]
    return int((logp.argmax(axis=-1) == np.asarray(answer)).sum())


def _encoders(model_dir: Path):  # noqa: ANN202 - (tokenizer, encode text, encode a chat prompt)
    """The build's tokenizer as the coordinator uses it (no special tokens added) and its chat
    template rendered as the coordinator renders it (coordinator/tokenizer.py: transformers'
    ``apply_chat_template`` rules, without transformers)."""
    from coordinator.tokenizer import ChatTokenizer

    chat_tokenizer = ChatTokenizer(model_dir)

    def chat(content: str) -> list[int]:
        return chat_tokenizer.encode_chat([{"role": "user", "content": content}])

    return chat_tokenizer.tokenizer, chat_tokenizer.encode, chat


def eval_sha256(tokens: int = 0) -> str:
    """Identity of the evaluation set and method (a cached measurement is reused only under it); ``tokens``: the
    text's first that many tokens only (0: all)."""
    spec = json.dumps([REPORT_FORMAT, WINDOW, CHUNK, MAX_NEW_TOKENS, PROMPTS, PRECISION, *([tokens] if tokens else [])])
    return hashlib.sha256(EVAL_TEXT.read_bytes() + spec.encode()).hexdigest()


def describe_weights(loaded: LoadedManifest) -> list[str]:
    """Per stage, its weight format and NNCF parameters in short (``int4 asym g32 r1.0``)."""
    from .compress import describe

    return [describe(s.weights, s.compression) for s in loaded.manifest.stages]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measure(model_dir: Path, threads: int = 0, chain: StageChain | None = None, tokens: int = 0) -> Measurement:
    """Perplexity and greedy answers of the build in ``model_dir``, from its ``quality.json`` when
    that holds them for this build and evaluation set, else computed (with ``chain`` if given) and
    written there. ``tokens``: perplexity on the evaluation text's first that many tokens (0: all of it; the
    prompts are all measured either way). Raises ``ManifestError`` for a folder without a build,
    ``RuntimeError`` when a stage does not compile, ``ValueError`` for ``tokens`` < 0."""
    if tokens < 0:
        raise ValueError(f"tokens must be 0 (the whole text) or more, not {tokens}")
    model_dir = Path(model_dir)
    loaded = load_manifest(model_dir)
    key = eval_sha256(tokens)
    report = _read(model_dir / REPORT_NAME)
    try:
        cached = Measurement(**report["measurement"])
        if cached.build_sha256 == loaded.sha256 and cached.eval_sha256 == key:
            return cached
    except (KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    tok, encode, chat = _encoders(model_dir)
    start = tok.token_to_id("<|endoftext|>")  # the pretraining document separator, else the eos
    if start is None:
        start = loaded.manifest.eos_token_ids[0]
    chain = chain or StageChain(loaded, threads)
    ids = encode(EVAL_TEXT.read_text())
    ppl, count = perplexity(chain, ids[:tokens] if tokens else ids, start)
    eos = set(loaded.manifest.eos_token_ids)
    answers = [greedy(chain, chat(p), MAX_NEW_TOKENS, eos) for p in PROMPTS]
    result = Measurement(loaded.sha256, key, describe_weights(loaded), ppl, count, answers,
                         round(time.perf_counter() - t0, 1))
    log.info("%s: perplexity %.3f over %d tokens (%.1f s)", model_dir, ppl, count, result.seconds)
    _write(model_dir / REPORT_NAME, {"measurement": asdict(result)})
    return result


def compare(model_dir: Path, reference_dir: Path, threads: int = 0, tokens: int = 0) -> tuple[Measurement, Comparison]:
    """Measure a build and its reference (same tokenizer required, both on the text's first ``tokens``, as
    ``measure``), compute agreement and check the floor; the whole report goes to ``model_dir/quality.json`` (and
    is reused from there).

    Raises ``ValueError`` when the two builds' tokenizers differ (token ids would not compare) or the reference is a
    sparse FFN build (it is measured against a dense one).
    """
    model_dir, reference_dir = Path(model_dir), Path(reference_dir)
    loaded, ref_loaded = load_manifest(model_dir), load_manifest(reference_dir)
    if loaded.manifest.files.get("tokenizer.json") != ref_loaded.manifest.files.get("tokenizer.json"):
        raise ValueError(f"{reference_dir} has another tokenizer than {model_dir}: its greedy tokens would not compare")
    if ref_loaded.manifest.sparse_ffn is not None:
        raise ValueError(f"{reference_dir} is a sparse FFN build (--sparse-ffn {ref_loaded.manifest.sparse_ffn.sparsity:g})"
                         ": give a dense build as the reference")
    ref = measure(reference_dir, threads, tokens=tokens)
    floor = floor_for([s.weights for s in loaded.manifest.stages], loaded.manifest.sparse_ffn)
    report = _read(model_dir / REPORT_NAME)
    try:
        mine = Measurement(**report["measurement"])
        done = report["comparison"]
        if not (mine.build_sha256 == loaded.sha256 and mine.eval_sha256 == ref.eval_sha256
                and done["reference_sha256"] == ref.build_sha256):
            raise KeyError("stale")
        comparison = Comparison(**{**{k: v for k, v in done.items() if k != "passed"}, "floor": floor})  # today's
    except (KeyError, TypeError):
        chain = StageChain(loaded, threads)
        mine = measure(model_dir, threads, chain, tokens)
        _, _, chat = _encoders(model_dir)
        hits = sum(forced_agreement(chain, chat(p), a) for p, a in zip(PROMPTS, ref.greedy))
        comparison = Comparison(
            reference=str(reference_dir), reference_sha256=ref.build_sha256, reference_weights=ref.weights,
            reference_perplexity=ref.perplexity, ppl_increase=mine.perplexity / ref.perplexity - 1,
            agreement=hits / max(1, sum(map(len, ref.greedy))),
            identical=sum(a == b for a, b in zip(mine.greedy, ref.greedy)), prompts=len(PROMPTS), floor=floor)
    _write(model_dir / REPORT_NAME, {"measurement": asdict(mine),
                                     "comparison": {**asdict(comparison), "passed": comparison.passed}})
    return mine, comparison


def _write(path: Path, report: dict) -> None:
    """Write ``report`` atomically; a read-only build folder only loses the cache (logged)."""
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc)


def weights_label(weights: list[str]) -> str:
    """One label when every stage stores the same, else ``0: ..., 1: ...``."""
    return weights[0] if len(set(weights)) == 1 else ", ".join(f"{i}: {w}" for i, w in enumerate(weights))


def sparse_lines(loaded: LoadedManifest) -> list[str]:
    """What a calibrated sparse FFN build states in its manifest (none for another build)."""
    e = loaded.manifest.sparse_ffn
    if e is None:
        return []
    return [f"sparse FFN: S = {e.sparsity:g} (|silu(gate)| thresholds calibrated on {e.calibration_tokens} tokens of "
            f"{e.calibration}); as built: perplexity {e.ppl_increase:+.2%} over {e.quality_tokens} tokens, agreement "
            f"{e.agreement:.3f} against its dense build; held to <= {e.max_ppl_increase:+.1%}, >= {e.min_agreement:.2f} "
            "(the floor below adds these to its weights' own)"]


def report_lines(mine: Measurement, comparison: Comparison | None) -> tuple[list[str], bool | None]:
    """The quality table ``fleet-compiler inspect --quality`` prints, and whether the floor passed
    (None when there was no reference to check it against)."""
    lines = [f"quality: perplexity on {EVAL_TEXT_TITLE}, {mine.tokens:,} tokens; greedy agreement "
             f"(teacher-forced) with the reference over {len(PROMPTS)} prompts x up to {MAX_NEW_TOKENS} tokens; "
             f"{PRECISION} inference",
             f"{'build':<10}  {'perplexity':>10}  {'vs ref':>7}  {'agreement':>9}  {'identical':>9}  "
             f"{'floor (ppl, agreement)':>22}  {'status':<6}  weights"]
    if comparison is None:
        lines.append(f"{'this':<10}  {mine.perplexity:>10.3f}  {'':>7}  {'':>9}  {'':>9}  {'':>22}  {'-':<6}  "
                     f"{weights_label(mine.weights)}")
        return lines, None
    c, f = comparison, comparison.floor
    lines.append(f"{'reference':<10}  {c.reference_perplexity:>10.3f}  {'':>7}  {'':>9}  {'':>9}  {'':>22}  "
                 f"{'':<6}  {weights_label(c.reference_weights)} ({c.reference})")
    floor = f"<= {f.max_ppl_increase:+.1%}, >= {f.min_agreement:.2f}"
    lines.append(f"{'this':<10}  {mine.perplexity:>10.3f}  {c.ppl_increase:>+7.2%}  {c.agreement:>9.3f}  "
                 f"{f'{c.identical}/{c.prompts}':>9}  {floor:>22}  {'ok' if c.passed else 'FAIL':<6}  "
                 f"{weights_label(mine.weights)}")
    return lines, c.passed
