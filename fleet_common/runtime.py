"""OpenVINO runtime shared by workers (one shard) and the coordinator (the draft model): compile a
stateful IR once, keep one KV state per session, run chunks with mask-based rejection, compact.

A session's KV state lives in its own ``InferRequest`` (the stateful IR's ReadValue/Assign pairs, one per
layer and per K/V: compiler/export.py). Every physical slot of that state has a visibility bit; rejected
draft tokens keep their slots with the bit cleared (mask-based rejection: what follows is the same as if
they had never been fed, tests/integration/test_mask_rejection.py) and ``position_ids`` follow the logical
length, so nothing is trimmed on the hot path (trimming costs milliseconds per rejection, growing with the
context: bench/pipeline/spec_bench.py measures both). When invisible slots pile up, ``compact`` rewrites the state once.
The sliding-window layers' states hold only their last slots (fleet_common/sliding_kv.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from . import kernels
from .ovinfer import infer_first
from .sliding_kv import SlidingKV, cut_states, first_needed, needed_slots, pack_local

log = logging.getLogger(__name__)

KV_VALUE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1}


class ChunkError(ValueError):
    """A chunk that does not fit this model or session (shape, dtype, positions, context);
    ``code`` names the gRPC status a server maps it to."""

    code = "INVALID_ARGUMENT"


class ContextOverflow(ChunkError):
    code = "OUT_OF_RANGE"


class PrefixNotHeld(ChunkError):
    """A copy of a prefix whose last ``window - 1`` slots the sliding-window layers no longer hold (dropped:
    fleet_common/sliding_kv.py); the source session is intact. OUT_OF_RANGE: a Copy's only other one, more
    tokens than its ``max_context``, is the caller's bug, and either way the prompt is prefilled instead."""

    code = "OUT_OF_RANGE"


class SessionConflict(ChunkError):
    """The caller's view of the session (``past_length``) disagrees with the state held here."""

    code = "FAILED_PRECONDITION"


def shown_id(session_id: str) -> str:
    """``session_id`` quoted for an error message, cut to 64 characters: a caller's id can be megabytes
    long, and a gRPC status message beyond 16 KiB never reaches the caller."""
    if len(session_id) <= 64:
        return repr(session_id)
    return f"{session_id[:64]!r}... ({len(session_id)} characters)"


@dataclass(eq=False)
class KVSession:
    """The KV cache of ``rows`` sequences in one compiled model: one InferRequest whose state tensors
    are [rows, kv_heads, length, head_dim].

    A session usually holds one sequence; a *batch group* (``merge``) holds several that step together
    in one infer call, sharing the physical length (shorter rows are padded with invisible slots).
    ``visible[r, j]`` (int64, 1/0) says whether row ``r`` may attend to physical slot ``j``; slots of
    rejected draft tokens and of padding stay in the state with ``visible == 0`` until ``compact``.
    ``sliding``: the model's sliding-window layers, whose states hold only physical slots
    ``[local_start, length)`` (fleet_common/sliding_kv.py); None: every state holds them all. ``row_start[r]``
    (>= ``local_start``): the first slot whose sliding-window KV row ``r`` really holds (a merged or compacted
    row may have zeros before it).
    """

    session_id: str
    request: ov.InferRequest | None  # None once closed
    max_context: int  # physical slots the session may grow to
    rows: int = 1
    reserved: list[int] = field(default_factory=list)  # KV slots each row reserved (admission), [rows]
    length: int = 0  # physical KV slots in the state (shared by all rows)
    visible: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [rows, max_context]
    last_used: float = 0.0
    compactions: int = 0
    sliding: SlidingKV | None = None
    local_start: int = 0  # the first physical slot the sliding-window layers' states hold
    row_start: list[int] = field(default_factory=list)  # each row's first slot of real sliding-window KV, [rows]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.visible.shape != (self.rows, self.max_context):
            self.visible = np.zeros((self.rows, self.max_context), dtype=np.int64)
        if len(self.reserved) != self.rows:
            self.reserved = [self.max_context] * self.rows
        if len(self.row_start) != self.rows:
            self.row_start = [self.local_start] * self.rows

    def resize(self, max_context: int) -> None:
        """Let the session grow to ``max_context`` physical slots (at least its ``length``): the visibility
        rows are reallocated, the KV state is untouched. Raises ``ContextOverflow`` below its length."""
        if max_context < self.length:
            raise ContextOverflow(f"session {shown_id(self.session_id)} holds {self.length} slots, more than "
                                  f"{max_context}")
        visible = np.zeros((self.rows, max_context), dtype=np.int64)
        width = min(max_context, self.max_context)
        visible[:, :width] = self.visible[:, :width]
        self.visible, self.max_context = visible, max_context

    def reset(self) -> None:
        """Empty the state (the InferRequest is kept for reuse)."""
        self.request.reset_state()
        self.length = self.local_start = 0
        self.row_start = [0] * self.rows
        self.visible[:] = 0


def compile_config(threads: int = 0, inference_precision: str = "auto",
                   compressed_cpu: bool = False) -> dict[str, object]:
    """The properties a shard is compiled with for low-latency decoding (``compile_ir``; a pre-compiled
    blob is made and imported with the same ones, fleet_common/blobs.py). ``threads`` 0 and precision
    "auto" leave OpenVINO's defaults; "f32" also keeps the KV cache in f32 (bit-exact with one device)
    and switches off the CPU plugin's dynamic quantization of activations for compressed weights
    (``DYNAMIC_QUANTIZATION_GROUP_SIZE`` 0): on by default for int8/int4/GGUF-block weights even at f32,
    it moved the demo's Q4_1 build's logits by up to 0.49 from the f32 dequantized GGUF, 2e-4 without.

    ``compressed_cpu`` (a CPU stage of compressed weights: GGUF blocks, int8, int4; ``runs_compressed``): "auto"
    runs its activations at f32, which the plugin quantizes to int8 per group for its integer kernels (dynamic
    quantization, on); at bf16 a CPU with AMX took its bf16 kernels instead, 1.17x (Q4_K_M) to 1.29x (Q4_0)
    slower on Llama-3.2-1B's dimensions (bench/kernels/kernel_bench.py). The KV cache stays the build's."""
    config: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if inference_precision == "auto" and compressed_cpu:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if inference_precision != "auto":
        config["INFERENCE_PRECISION_HINT"] = inference_precision
        if inference_precision == "f32":
            config["KV_CACHE_PRECISION"] = "f32"
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    return config


def runs_compressed(device: str, entry) -> bool:  # noqa: ANN001 - a manifest StageEntry or DraftEntry
    """Whether a stage (or draft) ``entry`` of a manifest on ``device`` runs on the CPU plugin's compressed kernels
    alone (``compile_config``'s ``compressed_cpu``): int8/int4 weights, or a GGUF build whose matrices are all kept
    blocks. One with f16 matrices (an F16 GGUF, types dequantized to f16) is not: at f32 the plugin would widen
    those to f32, twice their bytes (an F16 1B stage took 8.2 GB). A stage whose matrices fleet's kernels multiply
    (``entry.kernels``) is: its matrices stay as stored whatever the precision, the rest runs at f32."""
    if device.split(".")[0].upper() != "CPU":
        return False
    if getattr(entry, "kernels", None):
        return True
    if entry.weights == "fp16":
        return False
    return entry.weights != "gguf" or not entry.compression.get("tensors", {}).get("f16", 0)


def stage_core() -> ov.Core:
    """The ``ov.Core`` that reads a stage: fleet's kernels registered (``kernels.new_core``) where their library is
    here; else a plain one, which reads every stage but those holding the kernels' op (a worker refuses those
    first, by their manifest entry: ``check_kernels``)."""
    return kernels.new_core() if kernels.available() else ov.Core()


def check_kernels(entry, what: str) -> None:  # noqa: ANN001 - a manifest StageEntry
    """Raise ``kernels.KernelsUnavailable`` (one line: what to install) when ``entry`` (``what``: "stage 1")
    needs fleet's kernels and this install lacks them or has another version."""
    if entry.kernels is None:
        return
    if entry.kernels != kernels.KERNELS_VERSION:
        raise kernels.KernelsUnavailable(f"{what} needs fleet's kernels version {entry.kernels}, this fleet has "
                                         f"version {kernels.KERNELS_VERSION}: install the fleet the build was made "
                                         "with, or rebuild the model with this one")
    try:
        kernels.library_path()
    except kernels.KernelsUnavailable as exc:
        raise kernels.KernelsUnavailable(f"{what} needs fleet's kernels: {exc}") from None


def kernels_at(model: ov.Model, precision: str) -> ov.Model:
    """``model`` with every product of fleet's kernels (``GgufMatMul``, ``GgufMoeMatMul``, ``GgufSparseFfn``: ``kernels.PRODUCTS``) set
    to ``precision`` ("f32": exact products, "int8": activations quantized per 32, or per 256 for the
    256-weight types: the default a build writes); returns it."""
    for node in model.get_ops():
        if node.get_type_name() in kernels.PRODUCTS:
            node.set_attribute("precision", precision)
    return model


def compile_ir(xml: Path, device: str = "CPU", threads: int = 0, inference_precision: str = "auto",
               kv_cache_precision: str = "f16", cache_dir: Path | None = None,
               compressed: bool = False, kernels: str | None = None) -> tuple[ov.CompiledModel, int, float]:
    """Compile one stateful IR for low-latency decoding (``compile_config``; ``compressed``: ``runs_compressed``
    of its manifest entry on ``device``, which "auto" precision follows).

    ``inference_precision`` "f32" also keeps the KV cache in f32 (bit-exact with one device) and runs fleet's
    kernels (``GgufMatMul``) at their exact precision (``kernels_at``). ``kernels`` ("int8" or "f32") sets the
    kernels' precision whatever ``inference_precision`` is (bench/builds/llama_cpp_parity.py: the rest in f32, the
    products as llama.cpp computes them).
    ``cache_dir``: OpenVINO's model cache (``CACHE_DIR``, "Model Caching Overview" in the OpenVINO
    docs): a compiled model found there is imported instead of compiled, otherwise it is written there.
    Returns (compiled model, bytes per KV value, compile seconds). Raises ``RuntimeError`` naming the
    device and this machine's devices when compilation fails.
    """
    config = compile_config(threads, inference_precision, compressed)
    if inference_precision == "f32":
        kv_cache_precision = "f32"
    if cache_dir is not None:
        config["CACHE_DIR"] = str(cache_dir)
    t0 = time.perf_counter()
    core = stage_core()
    if kernels is None and inference_precision == "f32":  # fleet's kernels at f32 too: the exact products
        kernels = "f32"
    try:
        if kernels is not None:
            compiled = core.compile_model(kernels_at(core.read_model(str(xml)), kernels), device, config)
        else:
            compiled = core.compile_model(str(xml), device, config)
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("Exception from")]
        first_line = lines[-1] if lines else repr(exc)
        raise RuntimeError(f"cannot compile {xml} on {device} (this machine has "
                           f"{', '.join(core.available_devices)}): {first_line}") from exc
    return compiled, KV_VALUE_BYTES.get(kv_cache_precision, 2), time.perf_counter() - t0


def _check_open(session: KVSession, past_length: int) -> None:
    if session.request is None:
        raise SessionConflict(f"session {shown_id(session.session_id)} was closed")
    if past_length != session.length:
        raise SessionConflict(f"session {shown_id(session.session_id)} holds {session.length} KV slots, the "
                              f"request assumed {past_length}")


def _hide_index(session: KVSession, hide_slots: list[int], hide_rows: list[int] | None,
                rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, slots) index arrays of the slots to hide; raises ``ChunkError`` for ones outside the past."""
    slots = np.asarray(hide_slots, dtype=np.int64)
    which = np.zeros_like(slots) if not hide_rows else np.asarray(hide_rows, dtype=np.int64)
    if which.shape != slots.shape:
        raise ChunkError(f"{len(hide_rows)} hide_rows for {len(hide_slots)} hide_slots")
    bad = slots[(slots < 0) | (slots >= session.length)]
    if bad.size:
        raise ChunkError(f"hide_slots {bad[:4].tolist()} are not in the session's past (length {session.length})")
    if which.size and (which.min() < 0 or which.max() >= rows):
        raise ChunkError(f"hide_rows must be in [0, {rows})")
    return which, slots


def run_chunk(session: KVSession, input_name: str, x: np.ndarray, past_length: int,
              start_position: int | list[int], hide_slots: list[int], logits_index: np.ndarray | None,
              hide_rows: list[int] | None = None, pads: list[int] | None = None,
              keep_rows: list[int] | None = None) -> tuple[np.ndarray, float]:
    """Run one chunk of every row of ``session`` and advance its KV state (caller validated ``x``).

    ``x``: token ids [B, S] int64 or hidden states [B, S, H] float32, fed as ``input_name``; B is the
    session's row count (after ``keep_rows``).
    ``keep_rows``: rows of the state to keep, in their new order, before the chunk runs (fed as
    ``beam_idx``, the Gather each KV read starts with: a departed sequence's row is dropped for free).
    ``start_position``: logical position of each row's first real token (one int for all rows).
    ``pads``: left padding per row: the row's first ``pads[r]`` chunk tokens are fillers whose slots
    are invisible from the start (so rows with shorter chunks end where the others do); a row padded
    all the way (``pads[r] == S``) sits the step out.
    ``hide_slots`` / ``hide_rows``: physical slots < ``past_length`` of those rows (row 0 when
    ``hide_rows`` is empty) to make invisible from now on.
    ``logits_index`` [N] int64 (models with an LM head): chunk positions whose logits to compute.
    Returns (first output copied: hidden [B, S, H] or logits [B, N, V] float32, inference ms).
    Raises ``SessionConflict`` when ``past_length`` disagrees with the session, ``ContextOverflow``
    past its ``max_context`` and ``ChunkError`` for bad rows, pads or hide slots; the state is
    untouched then.
    """
    batch, seq = x.shape[0], x.shape[1]
    with session.lock:
        _check_open(session, past_length)
        past = session.length
        if past + seq > session.max_context:
            raise ContextOverflow(f"session {shown_id(session.session_id)} would reach {past + seq} KV slots, "
                                  f"over its max context {session.max_context}")
        if keep_rows and (len(set(keep_rows)) != len(keep_rows) or min(keep_rows) < 0
                          or max(keep_rows) >= session.rows):
            raise ChunkError(f"keep_rows {list(keep_rows)[:8]} must be distinct rows of the session's {session.rows}")
        rows = np.arange(session.rows, dtype=np.int32) if not keep_rows else np.asarray(keep_rows, dtype=np.int32)
        if batch != len(rows):
            raise ChunkError(f"chunk has {batch} rows, the session {len(rows)}")
        pad = np.zeros(batch, dtype=np.int64) if not pads else np.asarray(pads, dtype=np.int64)
        if pad.shape != (batch,) or pad.min() < 0 or pad.max() > seq or pad.min() == seq:
            raise ChunkError(f"pads must give each of the {batch} rows a padding in [0, {seq}], "
                             "and at least one row a real token")
        start = np.asarray(start_position, dtype=np.int64)
        if start.ndim and start.shape != (batch,):
            raise ChunkError(f"{start.size} row start positions for a chunk of {batch} rows")
        start = np.broadcast_to(start, (batch,))
        which, slots = _hide_index(session, hide_slots, hide_rows, batch)
        _check_window(session, rows if keep_rows else None, which, slots)
        visible = session.visible[rows] if keep_rows else session.visible
        visible[which, slots] = 0
        offsets = np.arange(seq, dtype=np.int64)[None, :]
        visible[:, past:past + seq] = offsets >= pad[:, None]
        positions = np.maximum(start[:, None] + offsets - pad[:, None], start[:, None])  # fillers repeat the start
        inputs = {
            input_name: x,
            "attention_mask": visible[:, : past + seq],
            "position_ids": positions,
            "beam_idx": rows,
        }
        if logits_index is not None:
            inputs["logits_index"] = logits_index
        t0 = time.perf_counter()
        output = infer_first(session.request, inputs)
        elapsed = (time.perf_counter() - t0) * 1000
        if keep_rows:
            session.reserved = [session.reserved[r] for r in rows]
            session.row_start = [session.row_start[r] for r in rows]
        session.visible, session.rows, session.length = visible, batch, past + seq
        _trim_window(session)
    return output, elapsed


def _check_window(session: KVSession, rows: np.ndarray | None, which: np.ndarray, slots: np.ndarray) -> None:
    """Raise ``ChunkError`` unless every row's last ``window - 1`` visible slots (after hiding ``slots`` of
    ``which``; ``rows``: the rows kept, in order) are held by the sliding-window layers' states. Without hides it
    holds: a trim keeps each row's last ``keep`` visible slots and everything after them."""
    if session.sliding is None or not any(session.row_start) or not slots.size:
        return
    visible = (session.visible[rows] if rows is not None else session.visible)[:, : session.length].copy()
    visible[which, slots] = 0
    held = np.asarray(session.row_start)[rows] if rows is not None else np.asarray(session.row_start)
    needed = needed_slots(visible, session.length, session.sliding.window - 1)
    short = np.flatnonzero(needed < held)
    if short.size:
        r = int(short[0])
        raise ChunkError(f"session {shown_id(session.session_id)}: the sliding-window layers no longer hold slot "
                         f"{needed[r]} of row {r} (they hold {held[r]}..{session.length - 1}); hide at most "
                         f"{session.sliding.margin} slots of the last step")


def _trim_window(session: KVSession) -> None:
    """Drop the sliding-window layers' oldest slots once ``trim_every`` of them are no row's last ``keep``
    visible slots (fleet_common/sliding_kv.py)."""
    sliding = session.sliding
    if sliding is None or session.length - session.local_start < sliding.held_max:
        return
    start = first_needed(session.visible, session.length, sliding.keep)
    if start - session.local_start >= sliding.trim_every:
        cut_states(session.request, sliding, start - session.local_start)
        session.local_start = start
        session.row_start = [max(r, start) for r in session.row_start]


def compact(session: KVSession, past_length: int, hide_slots: list[int],
            hide_rows: list[int] | None = None) -> tuple[int, float]:
    """Drop the invisible slots of ``session`` (after hiding ``hide_slots`` of ``hide_rows``): one
    rewrite of every KV state tensor [rows, kv_heads, slots, head_dim], keeping each row's visible
    slots in order and ending at the last slot; rows with fewer visible slots are padded at the front with
    invisible ones (every row's recent slots line up, so the sliding-window layers hold as few as one row needs:
    fleet_common/sliding_kv.py). Positions are not touched (keys are stored rotated), so attention over the
    result is unchanged.

    Returns (new physical length, milliseconds). Raises ``SessionConflict`` when ``past_length``
    disagrees with the session and ``ChunkError`` for hide slots outside it.
    """
    with session.lock:
        _check_open(session, past_length)
        which, slots = _hide_index(session, hide_slots, hide_rows, session.rows)
        t0 = time.perf_counter()
        session.visible[which, slots] = 0
        keeps = [np.flatnonzero(session.visible[r, : session.length]) for r in range(session.rows)]
        length = max(len(k) for k in keeps)
        if length < session.length:
            local = session.sliding.states if session.sliding is not None else frozenset()
            held = [keep[keep >= start] for keep, start in zip(keeps, session.row_start)]  # real local KV
            local_start = length - max(h.size for h in held)
            for state in session.request.query_state():
                kv = state.state.data  # [rows, kv_heads, slots, head_dim]
                if state.name in local:
                    state.state = ov.Tensor(pack_local(kv, held, session.local_start, local_start, length))
                    continue
                packed = np.zeros((kv.shape[0], kv.shape[1], length, kv.shape[3]), dtype=kv.dtype)
                for r, keep in enumerate(keeps):
                    packed[r, :, length - len(keep):] = kv[r, :, keep, :].transpose(1, 0, 2)
                state.state = ov.Tensor(packed)
            session.local_start, session.row_start = local_start, [length - h.size for h in held]
            session.visible[:] = 0
            for r, keep in enumerate(keeps):
                session.visible[r, length - len(keep): length] = 1
            session.length = length
            session.compactions += 1
        return session.length, (time.perf_counter() - t0) * 1000


def merge(session_id: str, sources: list[KVSession], request: ov.InferRequest, max_context: int) -> KVSession:
    """One batch-group session holding the rows of ``sources`` in order (each source's rows keep
    their order): every KV state tensor is concatenated along the batch axis, shorter sources padded
    at the front with invisible slots (every row ends at the last slot, as ``compact`` packs them). A single
    source is renamed without copying (``request`` unused).

    Each row keeps the reservation it had. The sources are closed (their ``request`` set to None).
    ``max_context`` must cover every source's length; raises ``ContextOverflow`` otherwise and
    ``SessionConflict`` for a closed source.
    """
    locks = [s.lock for s in sources]
    for lock in locks:
        lock.acquire()
    try:
        for s in sources:
            _check_open(s, s.length)
        length = max(s.length for s in sources)
        if length > max_context:
            raise ContextOverflow(f"merged length {length} exceeds max context {max_context}")
        rows = sum(s.rows for s in sources)
        visible = np.zeros((rows, max_context), dtype=np.int64)
        r = 0
        for s in sources:
            visible[r:r + s.rows, length - s.length: length] = s.visible[:, : s.length]
            r += s.rows
        local = sources[0].sliding.states if sources[0].sliding is not None else frozenset()
        local_start = min((s.local_start + length - s.length for s in sources if s.length), default=length)
        row_start = [start + length - s.length if s.length else length for s in sources for start in s.row_start]
        if len(sources) == 1:
            request = sources[0].request
        else:
            request.reset_state()
            parts = [{st.name: st.state.data for st in s.request.query_state()} for s in sources]
            for state in request.query_state():
                arrays = [p[state.name] for p in parts]
                head = arrays[0]
                first = local_start if state.name in local else 0  # a local state holds [local_start, length)
                merged = np.zeros((rows, head.shape[1], length - first, head.shape[3]), dtype=head.dtype)
                r = 0
                for s, a in zip(sources, arrays):
                    if s.length:  # a session that never ran a chunk holds an empty state (batch 0 too)
                        held = (s.local_start if state.name in local else 0) + length - s.length
                        merged[r:r + s.rows, :, held - first:] = a
                    r += s.rows
                state.state = ov.Tensor(merged)
        for s in sources:
            s.request = None
        return KVSession(session_id, request, max_context, rows=rows, length=length, visible=visible,
                         reserved=[r for s in sources for r in s.reserved], sliding=sources[0].sliding,
                         local_start=local_start, row_start=row_start)
    finally:
        for lock in locks:
            lock.release()


def copy_prefix(session_id: str, source: KVSession, row: int, tokens: int, request: ov.InferRequest,
                max_context: int) -> KVSession:
    """A new one-row session holding the first ``tokens`` visible slots of ``row`` of ``source``, packed
    (slot i holds logical position i: a row's visible slots hold its tokens in order, keys stored rotated,
    so attention over the copy is unchanged). ``source`` is not modified. The new session reserves
    ``max_context`` slots. A retained conversation's KV is taken this way (prefix caching).

    Raises ``ChunkError`` for a row or token count the source does not have, ``ContextOverflow`` when
    ``max_context < tokens``, ``SessionConflict`` for a closed source.
    """
    with source.lock:
        _check_open(source, source.length)
        if not 0 <= row < source.rows:
            raise ChunkError(f"row {row} is not one of the session's {source.rows}")
        keep = np.flatnonzero(source.visible[row, : source.length])
        if not 0 < tokens <= len(keep):
            raise ChunkError(f"cannot copy {tokens} tokens: row {row} holds {len(keep)} visible slots")
        if tokens > max_context:
            raise ContextOverflow(f"copying {tokens} tokens exceeds max context {max_context}")
        keep = keep[:tokens]
        contiguous = keep[-1] == tokens - 1  # nothing hidden before the copied slots: one slice
        local, held = _held_prefix(source, row, keep)
        request.reset_state()
        states = {st.name: st.state.data for st in source.request.query_state()}
        for state in request.query_state():
            kv = states[state.name]  # [rows, kv_heads, slots, head_dim]
            if state.name in local:  # a sliding-window layer's: slots [local_start, length) of the source
                part = kv[row:row + 1, :, held - source.local_start]
            else:
                part = kv[row:row + 1, :, :tokens] if contiguous else kv[row:row + 1, :, keep]
            state.state = ov.Tensor(np.ascontiguousarray(part))
    copy = KVSession(session_id, request, max_context, length=tokens, sliding=source.sliding,
                     local_start=tokens - held.size)
    copy.visible[0, :tokens] = 1
    return copy


def _held_prefix(source: KVSession, row: int, keep: np.ndarray) -> tuple[frozenset[str], np.ndarray]:
    """(the local states' names, the slots of ``keep`` they hold) for a copy of the visible slots ``keep`` of
    ``row`` of ``source``; raises ``PrefixNotHeld`` when they no longer hold the last ``window - 1`` of them
    (the row's own ``row_start`` counts: a merged row may hold less than the state's ``local_start``)."""
    if source.sliding is None:
        return frozenset(), keep
    start = source.row_start[row]
    held = keep[keep >= start]
    if held.size < min(keep.size, source.sliding.window - 1):
        raise PrefixNotHeld(f"cannot copy {keep.size} tokens of session {shown_id(source.session_id)}: its "
                         f"sliding-window layers hold only its slots from {start} on, not the last "
                         f"{source.sliding.window - 1} of the prefix (llama-server re-processes such a prompt too)")
    return source.sliding.states, held


def unpack_token_mask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """An allowed-token bitmask [N, ceil(V / 32)] int32 (bit j of word i: token 32 i + j; llguidance's and
    xgrammar's layout) unpacked to booleans [N, V]."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def top_candidates(logits: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` token ids and their log-softmax (over the full vocabulary) per position.

    ``logits``: [N, V] float32. ``allowed``: [N, V] bool (grammar-constrained decoding): the other tokens'
    logits are -inf first, so the candidates are allowed ones and the log-softmax is over the allowed tokens
    (a position with fewer than ``k`` allowed tokens returns the rest at -inf). Returns (ids [N, k] int32
    best first, logprobs [N, k] float32).
    """
    k = max(1, min(k, logits.shape[-1]))
    logits = logits.astype(np.float32, copy=False)
    if allowed is not None:
        logits = np.where(allowed, logits, np.float32(-np.inf))
    peak = logits.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))  # [N, 1]
    if k == 1:
        ids = logits.argmax(axis=-1)[:, None]
    else:
        part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
        order = np.argsort(-np.take_along_axis(logits, part, axis=-1), axis=-1, kind="stable")
        ids = np.take_along_axis(part, order, axis=-1)
    return ids.astype(np.int32), (np.take_along_axis(logits, ids, axis=-1) - lse).astype(np.float32)
