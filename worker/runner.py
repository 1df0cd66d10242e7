"""A worker's shard: its one CompiledModel and the checks a chunk must pass before it runs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from fleet_common.manifest import LoadedManifest
from fleet_common.residency import resident_mib, settle
from fleet_common.runtime import ChunkError, KVSession, compact, run_chunk

from .loader import DEFAULT_CACHE_MAX_BYTES, load_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkResult:
    """Output of one chunk through this stage."""

    output: np.ndarray  # hidden [B, S, H] float32, or last stage: logits [B, K, V] float32 (B: the session's rows)
    compute_ms: float  # wall time of the infer call
    cpu_ms: float = 0.0  # CPU time of the calling thread for the chunk (its inputs built, infer, output copied)
    thread: str = "inference"  # the thread that ran it: "inference" (its own) or "event_loop"


class ShardRunner:
    """Holds the one CompiledModel of this worker's shard and runs session chunks through it.

    Each session has its own InferRequest (its KV state); all share the compiled weights. The model
    comes from a matching pre-compiled blob, OpenVINO's model cache or the IR (worker/loader.py;
    ``blobs``, ``verify_hashes``, ``cache_dir``, ``cache_max_bytes`` go there); ``load`` says which.
    Raises ``ValueError`` for a stage the build does not have, ``ManifestError`` for shard files that do
    not match the manifest (``verify_hashes``), ``RuntimeError`` when it cannot compile.
    """

    def __init__(self, loaded: LoadedManifest, stage: int, device: str = "CPU", threads: int = 0,
                 inference_precision: str = "auto", *, blobs: bool = True, verify_hashes: bool = False,
                 cache_dir: Path | None = None, cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES) -> None:
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
        self.load = load_shard(loaded, stage, device, threads, inference_precision, blobs=blobs,
                               verify_hashes=verify_hashes, cache_dir=cache_dir,
                               cache_max_bytes=cache_max_bytes)
        self.compiled, self.kv_value_bytes = self.load.compiled, self.load.kv_value_bytes
        t0 = time.perf_counter()
        if self.entry.kernels:  # fleet's kernels read the weights in the mapped .bin: its pages are the weights
            self._warm_up()
        else:  # the plugin repacks the weights at the first inference: the mapped pages read for it go back
            settle(self._warm_up, self._mapped_files())
        log.info("stage %d layers [%d, %d) loaded on %s from %s in %.2f s, first inference in %.2f s; RSS %s",
                 stage, self.entry.start, self.entry.end, device, self.load.source, self.load.seconds,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.0f} MiB" for k, v in resident_mib().items()))
        if self.entry.device.split(".")[0].upper() != device.split(".")[0].upper():  # served anyway
            # CPU is also what every build without a plan names: no warning for those
            log.log(logging.INFO if self.entry.device == "CPU" else logging.WARNING,
                    "stage %d was planned for %s (the manifest's device); this worker runs it on %s (--device)",
                    stage, self.entry.device, device)

    def _mapped_files(self) -> list[Path]:
        """The files OpenVINO maps this stage's weights from: the ``.bin``, and a model-cache entry's blobs."""
        files = [self.loaded.directory / self.entry.bin]
        if self.load.source == "model-cache":
            files += list(Path(self.load.detail).glob("*.blob"))
        return files

    def _warm_up(self) -> None:
        """One 1-token inference on a throwaway request: the CPU plugin repacks the weights on a compiled model's
        first inference, now at load time rather than in the first user's request."""
        x = np.zeros((1, 1), np.int64) if self.first else np.zeros((1, 1, self.hidden_size), np.float32)
        feed = {"input_ids" if self.first else "hidden_states": x, "attention_mask": np.ones((1, 1), np.int64),
                "position_ids": np.zeros((1, 1), np.int64), "beam_idx": np.zeros(1, np.int32)}
        if self.last:
            feed["logits_index"] = np.zeros(1, np.int64)
        self.compiled.create_infer_request().infer(feed)

    def new_request(self) -> ov.InferRequest:
        """A fresh InferRequest (an empty KV state) of this stage's compiled model: one per session."""
        return self.compiled.create_infer_request()

    def kv_bytes(self, session: KVSession) -> int:
        """Approximate KV cache bytes held by ``session`` (all its rows) at this stage; its sliding-window layers'
        states hold ``local_start`` slots fewer (fleet_common/sliding_kv.py)."""
        manifest = self.loaded.manifest
        held = session.length * manifest.kv_bytes_per_token(self.stage, self.kv_value_bytes) \
            - session.local_start * manifest.sliding_kv_bytes_per_token(self.stage, self.kv_value_bytes)
        return held * session.rows

    def run(self, session: KVSession, x: np.ndarray, past_length: int, start_position: int | list[int],
            hide_slots: list[int], logits_count: int, hide_rows: list[int] | None = None,
            pads: list[int] | None = None, keep_rows: list[int] | None = None, *,
            thread: str = "inference") -> ChunkResult:
        """Run one chunk of ``session`` (each of its rows) through this stage and advance its KV state.

        ``x``: token ids [B, S] int64 (stage 0) or hidden states [B, S, H] float32, B = the session's
        rows (after ``keep_rows``). ``hide_slots`` / ``hide_rows``: physical slots < ``past_length`` to
        make invisible from now on; ``pads``, ``keep_rows``: see ``fleet_common.runtime.run_chunk``.
        ``logits_count`` (last stage): logits for the chunk's last N positions (at least 1 computed).
        ``thread`` names the calling thread in the result (``cpu_ms`` is that thread's CPU time).
        Raises ``ChunkError`` (or its subclasses ``ContextOverflow``, ``SessionConflict``) for input
        that does not fit; the state is untouched then.
        """
        if self.first:
            if x.dtype != np.int64 or x.ndim != 2:
                raise ChunkError(f"stage 0 takes token ids [B, S] int64, got {list(x.shape)} {x.dtype}")
            if x.size and (x.min() < 0 or x.max() >= self.vocab_size):
                raise ChunkError(f"token id out of range [0, {self.vocab_size})")
        elif x.dtype != np.float32 or x.ndim != 3 or x.shape[2] != self.hidden_size:
            raise ChunkError(f"stage {self.stage} takes hidden states [B, S, {self.hidden_size}] float32, "
                             f"got {list(x.shape)} {x.dtype}")
        seq = x.shape[1]
        if seq == 0 or x.shape[0] == 0:
            raise ChunkError("empty chunk")
        if logits_count > seq:
            raise ChunkError(f"logits_count {logits_count} exceeds chunk length {seq}")
        index = None
        if self.last:
            keep = max(logits_count, 1)
            index = np.arange(seq - keep, seq, dtype=np.int64)
        cpu0 = time.thread_time()  # with one inference thread OpenVINO infers on the calling thread: its CPU is infer's
        output, elapsed = run_chunk(session, "input_ids" if self.first else "hidden_states", x, past_length,
                                    start_position, hide_slots, index, hide_rows, pads, keep_rows)
        return ChunkResult(output, elapsed, (time.thread_time() - cpu0) * 1000, thread)

    def compact(self, session: KVSession, past_length: int, hide_slots: list[int],
                hide_rows: list[int] | None = None) -> tuple[int, float]:
        """Drop ``session``'s invisible slots here; see ``fleet_common.runtime.compact``."""
        return compact(session, past_length, hide_slots, hide_rows)
