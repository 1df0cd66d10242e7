"""Calibrated thresholds for the sparse FFN of a SwiGLU model (``fleet-compiler build --sparse-ffn S``, issue 47).

A SwiGLU neuron's activation a = silu(g) is rarely exactly zero, so which neurons a token may skip is a choice:
those with |a| at most a threshold t. The compiler sets one t per layer so that on a calibration text a fraction S
of the layer's (token, neuron) activations fall at or under it (the training-free magnitude thresholds of CATS, Lee
et al. 2024, and TEAL, Liu et al. 2024, on SwiGLU's gate): t is the S-quantile
of |silu(g)| over the calibration tokens and the layer's neurons, measured on the dense build of the same weights
at f32, each stage fed the one before's hidden states as a fleet runs them.

The calibration text is a user's own (``--calibration-text FILE``) or, by default, the first ``CALIBRATION_TOKENS``
tokens of Python's own documentation topics (``pydoc_data.topics``, shipped with every CPython: English prose and
code, and not the text the quality check scores, compiler/quality.py).
"""

from __future__ import annotations

import codecs
import hashlib
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet_common.manifest import load_manifest
from fleet_common.runtime import compile_config, kernels_at, stage_core

from .quality import CHUNK, StageChain  # CHUNK: tokens per infer call; the least a calibration text must give

CALIBRATION_TOKENS = 2048
MAX_TEXT_BYTES = 1 << 20  # read of a calibration file: 2,048 tokens of any language take far less
DEFAULT_TEXT = "Python's documentation topics (pydoc_data.topics, sorted by topic)"
_LAYER = re.compile(r"layers\.(\d+)\.")


class CalibrationError(ValueError):
    """A calibration that cannot be made: a text too short, a stage without SwiGLU activations to measure."""


@dataclass(frozen=True)
class CalibrationText:
    """A calibration text: its name (the file's, or ``DEFAULT_TEXT``), the sha256 of its UTF-8 bytes, the text."""

    name: str
    sha256: str
    text: str


@dataclass(frozen=True)
class Calibration:
    """Per-layer thresholds on |silu(gate)|, and what they were measured on."""

    sparsity: float  # the fraction of each layer's activations at or under its threshold on the text
    thresholds: dict[int, float]  # layer index (the model's) -> t
    text: CalibrationText
    tokens: int  # how many of its tokens


def default_text() -> str:
    """The default calibration text: every topic of ``pydoc_data.topics`` in sorted order, blank-line separated."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_text(path: Path | None) -> CalibrationText:
    """The text ``path`` names (``--calibration-text``; None: ``default_text``): the first ``MAX_TEXT_BYTES`` of a
    regular file, UTF-8 (a character cut at that end dropped). ``CalibrationError`` naming the file for one that is
    missing, not a regular file (a folder, a pipe, a device), unreadable, or not UTF-8."""
    if path is None:
        text = default_text()
        return CalibrationText(DEFAULT_TEXT, hashlib.sha256(text.encode()).hexdigest(), text)
    what = f"--calibration-text {path}"
    try:
        if not stat.S_ISREG(Path(path).stat().st_mode):
            raise CalibrationError(f"{what}: not a regular file; give a UTF-8 text file")
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES)
    except OSError as exc:
        raise CalibrationError(f"{what}: {exc.strerror or exc}") from None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=False)  # a cut last character waits
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{what}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return CalibrationText(Path(path).name, hashlib.sha256(text.encode()).hexdigest(), text)


def calibration_ids(build_dir: Path, text: CalibrationText, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` token ids of ``text`` in ``build_dir``'s tokenizer. ``CalibrationError`` when it has
    fewer than ``CHUNK``."""
    from coordinator.tokenizer import ChatTokenizer

    ids = ChatTokenizer(build_dir).encode(text.text)[:tokens]
    if len(ids) < CHUNK:
        raise CalibrationError(f"the calibration text {text.name} has {len(ids)} tokens; give one of at least {CHUNK}")
    return ids


def _gate_outputs(model) -> dict[int, object]:  # noqa: ANN001 - ov.Model -> {layer: Swish output}
    """Each layer's silu(gate) in a dense stage's graph: the Swish node fed by a product named after the layer's
    gate_proj (compiler/layers.py ``mlp``)."""
    found = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Swish":
            continue
        producer = node.input_value(0).get_node().get_friendly_name()
        match = _LAYER.search(producer)
        if match and "gate_proj" in producer:
            found[int(match.group(1))] = node.output(0)
    return found


def calibrate(dense_dir: Path, sparsity: float, ids: list[int], text: CalibrationText, threads: int = 0) -> Calibration:
    """Thresholds for ``sparsity`` (0 < S < 1) from the dense build in ``dense_dir``: its stages, each with its
    layers' silu(gate) as more outputs, run ``ids`` in chunks of ``CHUNK`` at f32 (compiler/quality.py
    ``StageChain``) and each layer's t is the S-quantile of |silu(gate)| over [tokens x neurons].
    ``CalibrationError`` when a stage has a layer without a SwiGLU gate to measure."""
    loaded = load_manifest(dense_dir)
    core = stage_core()
    config = compile_config(threads, "f32")
    stages = []
    for s in loaded.manifest.stages:
        model = kernels_at(core.read_model(str(dense_dir / s.xml)), "f32")
        gates = _gate_outputs(model)
        if sorted(gates) != list(range(s.start, s.end)):
            raise CalibrationError(f"stage {s.index} has SwiGLU gates for layers {sorted(gates)}, not for all of "
                                   f"[{s.start}, {s.end}): only dense SwiGLU layers are calibrated")
        layers = sorted(gates)
        first = len(model.outputs)
        model.add_outputs([gates[i] for i in layers])
        stages.append((core.compile_model(model, "CPU", config), layers, first))
    magnitudes: dict[int, list[np.ndarray]] = {}
    chain = StageChain(loaded, compiled=[c for c, _, _ in stages])
    chain.start(len(ids))
    for c0 in range(0, len(ids), CHUNK):
        chunk = ids[c0:c0 + CHUNK]
        chain.forward(chunk, c0, np.array([len(chunk) - 1], dtype=np.int64))
        for session, (_, layers, first) in zip(chain.sessions, stages):
            for k, layer in enumerate(layers):
                a = session.request.get_output_tensor(first + k).data
                magnitudes.setdefault(layer, []).append(np.abs(a.reshape(-1, a.shape[-1])).astype(np.float16))
    thresholds = {layer: float(np.quantile(np.concatenate(parts).astype(np.float32), sparsity))
                  for layer, parts in sorted(magnitudes.items())}
    return Calibration(sparsity, thresholds, text, len(ids))
