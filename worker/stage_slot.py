"""An empty worker's gRPC services (issue 30): ``fleet.v1.Stage`` through a slot that holds no stage until one
is loaded, and ``fleet.v1.StageStore``, which receives a stage's files into the stage cache
(worker/stage_cache.py) and loads them.

Until ``LoadStage`` the slot answers every Stage call but ``Info`` with UNAVAILABLE (``Info`` says the worker
is empty, with its capacity); afterwards each call goes to the loaded stage's ``StageService``, exactly as a
worker started with ``--shard N --model DIR`` serves it. Calls are authenticated by the server's interceptor
(fleet_common/security.py) like every other call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from fleet_common import PROTOCOL_VERSION
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.discovery import Capacity
from fleet_common.manifest import LoadedManifest, ManifestError
from fleet_common.security import Security
from fleet_common.segments import MAX_SEGMENTS, Segment
from fleet_common.shipping import BUSY
from fleet_common.wire import Malformed

from .log_role import set_role
from .put_slots import Put, PutSlots
from .receiving import ReceiveBars
from .server import StageService
from .stage_cache import MAX_MANIFEST_BYTES, StageCache, StageCacheError, stage_files

log = logging.getLogger(__name__)

MAX_STATUSES = 4  # StageStatus calls at once: each may hold a manifest of up to MAX_MANIFEST_BYTES being parsed
MAX_PUTS = 4  # PutStage calls at once: each holds up to a few pieces of up to 64 MiB (the gRPC message cap)
PIECE_TIMEOUT_S = 60.0  # a PutStage that sends no piece for this long is ended (its files freed for another sender)
EMPTY = "this worker serves no stage yet (an empty worker): ship it a stage (StageStore.PutStage) and LoadStage it"


class StageSlot(pb_grpc.StageServicer):
    """The Stage service of a worker that may serve nothing yet: ``service`` (None until a stage is loaded)
    answers every call; without one, calls get UNAVAILABLE and ``Info`` the worker's ``capacity``."""

    def __init__(self, worker_id: str, capacity: Capacity, security: Security | None = None) -> None:
        self.worker_id, self.capacity = worker_id, capacity
        self.security = security if security is not None else Security()  # to prove the fleet secret in Info
        self.service: StageService | None = None

    async def _serving(self, context: grpc.aio.ServicerContext) -> StageService:
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, EMPTY)
        return self.service

    async def OpenSession(self, request, context):
        return await (await self._serving(context)).OpenSession(request, context)

    async def CloseSession(self, request, context):
        return await (await self._serving(context)).CloseSession(request, context)

    async def Forward(self, request, context):
        return await (await self._serving(context)).Forward(request, context)

    async def Compact(self, request, context):
        return await (await self._serving(context)).Compact(request, context)

    async def Merge(self, request, context):
        return await (await self._serving(context)).Merge(request, context)

    async def Copy(self, request, context):
        return await (await self._serving(context)).Copy(request, context)

    async def Link(self, request_iterator, context):
        async for ack in (await self._serving(context)).Link(request_iterator, context):
            yield ack

    async def Subscribe(self, request, context):
        async for result in (await self._serving(context)).Subscribe(request, context):
            yield result

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        """The loaded stage's Info, or (empty) the worker's id, protocol, device and capacity."""
        if self.service is not None:
            reply = await self.service.Info(request, context)
        else:
            reply = pb.InfoReply(worker_id=self.worker_id, protocol_version=PROTOCOL_VERSION, empty=True,
                                 device=self.capacity.device, proof=self.security.prove(request.challenge,
                                                                                        self.worker_id))
        reply.memory_available_bytes = self.capacity.memory_available_bytes
        reply.ms_per_gb = self.capacity.ms_per_gb
        return reply


Loader = Callable[[LoadedManifest, int], Awaitable[StageService]]


class StageStoreService(pb_grpc.StageStoreServicer):
    """``fleet.v1.StageStore``: a stage's files into ``cache`` and loaded into ``slot`` by ``load`` (which
    opens the stage's ``StageService`` and announces it; worker/cli.py). One load at a time; a stage loaded
    again is a no-op, another one replaces it only when it holds no session. Each file received shows as a
    bar of ``bars`` (worker/receiving.py; default: rich bars on stderr)."""

    def __init__(self, cache: StageCache, slot: StageSlot, load: Loader, bars: ReceiveBars | None = None) -> None:
        self.cache, self.slot, self.load = cache, slot, load
        self.bars = bars or ReceiveBars()
        self._loading = asyncio.Lock()
        self._writing: set[str] = set()  # files a PutStage is writing now: one writer per file
        self.piece_timeout_s, self.max_puts, self.max_statuses = PIECE_TIMEOUT_S, MAX_PUTS, MAX_STATUSES
        self.puts = PutSlots(MAX_PUTS, self._writing)  # PutStage calls running (worker/put_slots.py)
        self._reserved: dict[str, int] = {}  # file being written -> bytes it still needed at its first piece
        self._statuses = 0  # StageStatus calls running
        self.loaded: tuple[str, int] | None = None  # (manifest sha256, stage) served

    async def _refuse(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        """End the call with ``exc``'s code and message, logged whole here; the caller's copy names no path
        of this PC (``StageCache.public``)."""
        code = getattr(grpc.StatusCode, getattr(exc, "code", "INVALID_ARGUMENT"))
        log.warning("stage store: %s", exc)
        await context.abort(code, self.cache.public(str(exc)))

    async def StageStatus(self, request: pb.StageStatusRequest, context: grpc.aio.ServicerContext) -> pb.StageStatusReply:
        """Store the manifest when sent (and new), then say how much of each of the stage's files is here. A
        manifest over ``MAX_MANIFEST_BYTES`` is refused unread; past ``max_statuses`` calls at once
        (``MAX_STATUSES``) a call is refused with RESOURCE_EXHAUSTED (memory stays bounded)."""
        if len(request.manifest) > MAX_MANIFEST_BYTES:
            await self._refuse(context, StageCacheError(f"the manifest sent has {len(request.manifest):,} bytes: at "
                                                        f"most {MAX_MANIFEST_BYTES:,} (a build's manifest is KBs)"))
        if self._statuses >= self.max_statuses:
            await self._refuse(context, StageCacheError(
                f"{self._statuses} StageStatus calls are running on this worker (at most {self.max_statuses} at once): "
                + BUSY, "RESOURCE_EXHAUSTED"))
        self._statuses += 1
        try:
            return await self._status(request, context)
        finally:
            self._statuses -= 1

    async def _status(self, request: pb.StageStatusRequest, context: grpc.aio.ServicerContext) -> pb.StageStatusReply:
        try:
            if request.manifest:
                loaded = await asyncio.to_thread(self.cache.put_manifest, request.manifest_sha256, request.manifest,
                                                 request.model_id)
            else:
                loaded = await asyncio.to_thread(self.cache.manifest, request.manifest_sha256, request.model_id)
            held = [self.cache.held(loaded, p) for p in stage_files(loaded.manifest, request.stage)]
            await asyncio.to_thread(self.cache.use, loaded, self._keep())
            free = await asyncio.to_thread(self.cache.free_bytes, self._keep() | {loaded.sha256})
            holds = await asyncio.to_thread(self.cache.holds_stages)
        except (StageCacheError, ManifestError, OSError) as exc:
            await self._refuse(context, exc)
        return pb.StageStatusReply(files=[pb.FileHeld(path=h.path, bytes=h.bytes, complete=h.complete) for h in held],
                                   free_bytes=free, holds_stages=holds)

    def _keep(self) -> frozenset[str]:
        """Builds never deleted to make room: the one served and those being written."""
        return frozenset({key.split("/", 1)[0] for key in self._writing} | ({self.loaded[0]} if self.loaded else set()))

    async def PutStage(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PutStageReply:
        """Write the pieces streamed, each at the offset the cache holds; a file is checked and put in place
        at its last piece. A cut stream leaves each file's partial file as received (resumable); one silent for
        ``piece_timeout_s`` (``PIECE_TIMEOUT_S``) is ended with DEADLINE_EXCEEDED. ``max_puts`` calls run at once
        (``MAX_PUTS``): memory stays bounded, and a stalled one is ended when another sender wants its slot or
        its file (worker/put_slots.py). A file's first piece makes room for its size under --stages-max-gb; its
        later pieces in this call must give that size."""
        put = Put(asyncio.current_task())
        written, completed, sizes = 0, [], {}
        loaded: LoadedManifest | None = None
        pending: asyncio.Future | None = None
        try:
            self.puts.max_puts = self.max_puts
            await self.puts.admit(put)
            pieces = request_iterator.__aiter__()
            while True:
                try:  # a sender gone silent (no deadline, link alive) would hold its files from every other sender
                    chunk = await asyncio.wait_for(pieces.__anext__(), self.piece_timeout_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise StageCacheError(f"no piece for {self.piece_timeout_s:g} s: PutStage ended, its files may be "
                                          "written again (resume at the bytes StageStatus gives)",
                                          "DEADLINE_EXCEEDED") from None
                if isinstance(chunk, Malformed):
                    raise StageCacheError(f"malformed piece: {chunk.error}")
                put.piece(len(chunk.data))
                if loaded is None or loaded.sha256 != chunk.manifest_sha256:
                    loaded = await asyncio.to_thread(self.cache.manifest, chunk.manifest_sha256, chunk.model_id)
                key = f"{loaded.sha256}/{chunk.path}"
                if key not in sizes:
                    await self.puts.claim(put, key, chunk.path)
                    reserved = sum(v for k, v in self._reserved.items() if k != key)
                    self._reserved[key] = await asyncio.to_thread(self.cache.make_room, loaded, chunk.path, chunk.size,
                                                                  self._keep(), reserved)
                    sizes[key] = chunk.size
                    for path in await asyncio.to_thread(self.cache.clean, frozenset(self._writing)):
                        log.info("stage cache: deleted %s (no transfer will finish it)", path)
                elif sizes[key] != chunk.size:
                    raise StageCacheError(f"{chunk.path}: piece gives the file's size as {chunk.size:,} bytes, this "
                                          f"call's earlier pieces {sizes[key]:,}")
                # shielded: a cut stream cancels this handler, not the piece being written (its file stays whole)
                pending = asyncio.ensure_future(asyncio.to_thread(self.cache.write, loaded, chunk.path, chunk.offset,
                                                                  chunk.data, chunk.size))
                if await asyncio.shield(pending):
                    completed.append(chunk.path)
                written += len(chunk.data)
                self.bars.update(key, f"{chunk.path} of manifest {loaded.sha256[:12]}", chunk.offset + len(chunk.data),
                                 chunk.size)
        except asyncio.CancelledError:
            if not put.ended:  # the call was cut: gRPC's own cancellation
                raise
            asyncio.current_task().uncancel()
            await self._refuse(context, StageCacheError(put.ended, "ABORTED"))
        except (StageCacheError, ManifestError, OSError) as exc:
            await self._refuse(context, exc)
        finally:
            mine = frozenset(put.files)
            for key in mine:
                self._reserved.pop(key, None)
            if pending is not None and not pending.done():  # cut mid-piece: the file is busy until it is written
                pending.add_done_callback(functools.partial(self._release, mine))
            else:
                self._writing -= mine
            for key in mine:
                self.bars.end(key)
            self.puts.leave(put)
            if written:
                log.info("stage store: %d bytes received, %d file(s) complete", written, len(completed))
        return pb.PutStageReply(bytes_written=written, completed=completed)

    async def ReuseStage(self, request: pb.ReuseRequest, context: grpc.aio.ServicerContext) -> pb.ReuseReply:
        """Extend a file's partial file with the segments this worker's stage cache holds (StageCache.reuse),
        as one writer of that file (ABORTED while a PutStage writes it)."""
        if len(request.segments) > MAX_SEGMENTS:
            await self._refuse(context, StageCacheError(f"{len(request.segments)} segments: at most {MAX_SEGMENTS}"))
        segments = [Segment(s.offset, s.size, s.sha256) for s in request.segments]
        job: asyncio.Future | None = None
        key = ""
        try:
            loaded = await asyncio.to_thread(self.cache.manifest, request.manifest_sha256, request.model_id)
            key = f"{loaded.sha256}/{request.path}"
            if key in self._writing:
                raise StageCacheError(f"{request.path} is being written by another call", "ABORTED")
            if not await asyncio.to_thread(self.cache.fits, loaded, request.path, request.size):
                # no build is deleted for a copy (it may copy from them): the sender sends it, PutStage makes room
                log.info("stage store: %s does not fit under --stages-max-gb beside the builds held: not copied",
                         request.path)
                return pb.ReuseReply(bytes=self.cache.held(loaded, request.path).bytes, reused_bytes=0,
                                     held=[False] * len(segments))
            self._writing.add(key)
            t0 = time.perf_counter()
            job = asyncio.ensure_future(asyncio.to_thread(self.cache.reuse, loaded, request.path, request.size,
                                                          segments))
            have, copied, held = await asyncio.shield(job)  # a cancelled call: the copy still ends whole
            if copied:
                self.bars.update(key, f"{request.path} of manifest {loaded.sha256[:12]} (copied here)", have, request.size)
                self.bars.end(key)
        except (StageCacheError, ManifestError, OSError) as exc:
            await self._refuse(context, exc)
        finally:
            if job is not None and not job.done():  # the file is busy until the copy ends
                job.add_done_callback(functools.partial(self._release, frozenset({key})))
            elif job is not None:
                self._writing.discard(key)
        if copied:
            log.info("stage store: %s: %d bytes copied from the stages held (%.2f s), %d of %d held now",
                     request.path, copied, time.perf_counter() - t0, have, request.size)
        return pb.ReuseReply(bytes=have, reused_bytes=copied, held=held)

    def _release(self, keys: frozenset[str], piece: asyncio.Future) -> None:
        """A cut PutStage's last piece is written: its files may be written again (its error was the call's)."""
        self._writing -= keys
        if not piece.cancelled():
            piece.exception()  # retrieved: asyncio would log it as never retrieved

    async def LoadStage(self, request: pb.LoadStageRequest, context: grpc.aio.ServicerContext) -> pb.LoadStageReply:
        """Hash the stage's cached files against the manifest and, only when all match, serve the stage."""
        async with self._loading:
            t0 = time.perf_counter()
            try:
                loaded = await asyncio.to_thread(self.cache.manifest, request.manifest_sha256, request.model_id)
                entry = loaded.manifest.stages[request.stage] if request.stage < loaded.manifest.num_stages else None
                if entry is None:
                    stage_files(loaded.manifest, request.stage)  # raises, naming the range
                if self.loaded == (loaded.sha256, request.stage):
                    return pb.LoadStageReply(stage=request.stage, layer_start=entry.start, layer_end=entry.end,
                                             load_source=self.slot.service.runner.load.source, already_loaded=True)
                if self.slot.service is not None and (held := len(self.slot.service.store.sessions())):
                    raise StageCacheError(f"this worker serves stage {self.loaded[1]} of manifest {self.loaded[0][:12]} "
                                          f"with {held} session(s) open: close them first", "FAILED_PRECONDITION")
                await asyncio.to_thread(self.cache.verify_stage, loaded, request.stage)
                await asyncio.to_thread(self.cache.use, loaded, self._keep())
                service = await self.load(loaded, request.stage)
            except (StageCacheError, ManifestError, ValueError, RuntimeError) as exc:
                await self._refuse(context, exc)
            old, self.slot.service = self.slot.service, service
            self.loaded = (loaded.sha256, request.stage)
            set_role(str(request.stage))  # its log lines name the stage it serves now, not "empty"
            if old is not None:
                await old.close()
            seconds = time.perf_counter() - t0
            log.info("stage store: loaded stage %d (layers [%d, %d)) of manifest %s from the cache in %.2f s",
                     request.stage, entry.start, entry.end, loaded.sha256[:12], seconds)
            return pb.LoadStageReply(stage=request.stage, layer_start=entry.start, layer_end=entry.end,
                                     load_source=service.runner.load.source, load_s=seconds)
