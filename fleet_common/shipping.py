"""Ship one stage of a build to an empty worker over gRPC (issue 30): the sender of ``fleet.v1.StageStore``.

``ship_stage`` asks the worker what it holds of the stage's files (``StageStatus``, which also gives it the
build's manifest), sends only what is missing, from the offset it holds (a cut transfer resumes there),
in ``CHUNK_BYTES`` pieces read one at a time (memory stays bounded by gRPC's flow control: a few pieces in
flight), one ``PutStage`` call per file with a deadline that grows with its bytes, then ``load_stage``
asks the worker to hash the files against the manifest and serve the stage. The worker writes each file
through a partial file renamed into place only once its sha256 equals the manifest's (worker/stage_cache.py).

A coordinator that plans and ships (coordinator/fleet/planned.py ``ship_plan``) calls ``ship_stage`` then
``load_stage`` per worker of the plan, on a channel from ``fleet_common.security.open_channel`` (so with
``--secret`` every call carries its token). ``bench/wan/empty_fleet.py`` times it through ``fleet-wan`` links.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from . import fleet_pb2 as pb
from . import fleet_pb2_grpc as pb_grpc
from .manifest import MANIFEST_NAME, load_manifest
from .segments import Segment, file_segments

log = logging.getLogger(__name__)

CHUNK_BYTES = 2 << 20  # one PutStage message: 2 MiB
STATUS_TIMEOUT_S = 30.0  # StageStatus (the worker writes the manifest, stats the files)
MIN_RATE_BYTES_S = 1 << 20  # a file's PutStage deadline: 30 s + its missing bytes at 1 MiB/s
LOAD_TIMEOUT_S = 600.0  # LoadStage: hashing and compiling a stage of GBs
RESUMES, RESUME_AFTER_S = 4, 1.0  # a cut transfer: resumed this many times, first after 1 s, doubling
REUSE_RATE_BYTES_S = 100 << 20  # a ReuseStage's deadline: 30 s + the file's bytes copied at 100 MiB/s
MIN_REUSE_BYTES = 64 << 10  # a held segment is copied there, not sent, from this size (a round trip each run)
# the link, not the worker; ABORTED: the worker still writes the file for the call the cut ended (its last piece)
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})

BUSY = "retry when one has ended"  # in a worker's RESOURCE_EXHAUSTED for its busy slots (worker/stage_slot.py):
# retried as a cut transfer is; its other RESOURCE_EXHAUSTED (a full disk) is not
CORE_CUT = "Internal error from Core"  # gRPC's own INTERNAL when the connection dies under a stream's write (seen
# on a fleet-wan link cut mid-PutStage): a cut, not the worker's answer (a worker's INTERNAL says what failed)


def resumable(exc: ShippingError) -> bool:
    """Whether a failed attempt is a cut link or a busy worker, so ``ship_stage`` resumes it from what the worker
    holds (``RESUMABLE``, a busy worker's RESOURCE_EXHAUSTED, gRPC core's INTERNAL of a cut connection), not a
    refusal (a wrong hash, a full disk, a bad path), which a resumed attempt would only repeat."""
    if exc.code in RESUMABLE:
        return True
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BUSY in str(exc)
    return exc.code is grpc.StatusCode.INTERNAL and CORE_CUT in str(exc)

Progress = Callable[[str, int, int], None]
"""``progress(path, bytes done, bytes of the file)``, called after each piece sent, once per file at its start
with the bytes the worker already holds, and after a PutStage call that failed with the bytes the worker had
accepted before it (the pieces it refused unread are not counted: a bar goes back)."""


class ShippingError(RuntimeError):
    """A stage that could not be shipped or loaded: ``str()`` names the worker, the file and the worker's
    reason (a wrong hash with both hashes, a full disk with the bytes free, ...); ``code`` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ShipReport:
    """What ``ship_stage`` did: ``sent_bytes`` (file bytes sent this time), ``held_bytes`` (already on the
    worker before), ``reused_bytes`` (copied there from the other stages it holds), ``files`` (the stage's
    files), ``completed`` (files the worker checked and put in place this time), ``seconds``, ``already_served`` (a coordinator found it serving the stage: nothing was asked)."""

    stage: int
    files: list[str]
    sent_bytes: int = 0
    held_bytes: int = 0
    reused_bytes: int = 0  # copied on the worker from the stages it holds (ReuseStage), not sent
    completed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    already_served: bool = False  # the worker served this stage of this build already: nothing shipped or loaded

    @property
    def mb_per_s(self) -> float:
        """Throughput of the bytes sent, MB/s (1e6 bytes)."""
        return self.sent_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


async def _pieces(path: Path, rel: str, model_id: str, sha: str, offset: int, size: int, chunk_bytes: int,
                  progress: Progress | None, end: int | None = None) -> AsyncIterator[pb.StageChunk]:
    """``path``'s bytes from ``offset`` to ``end`` (default ``size``, the file's) as StageChunks of
    ``chunk_bytes``, read one at a time (off the event loop: a read from disk can take milliseconds)."""
    end = size if end is None else end
    f = await asyncio.to_thread(open, path, "rb")
    try:
        if offset == end == size:  # one empty piece at the end: a file of 0 bytes, or one the worker holds every
            # byte of unchecked (stopped before its rename): the worker checks and puts a file in place at its last
            yield pb.StageChunk(model_id=model_id, manifest_sha256=sha, path=rel, offset=size, data=b"", size=size)
        while offset < end:
            data = await asyncio.to_thread(os.pread, f.fileno(), min(chunk_bytes, end - offset), offset)
            if not data:
                raise ShippingError(f"{path} shrank while it was sent (at {offset} of {size} bytes)")
            yield pb.StageChunk(model_id=model_id, manifest_sha256=sha, path=rel, offset=offset, data=data, size=size)
            offset += len(data)
            if progress is not None:
                progress(rel, offset, size)
    finally:
        f.close()


def _failed(address: str, what: str, exc: grpc.aio.AioRpcError) -> ShippingError:
    return ShippingError(f"worker {address}: {what}: {exc.code().name}: {exc.details()}", exc.code())


async def ship_stage(channel: grpc.aio.Channel, build_dir: Path, shard: int, progress: Progress | None = None, *,
                     address: str = "", chunk_bytes: int = CHUNK_BYTES, resumes: int = RESUMES) -> ShipReport:
    """Send stage ``shard`` of the build at ``build_dir`` to the worker on ``channel`` (``address`` names it
    in errors): only the bytes it lacks, resuming partial files (module doc). A transfer cut or a busy worker
    (``resumable``: the connection lost, a deadline passed, every slot taken) is resumed from what the worker
    holds up to ``resumes`` times, ``RESUME_AFTER_S`` apart and doubling (1, 2, 4, 8 s: a Wi-Fi drop, a restarted
    router); the report then counts the bytes of every attempt. Does not load it (``load_stage``). Raises
    ``ShippingError`` (the worker refused: a wrong hash, a full disk, a bad path; or the call failed or
    passed its deadline ``resumes`` + 1 times), ``ManifestError`` for a bad build, ``OSError`` for an
    unreadable file."""
    # state["held"]: what the worker held before the first attempt; state["completed"]: files put in place so far;
    # state["reused"]: bytes the worker copied from its stages so far; state["reuse"]: whether it has ReuseStage
    t0, sent, state = time.perf_counter(), 0, {"completed": [], "reused": 0, "reuse": True}
    for attempt in range(resumes + 1):
        counter = [0]
        try:
            report = await _ship_once(channel, build_dir, shard, progress, address, chunk_bytes, counter, state)
        except ShippingError as exc:
            sent += counter[0]
            if not resumable(exc) or attempt == resumes:
                raise
            wait = RESUME_AFTER_S * 2 ** attempt
            log.warning("%s: %d bytes accepted by the worker so far; resuming in %.0f s (attempt %d of %d)", exc, sent,
                        wait,
                        attempt + 2, resumes + 1)
            await asyncio.sleep(wait)
            continue
        if attempt:  # the bytes that arrived in the earlier attempts are held now: they were sent by this call
            earlier_reused = state["reused"] - report.reused_bytes
            report.sent_bytes += report.held_bytes - state["held"] - earlier_reused
            report.reused_bytes = state["reused"]
            report.held_bytes = state["held"]
            report.completed = list(state["completed"])
            report.seconds = time.perf_counter() - t0
        return report
    raise AssertionError("unreachable")


async def _ship_once(channel: grpc.aio.Channel, build_dir: Path, shard: int, progress: Progress | None,
                     address: str, chunk_bytes: int, counter: list[int], state: dict) -> ShipReport:
    """One attempt of ``ship_stage``; ``counter[0]`` counts the file bytes the worker accepted (PutStage's
    ``bytes_written``: also when a later call raises; not the pieces of a call that failed, which the next
    StageStatus counts as held),
    ``state["held"]`` is set to the bytes the worker held at the first attempt that got its StageStatus and
    ``state["completed"]`` gets each file put in place."""
    loaded = load_manifest(build_dir)
    manifest = loaded.manifest
    if not 0 <= shard < manifest.num_stages:
        raise ShippingError(f"stage {shard} out of range: {build_dir} has stages 0..{manifest.num_stages - 1}")
    stub = pb_grpc.StageStoreStub(channel)
    t0 = time.perf_counter()
    try:
        status = await stub.StageStatus(pb.StageStatusRequest(
            model_id=manifest.model_id, manifest_sha256=loaded.sha256, stage=shard,
            manifest=(Path(build_dir) / MANIFEST_NAME).read_bytes()), timeout=STATUS_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise _failed(address, f"StageStatus of stage {shard}", exc) from None
    wanted = [manifest.stages[shard].xml, manifest.stages[shard].bin]  # the files the sender sends: never the reply's
    if sorted(f.path for f in status.files) != sorted(wanted):
        raise ShippingError(f"worker {address}: StageStatus of stage {shard} names files "
                            f"{[f.path[:200] for f in status.files][:8]}, not the stage's {wanted}: refused",
                            grpc.StatusCode.INVALID_ARGUMENT)
    report = ShipReport(shard, [f.path for f in status.files])
    missing = 0
    sizes = {}
    for held in status.files:
        sizes[held.path] = os.path.getsize(Path(build_dir) / held.path)
        report.held_bytes += held.bytes if held.complete else min(held.bytes, sizes[held.path])
        missing += 0 if held.complete else sizes[held.path] - held.bytes
    state.setdefault("held", report.held_bytes)
    if missing > status.free_bytes:
        short = ", ".join(f.path for f in status.files if not f.complete)
        raise ShippingError(f"worker {address}: stage {shard} needs {missing:,} more bytes in its stage cache "
                            f"({short}), which has {status.free_bytes:,} free (on its disk, and under its "
                            "--stages-max-gb beside the build it serves)", grpc.StatusCode.RESOURCE_EXHAUSTED)
    for held in status.files:
        if held.complete:
            continue
        size, offset = sizes[held.path], held.bytes if held.bytes <= sizes[held.path] else 0  # longer: restarted
        if progress is not None:
            progress(held.path, offset, size)
        segments = await asyncio.to_thread(_segments, Path(build_dir), manifest.stages[shard]) \
            if held.path == manifest.stages[shard].bin and state["reuse"] and status.holds_stages else None
        try:
            await _send_file(stub, loaded, Path(build_dir), held.path, offset, size, segments, progress, address,
                             chunk_bytes, counter, report, state)
        except ShippingError as exc:  # bytes held before (a cut transfer's, or a lying sender's) were not the
            if not offset or exc.code != grpc.StatusCode.DATA_LOSS:  # file's: the worker deleted it, sent again whole
                raise
            log.warning("%s: sending it again from byte 0", exc)
            await _send_file(stub, loaded, Path(build_dir), held.path, 0, size, segments, progress, address,
                             chunk_bytes, counter, report, state)
        if held.path not in report.completed:  # never a success without the file in place
            raise ShippingError(f"worker {address}: {held.path} of stage {shard} was sent up to byte {size:,} but the "
                                "worker did not put it in place", grpc.StatusCode.DATA_LOSS)
    report.seconds = time.perf_counter() - t0
    log.info("stage %d shipped to %s: %d bytes sent, %d held already, %.1f s (%.1f MB/s), %d reused from the stages "
             "it holds", shard, address or "worker", report.sent_bytes, report.held_bytes, report.seconds,
             report.mb_per_s, report.reused_bytes)
    return report


_SEGMENTS: dict[tuple, list[Segment]] = {}  # (bin path, size, mtime_ns) -> its segments: hashed once per process


def _segments(build_dir: Path, entry) -> list[Segment] | None:  # noqa: ANN001 - fleet_common.manifest.StageEntry
    """The segments of stage ``entry``'s ``.bin`` (fleet_common/segments.py), or None when its xml does not
    give them (then the file is sent whole)."""
    binary = build_dir / entry.bin
    stat = binary.stat()
    key = (str(binary.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SEGMENTS:
        try:
            _SEGMENTS[key] = file_segments(build_dir / entry.xml, binary)
        except (ValueError, OSError) as exc:
            log.warning("%s: no segments (%s): sent whole", binary, exc)
            return None
    return _SEGMENTS[key]


async def _reuse(stub: pb_grpc.StageStoreStub, loaded, rel: str, size: int, segments: list[Segment],  # noqa: ANN001
                 address: str, state: dict) -> pb.ReuseReply | None:
    """ReuseStage of ``rel``: the worker copies what it holds from the end of its partial file; None (and
    ``state["reuse"]`` False) from a worker without it (UNIMPLEMENTED). Raises ``ShippingError``."""
    try:
        return await stub.ReuseStage(pb.ReuseRequest(
            model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, path=rel, size=size,
            segments=[pb.Segment(offset=s.offset, size=s.size, sha256=s.sha256) for s in segments]),
            timeout=30.0 + size / REUSE_RATE_BYTES_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.info("worker %s cannot build files from the stages it holds (ReuseStage): sending them whole", address)
            state["reuse"] = False
            return None
        raise _failed(address, f"ReuseStage of {rel}", exc) from None


async def _send_file(stub: pb_grpc.StageStoreStub, loaded, build_dir: Path, rel: str, offset: int,  # noqa: ANN001
                     size: int, segments: list[Segment] | None, progress: Progress | None, address: str,
                     chunk_bytes: int, counter: list[int], report: ShipReport, state: dict) -> None:
    """Bring ``rel`` on the worker from ``offset`` to ``size``: with ``segments``, runs the worker holds are
    copied there (``_reuse``) and only the runs between them are sent; else it is all sent. Updates
    ``report``, ``counter`` and ``state``. Raises ``ShippingError``."""
    held: list[bool] = []
    segments = segments if size else None  # a file of 0 bytes is one empty piece (_pieces)
    first = True
    while offset < size or first:
        first = False
        if segments is not None:
            reply = await _reuse(stub, loaded, rel, size, segments, address, state)
            if reply is None:
                segments = None
            else:
                held = list(reply.held)
                report.reused_bytes += reply.reused_bytes
                state["reused"] += reply.reused_bytes
                offset = reply.bytes
                if reply.reused_bytes and progress is not None:
                    progress(rel, offset, size)
                if offset >= size:
                    report.completed.append(rel)
                    state["completed"].append(rel)
                    return
        # send up to the next segment the worker holds that is worth a copy (a smaller one is sent with the rest)
        end = next((s.offset for s, h in zip(segments or [], held, strict=False)
                    if h and s.offset > offset and s.size >= MIN_REUSE_BYTES), size)
        before = counter[0]
        pieces = _pieces(build_dir / rel, rel, loaded.manifest.model_id, loaded.sha256, offset, size, chunk_bytes,
                         progress, end)
        try:
            reply = await stub.PutStage(pieces, timeout=30.0 + (end - offset) / MIN_RATE_BYTES_S)
        except grpc.aio.AioRpcError as exc:
            if progress is not None:  # the pieces that left are not the worker's until it says so (StageStatus)
                progress(rel, offset, size)
            raise _failed(address, f"PutStage of {rel} (from byte {offset:,} of {size:,})", exc) from None
        counter[0] = before + reply.bytes_written  # what the worker wrote, not what left this side
        report.sent_bytes += reply.bytes_written
        report.completed += list(reply.completed)
        state["completed"] += list(reply.completed)
        offset = end


async def load_stage(channel: grpc.aio.Channel, build_dir: Path, shard: int, *, address: str = "",
                     timeout_s: float = LOAD_TIMEOUT_S) -> pb.LoadStageReply:
    """Ask the worker on ``channel`` to serve stage ``shard`` of the build at ``build_dir`` from its cache
    (it hashes the files against the manifest first and refuses any that differ). Raises ``ShippingError``."""
    loaded = load_manifest(build_dir)
    try:
        return await pb_grpc.StageStoreStub(channel).LoadStage(pb.LoadStageRequest(
            model_id=loaded.manifest.model_id, manifest_sha256=loaded.sha256, stage=shard), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise _failed(address, f"LoadStage of stage {shard}", exc) from None


class RichProgress:
    """A ``Progress`` callback drawing one rich bar per file (rich is a runtime dependency; where it cannot be
    imported it logs each file's start and end). Use as a context manager around ``ship_stage``."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._bar = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> RichProgress:  # noqa: PYI034
        try:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            from .console import bar_console

            self._bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), console=bar_console())  # into a log: not wrapped at 80
            self._bar.__enter__()
        except ImportError:
            self._bar = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def __call__(self, path: str, done: int, total: int) -> None:
        """Show ``done`` of ``total`` bytes of ``path``."""
        if self._bar is None:
            if done in (0, total) or path not in self._tasks:
                self._tasks.setdefault(path, 0)
                log.info("%s%s: %d of %d bytes", self.label, path, done, total)
            return
        if path not in self._tasks:
            self._tasks[path] = self._bar.add_task(f"{self.label}{path}", total=total, completed=done)
        self._bar.update(self._tasks[path], completed=done)
