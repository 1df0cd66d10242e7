"""OpenVINO side of a worker: compile one shard once, run chunks of a session through it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import openvino as ov

from fleet_common.manifest import LoadedManifest

from .sessions import Session, SessionConflict

log = logging.getLogger(__name__)


class ChunkError(ValueError):
    """A chunk that does not fit this stage or session (shape, dtype, positions, context)."""

    code = "INVALID_ARGUMENT"


class ContextOverflow(ChunkError):
    code = "OUT_OF_RANGE"


@dataclass(frozen=True)
class ChunkResult:
    """Output of one chunk through this stage."""

    output: np.ndarray  # hidden [1, S, H] float32, or last stage: logits [1, K, V] float32
    compute_ms: float


class ShardRunner:
    """Holds the one CompiledModel of this worker's shard and runs session chunks through it.

    Each session has its own InferRequest (its KV state); all share the compiled weights.
    """

    def __init__(self, loaded: LoadedManifest, stage: int, device: str = "CPU", threads: int = 0,
                 inference_precision: str = "auto") -> None:
        manifest = loaded.manifest
        if not 0 <= stage < manifest.num_stages:
            raise ValueError(f"--shard {stage} out of range: this build has stages 0..{manifest.num_stages - 1}")
        self.loaded = loaded
        self.entry = manifest.stages[stage]
        self.stage = stage
        self.first = stage == 0
        self.last = stage == manifest.num_stages - 1
        self.hidden_size = manifest.architecture.hidden_size
        self.vocab_size = manifest.architecture.vocab_size
        self.device = device
        config: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        kv_precision = manifest.kv_cache_precision
        if inference_precision != "auto":
            config["INFERENCE_PRECISION_HINT"] = inference_precision
            if inference_precision == "f32":
                kv_precision = "f32"
                config["KV_CACHE_PRECISION"] = "f32"
        self.kv_value_bytes = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1}.get(kv_precision, 2)
        t0 = time.perf_counter()
        core = ov.Core()
        try:
            self.compiled = core.compile_model(str(loaded.directory / self.entry.xml), device, config)
        except RuntimeError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("Exception from")]
            first_line = lines[-1] if lines else repr(exc)
            raise RuntimeError(f"cannot compile stage {stage} on {device} (this machine has "
                               f"{', '.join(core.available_devices)}): {first_line}") from exc
        self.compile_s = time.perf_counter() - t0
        log.info("stage %d layers [%d, %d) compiled on %s in %.1f s (%s)", stage, self.entry.start,
                 self.entry.end, device, self.compile_s, config)

    def new_request(self) -> ov.InferRequest:
        return self.compiled.create_infer_request()

    def kv_bytes(self, session: Session) -> int:
        """Approximate KV cache bytes held by ``session`` at this stage."""
        return session.length * self.loaded.manifest.kv_bytes_per_token(self.stage, self.kv_value_bytes)

    def run(self, session: Session, x: np.ndarray, past_length: int, start_position: int,
            hide_slots: list[int], logits_count: int) -> ChunkResult:
        """Run one chunk of ``session`` through this stage and advance its KV state.

        ``x``: token ids [1, S] int64 (stage 0) or hidden states [1, S, H] float32.
        ``hide_slots``: physical slots < ``past_length`` to make invisible from now on.
        ``logits_count`` (last stage): logits for the chunk's last N positions (at least 1 computed).
        Raises ``ChunkError``/``ContextOverflow`` for input that does not fit (state untouched) and
        ``SessionConflict`` when ``past_length`` disagrees with the session.
        """
        if self.first:
            if x.dtype != np.int64 or x.ndim != 2 or x.shape[0] != 1:
                raise ChunkError(f"stage 0 takes token ids [1, S] int64, got {list(x.shape)} {x.dtype}")
            if x.size and (x.min() < 0 or x.max() >= self.vocab_size):
                raise ChunkError(f"token id out of range [0, {self.vocab_size})")
        elif x.dtype != np.float32 or x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.hidden_size:
            raise ChunkError(f"stage {self.stage} takes hidden states [1, S, {self.hidden_size}] float32, "
                             f"got {list(x.shape)} {x.dtype}")
        seq = x.shape[1]
        if seq == 0:
            raise ChunkError("empty chunk")
        if logits_count > seq:
            raise ChunkError(f"logits_count {logits_count} exceeds chunk length {seq}")
        with session.lock:
            past = session.length
            if past_length != past:
                raise SessionConflict(f"session {session.session_id!r} holds {past} KV slots at stage "
                                      f"{self.stage}, the request assumed {past_length}")
            if past + seq > session.max_context:
                raise ContextOverflow(f"session {session.session_id!r} would reach {past + seq} KV slots, "
                                      f"over its max context {session.max_context}")
            bad = [s for s in hide_slots if s >= past]
            if bad:
                raise ChunkError(f"hide_slots {bad[:4]} are not in the session's past (length {past})")
            session.visible[list(hide_slots)] = 0
            session.visible[past:past + seq] = 1
            inputs = {
                "input_ids" if self.first else "hidden_states": x,
                "attention_mask": session.visible[None, : past + seq],
                "position_ids": np.arange(start_position, start_position + seq, dtype=np.int64)[None, :],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
            if self.last:
                keep = max(logits_count, 1)
                inputs["logits_index"] = np.arange(seq - keep, seq, dtype=np.int64)
            t0 = time.perf_counter()
            output = session.request.infer(inputs)[0].copy()
            elapsed = (time.perf_counter() - t0) * 1000
            session.length = past + seq
        return ChunkResult(output, elapsed)


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
