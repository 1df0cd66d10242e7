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

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet_common.manifest import load_manifest
from fleet_common.runtime import KVSession, compile_config, kernels_at, run_chunk, stage_core

CALIBRATION_TOKENS = 2048
CHUNK = 256  # tokens per infer call, as the quality check feeds them
DEFAULT_TEXT = "Python's documentation topics (pydoc_data.topics, sorted by topic)"
_LAYER = re.compile(r"layers\.(\d+)\.")


class CalibrationError(ValueError):
    """A calibration that cannot be made: a text too short, a stage without SwiGLU activations to measure."""


@dataclass(frozen=True)
class Calibration:
    """Per-layer thresholds on |silu(gate)|, and what they were measured on."""

    sparsity: float  # the fraction of each layer's activations at or under its threshold on the text
    thresholds: dict[int, float]  # layer index (the model's) -> t
    text: str  # what the text was
    tokens: int  # how many of its tokens


def default_text() -> str:
    """The default calibration text: every topic of ``pydoc_data.topics`` in sorted order, blank-line separated."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_ids(build_dir: Path, text_file: Path | None, tokens: int = CALIBRATION_TOKENS) -> tuple[list[int], str]:
    """The first ``tokens`` token ids of ``text_file`` (UTF-8) or of ``default_text``, in ``build_dir``'s tokenizer,
    and the text's description. ``CalibrationError`` when the text has fewer than ``CHUNK`` tokens; ``OSError`` /
    ``UnicodeDecodeError`` for an unreadable file."""
    from coordinator.tokenizer import ChatTokenizer

    text = default_text() if text_file is None else Path(text_file).read_text(encoding="utf-8")
    ids = ChatTokenizer(build_dir).encode(text)[:tokens]
    if len(ids) < CHUNK:
        raise CalibrationError(f"the calibration text {text_file} has {len(ids)} tokens; give one of at least {CHUNK}")
    return ids, DEFAULT_TEXT if text_file is None else Path(text_file).name


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


def calibrate(dense_dir: Path, sparsity: float, ids: list[int], text: str, threads: int = 0) -> Calibration:
    """Thresholds for ``sparsity`` (0 < S < 1) from the dense build in ``dense_dir``: its stages run ``ids`` in
    chunks of ``CHUNK`` at f32 and each layer's t is the S-quantile of |silu(gate)| over [tokens x neurons].
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
    sessions = [KVSession(f"calibrate-{i}", c.create_infer_request(), len(ids)) for i, (c, _, _) in enumerate(stages)]
    for session in sessions:
        session.reset()
    for c0 in range(0, len(ids), CHUNK):
        x: np.ndarray = np.asarray([ids[c0:c0 + CHUNK]], dtype=np.int64)
        for i, (session, (_, layers, first)) in enumerate(zip(sessions, stages)):
            last = i == len(stages) - 1
            index = np.array([x.shape[1] - 1], dtype=np.int64) if last else None
            x, _ = run_chunk(session, "input_ids" if i == 0 else "hidden_states", x, session.length, c0, [], index)
            for k, layer in enumerate(layers):
                a = session.request.get_output_tensor(first + k).data
                magnitudes.setdefault(layer, []).append(np.abs(a.reshape(-1, a.shape[-1])).astype(np.float16))
    thresholds = {layer: float(np.quantile(np.concatenate(parts).astype(np.float32), sparsity))
                  for layer, parts in sorted(magnitudes.items())}
    return Calibration(sparsity, thresholds, text, len(ids))
