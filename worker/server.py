"""gRPC ``fleet.v1.Stage`` service of one worker: sessions, chunk forwarding to the next stage, results
to the coordinator's subscription, info."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import openvino as ov

from fleet_common import PROTOCOL_VERSION
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.channels import ChannelCache
from fleet_common.security import Security, open_server
from fleet_common.runtime import ChunkError, KVSession, top_candidates, unpack_token_mask
from fleet_common.wire import Malformed, WireError, add_servicer, address_problem, from_tensor, to_tensor

from .links import Downlink, LinkBroken, Upstream
from .metrics import WorkerMetrics
from .runner import ChunkResult, ShardRunner
from .sessions import SessionError, SessionStore

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 1024
DOWNSTREAM_TIMEOUT_S = 120.0  # cap on a forwarded step's deadline, so nothing waits forever
MAX_NEXT_STAGE_CHANNELS = 16  # a stage forwards to the replicas of the next stage: a handful of addresses
# A step of at most INLINE_MAX_TOKENS (rows x tokens: a decode step) runs on the event loop's thread when
# the inference thread is idle and such steps take under INLINE_MAX_MS: the hand-off to the inference
# thread and back costs ~0.3 ms of CPU per step (two thread wake-ups; bench/pipeline/hop_overhead.py), while
# a blocked loop delays this worker's other RPCs by at most one such step.
INLINE_MAX_TOKENS = 32
INLINE_MAX_MS = 20.0


def _small(x: np.ndarray) -> bool:
    """Whether a step's input (ids [B, S] or hidden [B, S, H]; any shape before it is checked) has at
    most INLINE_MAX_TOKENS rows x tokens."""
    return x.ndim >= 2 and x.shape[0] * x.shape[1] <= INLINE_MAX_TOKENS


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name)


class StepError(Exception):
    """A step that failed here or below: its gRPC status ``code`` and ``details`` (which name the stage)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class StageService(pb_grpc.StageServicer):
    """Serves one shard. Steps run on one inference thread, in the order they arrive, so chunks of
    different sessions queue at this stage while the event loop keeps answering RPCs; a small step (at
    most ``INLINE_MAX_TOKENS`` rows x tokens, e.g. a decode step) runs inline on the event loop's thread
    instead when the inference thread is idle and such steps take under ``INLINE_MAX_MS`` (``_run_chunk``).
    Compactions, copies and merges always go to the inference thread. ``security`` secures the calls to
    the next stage."""

    def __init__(self, runner: ShardRunner, store: SessionStore, manifest_sha256: str, max_context: int,
                 security: Security | None = None) -> None:
        self.runner = runner
        self.security = security if security is not None else Security()
        self.store = store
        self.manifest_sha256 = manifest_sha256
        self.max_context = max_context
        self.worker_id = uuid.uuid4().hex[:12]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{runner.stage}-infer")
        # channels to the next stage, bounded: the route comes from the caller, and one channel per address ever
        # named would grow without bound; the least recently used one is closed (its link first), once its calls end
        self.channels = ChannelCache(self.security, MAX_NEXT_STAGE_CHANNELS, DOWNSTREAM_TIMEOUT_S, self._evicted)
        self._closing: set[asyncio.Task] = set()  # links to evicted channels, closing
        self._downlinks: dict[str, Downlink] = {}  # streams to the next stage, by address (one per channel)
        self._upstream: dict[str, Upstream] = {}  # session id -> the Link that sent its last step
        self._subscribers: dict[str, asyncio.Queue] = {}
        self._busy = 0  # steps in flight here
        self._submitted = self._finished = 0  # calls queued on the inference thread, and calls it ended
        self._small_step_ms = 0.0  # compute time of the last step of at most INLINE_MAX_TOKENS
        self.compactions = 0
        self.metrics = WorkerMetrics(runner.stage)
        self._infer_cpu = {t: self.metrics.infer_cpu.labels(t) for t in ("inference", "event_loop")}  # labels() once
        self.metrics.watch(self._load)

    # -- helpers -------------------------------------------------------------------------------
    def _load(self) -> dict[str, int]:
        """What this worker holds now (reported by Info and the metrics gauges): KV states, the
        sequences in them, KV bytes held/reserved/budgeted, chunks in flight, compactions."""
        sessions = self.store.sessions()
        return {"sessions": len(sessions), "sequences": sum(s.rows for s in sessions),
                "kv_bytes": sum(self.runner.kv_bytes(s) for s in sessions),
                "kv_reserved_bytes": self.store.kv_reserved_bytes, "kv_budget_bytes": self.store.kv_budget_bytes,
                "busy": self._busy, "compactions": self.compactions}

    def _check_manifest(self, sha: str) -> str | None:
        if sha and sha != self.manifest_sha256:
            return (f"model build mismatch: this worker serves manifest {self.manifest_sha256[:12]}, "
                    f"the caller has {sha[:12]}")
        return None

    def _evicted(self, address: str) -> None:
        """The channel to ``address`` is being closed (``channels`` holds too many): close its link too."""
        if (downlink := self._downlinks.pop(address, None)) is not None:
            closing = asyncio.ensure_future(downlink.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the links and channels to the next stage and stop the inference thread."""
        for task in list(self._closing):
            task.cancel()
        for downlink in list(self._downlinks.values()):
            await downlink.close()
        await self.channels.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _on_inference_thread(self, fn, *args) -> asyncio.Future:  # noqa: ANN001
        """``fn(*args)`` queued on the one inference thread now (calls run in submission order); its future."""
        self._submitted += 1
        return asyncio.get_running_loop().run_in_executor(self._executor, self._counted, fn, args)

    def _counted(self, fn, args: tuple):  # noqa: ANN001, ANN202 - on the inference thread
        try:
            return fn(*args)
        finally:
            self._finished += 1  # written by this thread only, as _submitted by the loop's

    def _run_chunk(self, small: bool, *args) -> ChunkResult | asyncio.Future:  # noqa: ANN002
        """``runner.run(*args)``, run here and now for a ``small`` step (``_small``) while the inference
        thread is idle, else queued on the inference thread: the result or its future."""
        if small and self._submitted == self._finished and self._small_step_ms < INLINE_MAX_MS:
            return self.runner.run(*args, thread="event_loop")
        return self._on_inference_thread(self.runner.run, *args)

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.errors.labels(code.name).inc()
        await context.abort(code, message)

    # -- RPCs: sessions ------------------------------------------------------------------------
    async def _new_session_context(self, request, context: grpc.aio.ServicerContext) -> int:  # noqa: ANN001
        """The checks of an RPC that makes a session (OpenSession, Copy, Merge): the caller's build, a
        session id; returns its max context (the request's, capped by this worker's; 0 = the worker's)."""
        if msg := self._check_manifest(request.manifest_sha256):
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, msg)
        if not request.session_id:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        return min(request.max_context or self.max_context, self.max_context)

    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionReply:
        """Open a session (or ``resume`` one: keep its KV, change its reservation) of ``max_context`` slots."""
        max_context = await self._new_session_context(request, context)
        try:
            if request.resume:
                self.store.resume(request.session_id, max_context)
                self.store.renew(request.owner)
            else:
                self.store.open(request.session_id, max_context, request.owner)
        except (ChunkError, SessionError) as exc:
            await self._abort(context, _code(exc.code), str(exc))
        log.debug("session %s %s (max_context %d)", request.session_id, "resumed" if request.resume else "opened",
                  max_context)
        return pb.OpenSessionReply(stage=self.runner.stage)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionReply:
        """Free a session's KV; says whether it existed and how many bytes were freed."""
        session = self.store.close(request.session_id)
        self._upstream.pop(request.session_id, None)
        if session is None:
            return pb.CloseSessionReply(existed=False)
        log.debug("session %s closed", request.session_id)
        return pb.CloseSessionReply(existed=True, freed_kv_bytes=self.runner.kv_bytes(session))

    def _check_step(self, request: pb.ForwardRequest) -> tuple[np.ndarray, KVSession]:
        """A step's input and session, after every check that needs no inference. Raises ``StepError``."""
        runner = self.runner
        if msg := self._check_manifest(request.manifest_sha256):
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION, msg)
        if request.stage != runner.stage:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request for stage {request.stage} reached stage {runner.stage}")
        if request.top_k > runner.vocab_size:  # up to the whole vocabulary (a naive stack's full logits)
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT, f"top_k {request.top_k} > the vocabulary ({runner.vocab_size})")
        if runner.last and request.logits_count and request.reply_to not in self._subscribers:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"no subscriber {request.reply_to!r} at the last stage to receive results")
        if not runner.last and not request.route:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT, "no route to the next stage")
        for address in request.route:
            if address not in self._downlinks and (problem := address_problem(address)):
                raise StepError(grpc.StatusCode.INVALID_ARGUMENT, problem)  # an open link's address was checked
        try:
            x = from_tensor(request.input, dtype="int64" if runner.first else "float32")
            return x, self.store.get(request.session_id)
        except WireError as exc:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT, f"bad input tensor: {exc}") from None
        except SessionError as exc:
            raise StepError(_code(exc.code), str(exc)) from None

    def _token_mask(self, request: pb.ForwardRequest, rows: int) -> np.ndarray | None:
        """The step's allowed tokens [rows * logits_count, V] bool at the last stage (None elsewhere, or
        without a mask), after checking at every stage its shape and that each position allows some token:
        a bad mask is refused before any stage runs the chunk. Raises ``StepError``."""
        if not request.HasField("token_mask"):
            return None
        runner = self.runner
        want = [rows * request.logits_count, (runner.vocab_size + 31) // 32]
        try:
            mask = from_tensor(request.token_mask, dtype="int32", ndim=2)
        except WireError as exc:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT, f"bad token_mask: {exc}") from None
        if list(mask.shape) != want or not request.logits_count:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"token_mask has shape {list(mask.shape)}; this step needs {want} (rows x logits_count "
                            f"positions, ceil(vocabulary {runner.vocab_size} / 32) int32 words)")
        tail = runner.vocab_size % 32  # the last word's bits past the vocabulary do not count
        words = mask if not tail else np.concatenate([mask[:, :-1], mask[:, -1:] & np.int32((1 << tail) - 1)], axis=1)
        if (empty := ~words.any(axis=1)).any():
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"token_mask allows no token at position {int(np.flatnonzero(empty)[0])}")
        return unpack_token_mask(mask, runner.vocab_size) if runner.last else None

    async def _step(self, request: pb.ForwardRequest, arrived: float, timeout_s: float,
                    upstream: Upstream | None = None) -> ChunkResult:
        """Run one step here and pass it on: to the next stage's link, or (last stage) the result to
        its subscriber. ``timeout_s``: what is left of the step's deadline at ``arrived``; ``upstream``:
        the Link that sent it (told of failures below). Raises ``StepError``.

        Nothing is awaited before the chunk runs or is queued on the inference thread (a small one
        runs here only when that thread is idle), so steps of one link run in the order they arrived."""
        runner = self.runner
        x, session = self._check_step(request)
        allowed = self._token_mask(request, x.shape[0])
        if upstream is not None:
            self._upstream[request.session_id] = upstream
        self._busy += 1
        small = _small(x)
        try:
            result = self._run_chunk(
                small, session, x, request.past_length, list(request.row_start_positions) or request.start_position,
                list(request.hide_slots), request.logits_count, list(request.hide_rows), list(request.row_pads),
                list(request.keep_rows))
            if not isinstance(result, ChunkResult):
                result = await result
            if small:
                self._small_step_ms = result.compute_ms
        except (ChunkError, SessionError) as exc:
            raise StepError(_code(exc.code), f"stage {runner.stage}: {exc}") from None
        except RuntimeError as exc:  # OpenVINO raises RuntimeError for infer failures
            log.exception("session %s: inference failed at stage %d", request.session_id, runner.stage)
            raise StepError(grpc.StatusCode.INTERNAL, f"stage {runner.stage}: inference failed: {exc}") from None
        finally:
            self._busy -= 1
        self.metrics.infer.observe(result.compute_ms / 1000)
        self._infer_cpu[result.thread].inc(result.cpu_ms / 1000)
        self.metrics.chunks.inc()
        self.metrics.tokens.inc(x.shape[0] * x.shape[1])
        elapsed = time.perf_counter() - arrived
        if not runner.last:
            nxt = pb.ForwardRequest()
            nxt.CopyFrom(request)
            nxt.stage = runner.stage + 1
            nxt.input.CopyFrom(to_tensor(result.output))
            del nxt.route[:]
            nxt.route.extend(request.route[1:])
            nxt.handle_ms.append(elapsed * 1000)
            nxt.timeout_ms = max(0.0, timeout_s - elapsed) * 1000
            address = request.route[0]
            if nxt.timeout_ms <= 0:
                raise StepError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"stage {runner.stage}: the step's deadline passed before it could be passed on")
            downlink = self._downlink(address)
            if upstream is not None:
                downlink.upstreams.add(upstream)
            try:
                await downlink.send(nxt, nxt.timeout_ms / 1000)
            except LinkBroken as exc:
                raise StepError(grpc.StatusCode.UNAVAILABLE, f"stage {runner.stage + 1} at {address}: {exc}") from None
        elif request.reply_to:
            queue = self._subscribers.get(request.reply_to)
            if queue is None:
                raise StepError(grpc.StatusCode.FAILED_PRECONDITION, f"subscriber {request.reply_to!r} left")
            step = pb.StepResult(session_id=request.session_id, step_id=request.step_id,
                                 handle_ms=[*request.handle_ms, elapsed * 1000])
            if request.logits_count:
                logits = result.output[:, -request.logits_count:]  # [B, N, V]
                ids, logprobs = top_candidates(logits.reshape(-1, logits.shape[-1]), request.top_k or 1, allowed)
                step.top_ids.CopyFrom(to_tensor(ids))
                step.top_logprobs.CopyFrom(to_tensor(logprobs))
            queue.put_nowait(step)
        return result

    # -- RPCs ----------------------------------------------------------------------------------
    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardReply:
        """Run one step here and pass it on, as a unary call (``Link`` is the per-token path)."""
        arrived = time.perf_counter()
        remaining = context.time_remaining()  # None when the caller set no deadline
        timeout_s = DOWNSTREAM_TIMEOUT_S if remaining is None else min(remaining, DOWNSTREAM_TIMEOUT_S)
        try:
            result = await self._step(request, arrived, timeout_s)
        except StepError as exc:
            await self._abort(context, exc.code, exc.details)
        return pb.ForwardReply(compute_ms=result.compute_ms, handle_ms=(time.perf_counter() - arrived) * 1000)

    async def Link(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: ANN001, ANN201
        """One upstream's stream of steps: each runs as ``Forward`` would (in arrival order); failures,
        here or relayed from below, are sent back as ``LinkAck``s."""
        upstream: Upstream = asyncio.Queue()
        steps: set[asyncio.Task] = set()

        async def step(request: pb.ForwardRequest, arrived: float) -> None:
            timeout_s = min(request.timeout_ms / 1000 or DOWNSTREAM_TIMEOUT_S, DOWNSTREAM_TIMEOUT_S)
            try:
                await self._step(request, arrived, timeout_s, upstream)
            except StepError as exc:
                self.metrics.errors.labels(exc.code.name).inc()
                upstream.put_nowait(pb.LinkAck(session_id=request.session_id, step_id=request.step_id,
                                               code=exc.code.value[0], details=exc.details))

        async def pump() -> None:
            try:
                async for request in request_iterator:
                    if isinstance(request, Malformed):
                        self.metrics.errors.labels("INVALID_ARGUMENT").inc()
                        upstream.put_nowait(pb.LinkAck(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                       details=f"stage {self.runner.stage}: malformed step: "
                                                       f"{request.error}"))
                        break
                    task = asyncio.ensure_future(step(request, time.perf_counter()))
                    steps.add(task)
                    task.add_done_callback(steps.discard)
            finally:
                upstream.put_nowait(None)

        reader = asyncio.ensure_future(pump())
        try:
            while (ack := await upstream.get()) is not None:
                yield ack
        finally:
            reader.cancel()
            for downlink in self._downlinks.values():
                downlink.upstreams.discard(upstream)
            for session_id in [s for s, q in self._upstream.items() if q is upstream]:
                del self._upstream[session_id]

    def _downlink(self, address: str) -> Downlink:
        """The link to the next stage at ``address``, opened (again) when there is none or it broke."""
        downlink = self._downlinks.get(address)
        if downlink is None or downlink.broken:
            downlink = self._downlinks[address] = Downlink(address, self.channels.stub(address), self._relay,
                                                           self._broken)
        return downlink

    def _relay(self, downlink: Downlink, ack: pb.LinkAck) -> None:
        """A failure the next stage reported for a step: to the upstream that sent its session's last step."""
        upstream = self._upstream.get(ack.session_id)
        if upstream is not None:
            upstream.put_nowait(pb.LinkAck(session_id=ack.session_id, step_id=ack.step_id, code=ack.code,
                                           details=f"stage {self.runner.stage + 1} at {downlink.address}: {ack.details}"))

    def _broken(self, downlink: Downlink, reason: str) -> None:
        """The link at ``downlink.address`` broke: every upstream that forwarded through it is told."""
        if self._downlinks.get(downlink.address) is downlink:
            del self._downlinks[downlink.address]
        for upstream in downlink.upstreams:
            upstream.put_nowait(pb.LinkAck(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                           details=f"stage {self.runner.stage + 1} at {downlink.address}: {reason}"))

    async def Compact(self, request: pb.CompactRequest, context: grpc.aio.ServicerContext) -> pb.CompactReply:
        """Drop a session's invisible KV slots (on the inference thread); returns its new length."""
        if msg := self._check_manifest(request.manifest_sha256):
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, msg)
        try:
            session = self.store.get(request.session_id)
            length, ms = await self._on_inference_thread(
                self.runner.compact, session, request.past_length, list(request.hide_slots),
                list(request.hide_rows))
        except (ChunkError, SessionError) as exc:
            await self._abort(context, _code(exc.code), f"stage {self.runner.stage}: {exc}")
        self.compactions += 1
        log.debug("session %s compacted to %d slots in %.1f ms", request.session_id, length, ms)
        return pb.CompactReply(length=length, compute_ms=ms)

    async def Copy(self, request: pb.CopyRequest, context: grpc.aio.ServicerContext) -> pb.CopyReply:
        """A new session from the first visible slots of a row of another (on the inference thread)."""
        max_context = await self._new_session_context(request, context)
        t0 = time.perf_counter()
        try:  # on the inference thread: the source's state must not change while it is copied
            session = await self._on_inference_thread(
                self.store.copy, request.session_id, request.source, request.row, request.tokens,
                max_context, request.detach, request.owner)
        except (ChunkError, SessionError) as exc:
            await self._abort(context, _code(exc.code), f"stage {self.runner.stage}: {exc}")
        ms = (time.perf_counter() - t0) * 1000
        log.debug("session %s: %d tokens of row %d of %s copied in %.1f ms", request.session_id, request.tokens,
                  request.row, request.source, ms)
        return pb.CopyReply(length=session.length, compute_ms=ms)

    async def Merge(self, request: pb.MergeRequest, context: grpc.aio.ServicerContext) -> pb.MergeReply:
        """One batch-group session of the given sessions' rows (on the inference thread)."""
        max_context = await self._new_session_context(request, context)
        try:  # on the inference thread: the sources' states must not change while they are copied
            group = await self._on_inference_thread(
                self.store.merge, request.session_id, list(request.sources), max_context,
                request.owner)
        except (ChunkError, SessionError) as exc:
            await self._abort(context, _code(exc.code), f"stage {self.runner.stage}: {exc}")
        log.debug("sessions %s merged into %s (%d rows, %d slots)", list(request.sources), request.session_id,
                  group.rows, group.length)
        return pb.MergeReply(length=group.length, rows=group.rows)

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext):
        """The last stage's results for ``subscriber_id``: a handshake, then each step's result."""
        if not request.subscriber_id:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id is required")
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self._subscribers[request.subscriber_id] = queue
        log.info("subscriber %s attached", request.subscriber_id)
        try:
            yield pb.StepResult()  # handshake: the subscription is registered
            while True:
                yield await queue.get()
        finally:
            if self._subscribers.get(request.subscriber_id) is queue:
                del self._subscribers[request.subscriber_id]
            log.info("subscriber %s left", request.subscriber_id)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        """What this worker serves and holds (renews the caller's owner lease)."""
        self.store.renew(request.owner)
        manifest = self.runner.loaded.manifest
        entry = self.runner.entry
        return pb.InfoReply(
            worker_id=self.worker_id,
            stage=self.runner.stage,
            num_stages=manifest.num_stages,
            layer_start=entry.start,
            layer_end=entry.end,
            manifest_sha256=self.manifest_sha256,
            protocol_version=PROTOCOL_VERSION,
            model_id=manifest.model_id,
            device=self.runner.device,
            max_sessions=self.store.max_sessions,
            openvino_version=ov.get_version(),
            load_source=self.runner.load.source,
            load_s=self.runner.load.seconds,
            load_detail=self.runner.load.detail,
            proof=self.security.prove(request.challenge, self.worker_id),
            **self._load(),
        )


def create_server(service: StageService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with ``service`` bound at host:port, secured as ``service.security`` says
    (calls without a valid token are refused before any handler runs); returns (server, bound port).

    Raises ``RuntimeError`` when the port cannot be bound."""
    server, bound = open_server(f"{host}:{port}", service.security,
                                on_reject=service.metrics.errors.labels("UNAUTHENTICATED").inc)
    add_servicer(pb_grpc.add_StageServicer_to_server, service, server,
                 on_malformed=service.metrics.errors.labels("INVALID_ARGUMENT").inc)
    return server, bound
