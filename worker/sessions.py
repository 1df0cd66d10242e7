"""The sessions of one worker: each a ``KVSession`` (one InferRequest whose state *is* the KV cache,
plus the visibility of every physical slot). Sessions expire when idle, or when the coordinator that
made them stopped calling (its owner lease lapsed), and are capped in number."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

from fleet_common.runtime import ContextOverflow, KVSession, copy_prefix, merge, shown_id
from fleet_common.sliding_kv import SlidingKV


def _libc_trim():  # noqa: ANN202
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so a closed session's KV shows up
    as freed in the worker's RSS instead of staying mapped in the allocator's arenas."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class SessionError(Exception):
    """Base of session-store errors; ``code`` names the gRPC status the server maps it to."""

    code = "INTERNAL"


class BadMerge(SessionError):
    code = "INVALID_ARGUMENT"


class SessionTooLarge(SessionError):
    """The session's KV would not fit the worker's whole budget even when it is empty."""

    code = "OUT_OF_RANGE"


class SessionNotFound(SessionError):
    code = "NOT_FOUND"


class SessionLimit(SessionError):
    code = "RESOURCE_EXHAUSTED"


def _not_found(session_id: str) -> SessionNotFound:
    return SessionNotFound(f"unknown session {shown_id(session_id)} (never opened, closed, or expired when idle)")


class SessionStore:
    """Open/get/close sessions with a cap, a KV memory budget and idle expiry; thread-safe.

    ``make_request`` creates a fresh InferRequest from the worker's one CompiledModel. A session
    reserves ``max_context * kv_bytes_per_slot`` bytes of ``kv_budget_bytes`` (0 = no budget) when it
    opens, so one admitted session can always grow to its max context.

    ``sliding`` (a stage with sliding-window layers, fleet_common/sliding_kv.py): its sessions' local states hold
    at most about ``held_max`` slots, so of the ``sliding_bytes_per_slot`` those layers take of each slot, a
    session reserves at most ``reserved_slots`` slots' worth.
    """

    def __init__(self, make_request: Callable[[], object], max_sessions: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, kv_bytes_per_slot: int = 0,
                 kv_budget_bytes: int = 0, owner_timeout_s: float = 30.0, sliding: SlidingKV | None = None,
                 sliding_bytes_per_slot: int = 0) -> None:
        self._make_request = make_request
        self.kv_bytes_per_slot = kv_bytes_per_slot
        self.sliding, self.sliding_bytes_per_slot = sliding, sliding_bytes_per_slot
        self.kv_budget_bytes = kv_budget_bytes
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, KVSession] = {}
        self.owner_timeout_s = owner_timeout_s
        self._owner: dict[str, str] = {}  # session id -> the coordinator that made it ("" = none named)
        self._seen: dict[str, float] = {}  # owner -> when it last renewed (Info) or made a session
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_reserved_bytes(self) -> int:
        """KV bytes reserved by open sessions (each for its max context)."""
        with self._lock:
            return self._reserved_bytes()

    def kv_bytes(self, slots: int) -> int:
        """KV bytes a row of ``slots`` slots may come to hold (the sliding-window layers' capped)."""
        if self.sliding is None:
            return slots * self.kv_bytes_per_slot
        beyond = max(0, slots - self.sliding.reserved_slots)
        return slots * self.kv_bytes_per_slot - beyond * self.sliding_bytes_per_slot

    def _reserved_bytes(self, skip: tuple[str, ...] = ()) -> int:
        return sum(self.kv_bytes(r) for sid, s in self._sessions.items() if sid not in skip for r in s.reserved)

    def renew(self, owner: str) -> None:
        """``owner`` (a coordinator process) is alive: its sessions are kept ``owner_timeout_s`` more."""
        if owner:
            self._seen[owner] = self._clock()

    def _own(self, session_id: str, owner: str) -> None:
        if owner:
            self._owner[session_id] = owner
            self._seen[owner] = self._clock()

    def open(self, session_id: str, max_context: int, owner: str = "") -> KVSession:
        """Create (or reset, if it exists) a session. Raises ``SessionLimit`` at the session cap or
        when its KV for ``max_context`` slots does not fit the budget now, ``SessionTooLarge`` when it
        would not fit even an empty worker."""
        with self._lock:
            old = self._sessions.get(session_id)
            self._admit(max_context, skip=(session_id,), new=old is None)
            request = old.request if old is not None else self._make_request()
            if old is not None:
                request.reset_state()
            session = KVSession(session_id, request, max_context, last_used=self._clock(), sliding=self.sliding)
            self._sessions[session_id] = session
            self._own(session_id, owner)
            return session

    def resume(self, session_id: str, max_context: int) -> KVSession:
        """Keep ``session_id``'s KV and change its reservation to ``max_context`` slots (at least its
        length): a retained conversation taken up by its next request, or one set aside. Raises
        ``SessionNotFound``, ``ContextOverflow`` below its length, and what ``open`` raises for room."""
        with self._lock:
            session = self._live(session_id)
            if session.rows != 1 or max_context < session.length:
                raise ContextOverflow(f"session {shown_id(session_id)} holds {session.rows} rows of "
                                      f"{session.length} slots; cannot resume it with {max_context}")
            self._admit(max_context, skip=(session_id,), new=False)
            session.resize(max_context)
            session.reserved = [max_context]
            session.last_used = self._clock()
            return session

    def copy(self, session_id: str, source: str, row: int, tokens: int, max_context: int,
             detach: bool = False, owner: str = "") -> KVSession:
        """A new session ``session_id`` with the first ``tokens`` visible slots of ``row`` of ``source``
        (``fleet_common.runtime.copy_prefix``); ``source``'s KV stays as it is. ``detach``: the row is
        leaving ``source`` (its next step drops it), so its reservation moves to the copy, which then needs
        no new room up to it. Runs on the inference thread. Raises ``SessionNotFound``, ``BadMerge`` when
        ``session_id`` exists, ``ChunkError`` for a bad row or count, and what ``open`` raises for room."""
        with self._lock:
            if session_id in self._sessions:
                raise BadMerge(f"session {shown_id(session_id)} exists; a copy needs a new id")
            src = self._live(source)
            moved = src.reserved[row] if detach and 0 <= row < len(src.reserved) else 0
            self._admit(max(0, max_context - moved), new=True)
            if moved:
                src.reserved[row] = 0  # the copy holds that row's KV from now on
            placeholder = KVSession(session_id, None, 0)  # holds the id (and its reservation) while copying
            placeholder.reserved = [max_context]
            placeholder.last_used = self._clock()  # not idle: the expiry sweep must leave it
            self._sessions[session_id] = placeholder
            self._own(session_id, owner)
        try:
            session = copy_prefix(session_id, src, row, tokens, self._make_request(), max_context)
        except BaseException:
            with self._lock:
                self._sessions.pop(session_id, None)
            raise
        session.last_used = self._clock()
        with self._lock:
            if self._sessions.get(session_id) is not placeholder:  # closed while copying
                raise SessionNotFound(f"session {shown_id(session_id)} was closed while it was being copied")
            self._sessions[session_id] = session
        return session

    def _live(self, session_id: str) -> KVSession:
        session = self._sessions.get(session_id)
        if session is None or session.request is None:
            raise _not_found(session_id)
        return session

    def _admit(self, slots: int, skip: tuple[str, ...] = (), new: bool = True) -> None:
        """Raise unless a session of ``slots`` KV slots fits now (the ``skip`` sessions' reservations
        not counted: they are being replaced); ``new``: it adds a session (the cap counts)."""
        mib = 1 << 20
        need = self.kv_bytes(slots)
        if self.kv_budget_bytes and need > self.kv_budget_bytes:
            raise SessionTooLarge(f"the session needs {need / mib:.1f} MiB of KV for {slots} slots, more "
                                  f"than this worker's whole budget of {self.kv_budget_bytes / mib:.0f} MiB "
                                  "(--kv-budget-mb)")
        reserved = self._reserved_bytes(skip)
        if new and len(self._sessions) >= self.max_sessions:
            raise SessionLimit(f"worker holds {self.max_sessions} sessions (its --max-sessions); retry later")
        if self.kv_budget_bytes and reserved + need > self.kv_budget_bytes:
            raise SessionLimit(f"KV budget full: the session needs {need / mib:.1f} MiB for {slots} slots, "
                               f"{(self.kv_budget_bytes - reserved) / mib:.1f} MiB of the worker's "
                               f"{self.kv_budget_bytes / mib:.0f} MiB (--kv-budget-mb) are free; retry later")

    def merge(self, session_id: str, sources: list[str], max_context: int, owner: str = "") -> KVSession:
        """Replace the ``sources`` sessions by one batch group ``session_id`` holding their rows in
        order (``fleet_common.runtime.merge``); each row keeps the KV reservation it was admitted with,
        so grouping never changes admission.

        Raises ``SessionNotFound`` for an unknown source, ``BadMerge`` for
        repeated sources or a group id that names another live session, ``ContextOverflow`` when a
        source is longer than ``max_context``."""
        with self._lock:
            if len(set(sources)) != len(sources) or not sources:
                shown = ", ".join(map(shown_id, sources[:8]))
                raise BadMerge(f"merge sources must be distinct and non-empty, got [{shown}]")
            missing = [sid for sid in sources if sid not in self._sessions]
            if missing:
                raise _not_found(missing[0])
            if session_id in self._sessions and session_id not in sources:
                raise BadMerge(f"session {shown_id(session_id)} exists and is not one of the merged sessions")
            parts = [self._sessions[sid] for sid in sources]
            request = self._make_request() if len(parts) > 1 else None
            group = merge(session_id, parts, request, max_context)
            group.last_used = self._clock()
            for sid in sources:
                del self._sessions[sid]
                self._owner.pop(sid, None)
            self._sessions[session_id] = group
            self._own(session_id, owner)
        release_free_memory()
        return group

    def get(self, session_id: str) -> KVSession:
        """The live session; raises ``SessionNotFound`` (never opened, closed, or expired)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise _not_found(session_id)
            session.last_used = self._clock()
            return session

    def close(self, session_id: str) -> KVSession | None:
        """Drop a session and free its KV state; returns it, or None if it did not exist."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            self._owner.pop(session_id, None)
        if session is not None:
            with session.lock:
                if session.request is not None:  # None: a copy still being made (it is dropped when done)
                    session.request.reset_state()
                session.request = None  # drop the InferRequest: its KV state memory goes with it
            release_free_memory()
        return session

    def expire(self) -> list[str]:
        """Close sessions idle longer than ``idle_timeout_s``, and those of owners not heard from for
        ``owner_timeout_s`` (a coordinator that died: its requests, batch groups and retained KV are
        never closed by it); return their ids."""
        now = self._clock()
        with self._lock:
            gone = {o for o, seen in self._seen.items() if now - seen > self.owner_timeout_s}
            stale = [sid for sid, s in self._sessions.items()
                     if now - s.last_used > self.idle_timeout_s or self._owner.get(sid) in gone]
            for owner in gone:
                del self._seen[owner]
        for sid in stale:
            self.close(sid)
        return stale

    def sessions(self) -> list[KVSession]:
        with self._lock:
            return list(self._sessions.values())
