"""In-process decoding of fleet IRs, as the parity benches time it: the whole model's IR fed directly from
numpy (:class:`Whole`, the reference) or the stages chained through the worker's code path
(``compiler.quality.StageChain``); their KV states saved after a prefill and put back (:func:`save_kv`,
:func:`load_kv`), and teacher-forced decode steps from there (:func:`step`, :func:`decode`, :func:`prefill`).
Used by ``bench/kernels/shard_parity.py`` and ``bench/builds/gguf_forms.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov

from fleet_common.runtime import compile_ir

if TYPE_CHECKING:
    from compiler.quality import StageChain

WARM_UP_STEPS = 8  # untimed decode steps after each prefill
LAST = np.zeros(1, dtype=np.int64)  # logits_index of a one-token step


class Whole:
    """The unsharded model's IR fed directly from numpy, the reference: no fleet runtime in between.
    Same interface as ``compiler.quality.StageChain``; ``compiled`` is the compiled model."""

    def __init__(self, xml: Path, threads: int, precision: str = "auto") -> None:
        self.compiled, _, _ = compile_ir(xml, "CPU", threads, precision)
        self.request = self.compiled.create_infer_request()

    def start(self, max_context: int) -> None:
        """A fresh sequence: the KV state emptied."""
        self.request.reset_state()

    def forward(self, ids: list[int], position: int, logits_index: np.ndarray) -> np.ndarray:
        """Logits [K, V] at the positions ``logits_index`` of the chunk ``ids`` fed at ``position``."""
        seq = len(ids)
        return self.request.infer({
            "input_ids": np.asarray([ids], dtype=np.int64),  # [1, S]
            "attention_mask": np.ones((1, position + seq), dtype=np.int64),  # [1, P+S]
            "position_ids": np.arange(position, position + seq, dtype=np.int64)[None, :],  # [1, S]
            "beam_idx": np.zeros(1, dtype=np.int32),  # [1]
            "logits_index": logits_index,  # [K]
        })[0][0]  # [K, V]


def requests(model: Whole | StageChain) -> list[ov.InferRequest]:
    """The stateful infer requests whose KV state ``model`` decodes with (one per stage)."""
    return [model.request] if isinstance(model, Whole) else model.requests


def save_kv(model: Whole | StageChain) -> list[dict[str, np.ndarray]]:
    """A copy of every KV state of ``model``, per stage: {state name: [1, kv_heads, slots, head_dim]}."""
    return [{s.name: s.state.data.copy() for s in r.query_state()} for r in requests(model)]


def load_kv(model: Whole | StageChain, saved: list[dict[str, np.ndarray]], length: int) -> None:
    """Put ``saved`` (``length`` slots, all visible) back into ``model``'s KV states, as
    ``fleet_common.runtime.compact`` writes a state."""
    for request, kv in zip(requests(model), saved):
        for state in request.query_state():
            state.state = ov.Tensor(kv[state.name])  # copied
    for session in getattr(model, "sessions", []):
        session.length = length
        session.visible[:] = 0
        session.visible[:, :length] = 1


def step(model: Whole | StageChain, tokens: list[int], pos: int) -> tuple[int, float]:
    """One teacher-forced decode step at KV length ``pos`` (feeds ``tokens[pos]``): (argmax, ms)."""
    t0 = time.perf_counter()
    logits = model.forward(tokens[pos:pos + 1], pos, LAST)  # [1, V]
    top1 = int(logits[0].argmax())
    return top1, (time.perf_counter() - t0) * 1000


def decode(model: Whole | StageChain, tokens: list[int], start: int, steps: int) -> dict:
    """``steps`` decode steps from KV length ``start``: {"ms": [per step], "top1": [argmax per step]}."""
    top1, ms = zip(*(step(model, tokens, pos) for pos in range(start, start + steps)))
    return {"ms": list(ms), "top1": list(top1)}


def prefill(model: Whole | StageChain, tokens: list[int], contexts: list[int], steps: int,
            max_context: int) -> tuple[dict, dict]:
    """Prefill to each context in turn (one chunk), keep a copy of the KV there, and decode ``steps``
    from it (untimed warm-up). Returns ({context: saved KV}, {context: {"prefill_ms", "ms", "top1"}})."""
    model.start(max_context)
    saved, run, pos = {}, {}, 0
    for ctx in contexts:
        t0 = time.perf_counter()
        model.forward(tokens[pos:ctx], pos, np.array([ctx - pos - 1], dtype=np.int64))
        prefill_ms = (time.perf_counter() - t0) * 1000
        saved[ctx] = save_kv(model)
        run[ctx] = {"prefill_ms": prefill_ms, **decode(model, tokens, ctx, steps)}
        pos = ctx + steps
    return saved, run
