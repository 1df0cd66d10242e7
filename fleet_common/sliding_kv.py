"""The KV states of sliding-window layers, capped near their window.

Gemma 3's local layers (five of every six) and gpt-oss's (every other one) attend only to keys fewer than
``window`` logical positions back (sliding-window attention: Beltagy et al. 2020, "Longformer"; Gemma Team 2025,
"Gemma 3 Technical Report" §2.1, which keeps the local layers' KV at the window for this reason). Their older
KV is never read again, so a session's local states drop their oldest slots: they hold the physical slots
``[local_start, length)`` while the global layers hold ``[0, length)``, and the graph cuts each local layer's
mask to the slots its state holds (compiler/layers.py ``attention``, ``window_kv``). llama.cpp does the same
(its SWA KV cache holds the window plus one batch); as llama-server then re-processes a prompt whose shared
prefix that cache no longer holds, fleet's prefix cache does (``copy_prefix`` refuses such a copy, the
request is prefilled in full).

Hidden slots (rejected drafts, batch padding) hold no logical position, so "the window" is a count of each
row's *visible* slots: the next query of a row needs its last ``window - 1`` visible slots. ``trim`` keeps each
row's last ``keep = window - 1 + margin`` (the margin for drafts hidden after a trim: ``spec_k`` is at most 16)
and runs once ``trim_every`` slots can go, so one copy of the local states is amortised over that many tokens.
``run_chunk`` checks before each chunk that every needed slot is held and refuses the chunk otherwise
(``ChunkError``, state untouched), so a violated invariant is an error, never a wrong answer.

The rows of a batch group need not hold all of ``[local_start, length)``: a row merged from a session trimmed
further than the others (``merge``), or packed by a compaction beside rows with more slots before the cut,
has zeros there, beyond its window. Each row's own first held slot (``KVSession.row_start``) is what the
checks and ``copy_prefix`` go by: a retained conversation's copy must never take those zeros for its KV.
``merge`` and ``compact`` align the rows at their end (shorter ones padded at the front), so a short row beside
a long trimmed one needs no more local slots than its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import openvino as ov


@dataclass(frozen=True)
class SlidingKV:
    """The sliding-window layers of one compiled model (a stage or a draft).

    ``window``: a local layer's query sees keys fewer than this many logical positions back.
    ``states``: the variable ids of those layers' K and V states (``kv_state_names``).
    ``margin``: visible slots kept beyond the window (module docstring); ``min_trim``: the fewest slots a trim
    drops (tests make it small)."""

    window: int
    states: frozenset[str]
    margin: int = 32
    min_trim: int = 64

    @property
    def keep(self) -> int:
        """Visible slots of each row a trim keeps."""
        return self.window - 1 + self.margin

    @property
    def trim_every(self) -> int:
        """Slots that must be droppable before a trim copies the local states."""
        return max(self.keep, self.min_trim)

    @property
    def held_max(self) -> int:
        """Physical slots a local state holds at most between chunks of one token (a chunk of S adds S)."""
        return self.keep + self.trim_every

    @property
    def reserved_slots(self) -> int:
        """Slots a row's local states are reserved (worker admission, the planner): twice ``held_max``, the
        second for a chunk's own tokens."""
        return 2 * self.held_max


def kv_state_names(layer: int) -> tuple[str, str]:
    """The variable ids of layer ``layer``'s K and V states in a stage's IR (optimum-intel's names)."""
    return f"past_key_values.{layer}.keypresent.{layer}.key", f"past_key_values.{layer}.valuepresent.{layer}.value"


def sliding_kv(window: int, layers: Iterable[int]) -> SlidingKV | None:
    """The ``SlidingKV`` of a model whose local ``layers`` (global indices) see ``window`` positions; None
    without local layers or window."""
    names = frozenset(name for layer in layers for name in kv_state_names(layer))
    return SlidingKV(int(window), names) if window and names else None


def needed_slots(visible: np.ndarray, length: int, count: int) -> np.ndarray:
    """The earliest physical slot each row still needs when it needs its last ``count`` visible slots (all of
    them when it has fewer): ``visible`` [rows, >= length] of 1/0; [rows] int64, ``length`` for a row without one."""
    out = np.full(len(visible), length, dtype=np.int64)
    for r, row in enumerate(visible):
        held = np.flatnonzero(row[:length])
        if held.size:
            out[r] = held[max(0, held.size - count)]
    return out


def first_needed(visible: np.ndarray, length: int, count: int) -> int:
    """The earliest physical slot any row still needs (``needed_slots``); ``length`` when no row has one."""
    return int(needed_slots(visible, length, count).min(initial=length))


def cut_states(request: ov.InferRequest, sliding: SlidingKV, drop: int) -> None:
    """Drop the first ``drop`` slots of every local state of ``request`` ([rows, kv_heads, slots, head_dim])."""
    for state in request.query_state():
        if state.name in sliding.states:
            kv = state.state.data
            state.state = ov.Tensor(np.ascontiguousarray(kv[:, :, drop:]))


def pack_local(kv: np.ndarray, held: list[np.ndarray], local_start: int, new_start: int,
               length: int) -> np.ndarray:
    """A local state ``kv`` [rows, kv_heads, slots held, head_dim] (physical slots ``[local_start, ...)``)
    compacted as ``compact`` packs the global ones, to the end: row r's visible slots whose KV it holds,
    ``held[r]`` (physical indices), become the last ``held[r].size`` of ``[new_start, length)``; the slots
    before them are zeros (a row's older visible slots, beyond its window: the mask hides them)."""
    packed = np.zeros((kv.shape[0], kv.shape[1], length - new_start, kv.shape[3]), dtype=kv.dtype)
    for r, slots in enumerate(held):
        if slots.size:
            packed[r, :, packed.shape[2] - slots.size:] = kv[r, :, slots - local_start, :].transpose(1, 0, 2)
    return packed
