"""OpenVINO runtime shared by workers (one shard) and the coordinator (the draft model): compile a
stateful IR once, keep one KV state per session, run chunks with mask-based rejection, compact.

A session's KV state lives in its own ``InferRequest`` (stateful IR, ../shared/design.md §3). Every
physical slot of that state has a visibility bit; rejected draft tokens keep their slots with the bit
cleared (mask-based rejection, design §5) and ``position_ids`` follow the logical length, so nothing
is trimmed on the hot path. When invisible slots pile up, ``compact`` rewrites the state once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

log = logging.getLogger(__name__)

KV_VALUE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1}


class ChunkError(ValueError):
    """A chunk that does not fit this model or session (shape, dtype, positions, context);
    ``code`` names the gRPC status a server maps it to."""

    code = "INVALID_ARGUMENT"


class ContextOverflow(ChunkError):
    code = "OUT_OF_RANGE"


class SessionConflict(ChunkError):
    """The caller's view of the session (``past_length``) disagrees with the state held here."""

    code = "FAILED_PRECONDITION"


@dataclass(eq=False)
class KVSession:
    """One sequence's KV cache in one compiled model.

    ``visible[j]`` (int64, 1/0) says whether physical slot ``j`` may be attended to; slots of
    rejected draft tokens stay in the state with ``visible == 0`` until ``compact``.
    """

    session_id: str
    request: ov.InferRequest | None  # None once closed
    max_context: int  # physical slots the session may grow to
    length: int = 0  # physical KV slots in the state
    visible: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [max_context]
    last_used: float = 0.0
    compactions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.visible = np.zeros(self.max_context, dtype=np.int64)

    @property
    def visible_length(self) -> int:
        return int(self.visible[: self.length].sum())

    def reset(self) -> None:
        """Empty the state (the InferRequest is kept for reuse)."""
        self.request.reset_state()
        self.length = 0
        self.visible[:] = 0


def compile_ir(xml: Path, device: str = "CPU", threads: int = 0, inference_precision: str = "auto",
               kv_cache_precision: str = "f16") -> tuple[ov.CompiledModel, int, float]:
    """Compile one stateful IR for low-latency decoding.

    ``inference_precision`` "f32" also keeps the KV cache in f32 (bit-exact with one device).
    Returns (compiled model, bytes per KV value, compile seconds). Raises ``RuntimeError`` naming the
    device and this machine's devices when compilation fails.
    """
    config: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if inference_precision != "auto":
        config["INFERENCE_PRECISION_HINT"] = inference_precision
        if inference_precision == "f32":
            kv_cache_precision = "f32"
            config["KV_CACHE_PRECISION"] = "f32"
    t0 = time.perf_counter()
    core = ov.Core()
    try:
        compiled = core.compile_model(str(xml), device, config)
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("Exception from")]
        first_line = lines[-1] if lines else repr(exc)
        raise RuntimeError(f"cannot compile {xml} on {device} (this machine has "
                           f"{', '.join(core.available_devices)}): {first_line}") from exc
    return compiled, KV_VALUE_BYTES.get(kv_cache_precision, 2), time.perf_counter() - t0


def run_chunk(session: KVSession, input_name: str, x: np.ndarray, past_length: int, start_position: int,
              hide_slots: list[int], logits_index: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Run one chunk of ``session`` and advance its KV state (caller validated ``x``'s shape/dtype).

    ``x``: token ids [1, S] int64 or hidden states [1, S, H] float32, fed as ``input_name``.
    ``hide_slots``: physical slots < ``past_length`` to make invisible from now on.
    ``logits_index`` [N] int64 (models with an LM head): chunk positions whose logits to compute.
    Returns (first output copied: hidden [1, S, H] or logits [1, N, V] float32, inference ms).
    Raises ``SessionConflict`` when ``past_length`` disagrees with the session, ``ContextOverflow``
    past its ``max_context`` and ``ChunkError`` for bad hide slots; the state is untouched then.
    """
    seq = x.shape[1]
    with session.lock:
        if session.request is None:
            raise SessionConflict(f"session {session.session_id!r} was closed")
        past = session.length
        if past_length != past:
            raise SessionConflict(f"session {session.session_id!r} holds {past} KV slots, the request "
                                  f"assumed {past_length}")
        if past + seq > session.max_context:
            raise ContextOverflow(f"session {session.session_id!r} would reach {past + seq} KV slots, "
                                  f"over its max context {session.max_context}")
        bad = [s for s in hide_slots if s >= past]
        if bad:
            raise ChunkError(f"hide_slots {bad[:4]} are not in the session's past (length {past})")
        session.visible[list(hide_slots)] = 0
        session.visible[past:past + seq] = 1
        inputs = {
            input_name: x,
            "attention_mask": session.visible[None, : past + seq],
            "position_ids": np.arange(start_position, start_position + seq, dtype=np.int64)[None, :],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
        if logits_index is not None:
            inputs["logits_index"] = logits_index
        t0 = time.perf_counter()
        output = session.request.infer(inputs)[0].copy()
        elapsed = (time.perf_counter() - t0) * 1000
        session.length = past + seq
    return output, elapsed


def compact(session: KVSession, past_length: int, hide_slots: list[int]) -> tuple[int, float]:
    """Drop the invisible slots of ``session`` (after hiding ``hide_slots``): one rewrite of every KV
    state tensor [1, kv_heads, slots, head_dim], keeping visible slots in order. Positions are not
    touched (keys are stored rotated), so attention over the result is unchanged.

    Returns (new physical length, milliseconds). Raises ``SessionConflict`` when ``past_length``
    disagrees with the session and ``ChunkError`` for hide slots outside it.
    """
    with session.lock:
        if session.request is None:
            raise SessionConflict(f"session {session.session_id!r} was closed")
        if past_length != session.length:
            raise SessionConflict(f"session {session.session_id!r} holds {session.length} KV slots, the "
                                  f"request assumed {past_length}")
        bad = [s for s in hide_slots if s >= session.length]
        if bad:
            raise ChunkError(f"hide_slots {bad[:4]} are not in the session's past (length {session.length})")
        t0 = time.perf_counter()
        session.visible[list(hide_slots)] = 0
        keep = np.flatnonzero(session.visible[: session.length])
        if len(keep) < session.length:
            for state in session.request.query_state():
                kv = state.state.data  # [1, kv_heads, slots, head_dim]
                state.state = ov.Tensor(np.ascontiguousarray(kv[:, :, keep, :]))
            session.visible[:] = 0
            session.visible[: len(keep)] = 1
            session.length = len(keep)
            session.compactions += 1
        return session.length, (time.perf_counter() - t0) * 1000


def top_candidates(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` token ids and their log-softmax (over the full vocabulary) per position.

    ``logits``: [N, V] float32. Returns (ids [N, k] int32 best first, logprobs [N, k] float32).
    """
    k = max(1, min(k, logits.shape[-1]))
    logits = logits.astype(np.float32, copy=False)
    peak = logits.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))  # [N, 1]
    if k == 1:
        ids = logits.argmax(axis=-1)[:, None]
    else:
        part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
        order = np.argsort(-np.take_along_axis(logits, part, axis=-1), axis=-1, kind="stable")
        ids = np.take_along_axis(part, order, axis=-1)
    return ids.astype(np.int32), (np.take_along_axis(logits, ids, axis=-1) - lse).astype(np.float32)
