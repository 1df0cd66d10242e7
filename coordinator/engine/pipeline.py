"""Client side of the stage pipeline: sessions across all stages and one step through them.

A step goes coordinator -> stage 0 -> stage 1 -> ... -> last stage, each stage forwarding its hidden
states straight to the next (``route``) on a long-lived ``Link`` stream; the last stage pushes the
result into this coordinator's ``Subscribe`` stream. So a step over N stages costs N+1 network hops
and no call set-up; only failures travel back up the links (``LinkAck``), off the critical path.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from dataclasses import dataclass

import grpc
import numpy as np

from fleet_common import fleet_pb2 as pb
from fleet_common.channels import ChannelCache, StreamClosed, StreamWriter, describe
from fleet_common.security import Security
from fleet_common.wire import WireError, from_tensor, to_tensor

from ..errors import CopyRefused, InvalidRequest, Overloaded, StageFailure, stage_failed, stage_lost

log = logging.getLogger(__name__)

STEP_DEADLINE_FACTOR = 4.0  # a step's deadline is at least this many times the slowest step of its size seen lately
SUSPECT_POLL_S = 0.25  # a step past its deadline while a worker is suspect asks again this often for the verdict
VERDICT_WAIT_S = 30.0  # ... for this long at most (the registry's verdict comes within its missed health checks)
STEP_TIME_DECAY = 0.98  # ... whose record fades by this factor each step (a stall long past counts less and less)


@dataclass(frozen=True)
class StepOutput:
    """What a step returns: candidates for the last ``N`` positions of the chunk."""

    top_ids: np.ndarray  # [N, k] int32, best first
    top_logprobs: np.ndarray  # [N, k] float32, log-softmax over the full vocabulary


class Channels(ChannelCache):
    """One gRPC channel per worker address (``fleet_common.channels.ChannelCache``), shared by every pipeline
    of this coordinator, secured as ``security`` says (the coordinator passes its settings'; default
    ``Security()``: plaintext, no tokens); ``owner`` names this coordinator process to the workers."""

    def __init__(self, security: Security | None = None) -> None:
        super().__init__(security)
        # this coordinator process, named in the sessions it makes and in its health checks: a worker
        # frees the sessions of an owner it has not heard from (the coordinator died)
        self.owner = f"coordinator-{uuid.uuid4().hex[:12]}"
        log.info("links to workers: %s", self.security.describe())


def queued_deadline_s(timeout_s: float, slowest_s: float, in_flight: int, link_rtt_s: float) -> float:
    """The deadline (seconds) of a step or KV operation sent through a pipeline with ``in_flight`` steps already
    in flight: ``timeout_s`` (the configured one) or ``STEP_DEADLINE_FACTOR`` x ``slowest_s`` (the slowest recent
    step it is measured against) where longer (a slow PC, a CPU quota: its steps are not taken for lost), once for
    each step ahead and once for itself (at each stage it waits behind the steps queued there: a busy stage is not
    a lost one), plus ``link_rtt_s``, the links' round trips summed (a step crosses every link once). (A rehearsal
    on 2 loaded cores: one of 20 concurrent schema streams missed a 5.1 s step deadline behind the batch groups'
    steps.)"""
    return max(timeout_s, STEP_DEADLINE_FACTOR * slowest_s) * (1 + in_flight) + 2 * link_rtt_s


class Pipeline:
    """An assembled pipeline: one worker address per stage, and the result stream from the last one.

    ``addresses[i]`` serves stage i. Create with ``await Pipeline.connect(...)``; ``close()`` it when
    membership changes.
    """

    def __init__(self, addresses: list[str], channels: Channels, manifest_sha256: str) -> None:
        self.addresses = list(addresses)
        self.channels = channels
        self.manifest_sha256 = manifest_sha256
        self.subscriber_id = f"coord-{uuid.uuid4().hex[:12]}"
        self._waiters: dict[tuple[str, int], asyncio.Future] = {}
        self._steps = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._link: StreamWriter | None = None  # the steps' stream to stage 0
        self._link_reader: asyncio.Task | None = None
        self._broken: StageFailure | None = None  # why it no longer runs steps
        self._close_reason: StageFailure | str = "pipeline closed"
        self.observe_link = None  # (seconds) -> None: a step's time on the links (``path``), for metrics
        self.path = "->".join(["coordinator", *(f"stage{i}" for i in range(len(addresses))), "coordinator"])
        self.sessions: set[str] = set()  # requests running on this pipeline (sessions opened, not closed or forgotten)
        self.link_rtt_s = lambda: 0.0  # measured round trips to its workers, summed (seconds): deadline slack
        self.vocab_size = 0  # the model's logits width: candidates past it are the last stage's fault (0: unchecked)
        self._closing: set[asyncio.Task] = set()  # closes of sessions whose opener left mid-open
        self.suspect = lambda: False  # whether a worker of it is late for a health check (or just found gone)
        self._slowest: dict[int, float] = {}  # chunk size class (bit length of its tokens) -> slowest step (seconds)

    @classmethod
    async def connect(cls, addresses: list[str], channels: Channels, manifest_sha256: str,
                      timeout_s: float = 5.0) -> Pipeline:
        """Subscribe to the last stage's results; raises ``StageFailure`` if it does not answer in time."""
        pipeline = cls(addresses, channels, manifest_sha256)
        ready = asyncio.get_running_loop().create_future()
        pipeline._reader = asyncio.create_task(pipeline._read_results(ready), name=f"results-{addresses[-1]}")
        try:
            await asyncio.wait_for(ready, timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await pipeline.close()
            raise stage_lost(len(addresses) - 1, addresses[-1],
                             f"the result stream was not accepted: {describe(exc)}") from exc
        pipeline._link = StreamWriter(channels.stub(addresses[0]).Link())
        pipeline._link_reader = asyncio.create_task(pipeline._read_acks(), name=f"link-{addresses[0]}")
        return pipeline

    @property
    def healthy(self) -> bool:
        """Whether the pipeline still runs steps (no stream or link of it has failed)."""
        return self._broken is None

    async def _read_results(self, ready: asyncio.Future) -> None:
        call = self.channels.stub(self.addresses[-1]).Subscribe(pb.SubscribeRequest(subscriber_id=self.subscriber_id))
        try:
            async for result in call:
                if not result.session_id:  # the stage's "subscribed" handshake
                    if not ready.done():
                        ready.set_result(None)
                    continue
                waiter = self._waiters.pop((result.session_id, result.step_id), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(result)
            reason = "its result stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = f"its result stream failed: {describe(exc)}"
            if not ready.done():
                ready.set_exception(exc)
        except asyncio.CancelledError:
            call.cancel()
            reason = None
        if reason is not None:
            self._fail(stage_lost(len(self.addresses) - 1, self.addresses[-1], reason))
        elif isinstance(self._close_reason, StageFailure):
            self._fail(self._close_reason)
        else:
            self._fail(StageFailure(self._close_reason))

    async def _read_acks(self) -> None:
        """The failures stage 0 sends back up the link: one step's (its waiter fails), or the link below
        a stage broke (the pipeline is broken); the link itself failing breaks it too."""
        try:
            async for ack in self._link.call:
                if not ack.session_id:
                    self._fail(self.ack_failure(ack))
                elif (waiter := self._waiters.get((ack.session_id, ack.step_id))) is not None and not waiter.done():
                    waiter.set_exception(self.ack_failure(ack))
            reason = "its link stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = f"its link failed: {describe(exc)}"
        except asyncio.CancelledError:
            return
        self._fail(stage_lost(0, self.addresses[0], reason))

    def _fail(self, failure: StageFailure) -> None:
        """The pipeline no longer runs steps (the first failure says why); waiting steps fail with it."""
        if self._broken is None:
            self._broken = failure
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(self._broken.again())
        self._waiters.clear()

    async def close(self, reason: StageFailure | str = "pipeline closed") -> None:
        """Stop the result stream and the link; steps still waiting fail with ``reason`` (a
        ``StageFailure``, or its message)."""
        self._close_reason = reason
        if self._link is not None:
            self._link.call.cancel()
        for task in (self._link_reader, self._reader):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # -- sessions ------------------------------------------------------------------------------
    async def open_session(self, session_id: str, max_context: int, timeout_s: float, resume: bool = False) -> None:
        """Open ``session_id`` on every stage at once (``resume``: keep the KV it holds there, only its
        reservation becomes ``max_context`` slots). Raises ``Overloaded`` when a stage is full (a resumed
        session is kept then), ``InvalidRequest`` when the session could never fit a stage's KV budget,
        ``StageFailure`` otherwise (the session is closed again on every stage)."""
        self.sessions.add(session_id)  # before any await: the next placement already counts it
        request = pb.OpenSessionRequest(session_id=session_id, max_context=max_context,
                                        manifest_sha256=self.manifest_sha256, resume=resume,
                                        owner=self.channels.owner)
        deadline_s = self._kv_deadline_s(timeout_s)
        calls = [self.channels.stub(a).OpenSession(request, timeout=deadline_s) for a in self.addresses]
        results = await self._unless_left(calls, None if resume else session_id, timeout_s)
        errors = [(a, r) for a, r in zip(self.addresses, results) if isinstance(r, BaseException)]
        if errors:
            address, exc = errors[0]
            full = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not (resume and full):
                await self.close_session(session_id, timeout_s)
            if full:
                raise Overloaded(f"worker {address} is full: {exc.details()}")
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                raise InvalidRequest(f"this request can never be served by worker {address}: {exc.details()}; "
                                     "lower max_tokens or shorten the prompt", param="max_tokens")
            raise _failure(self.addresses.index(address), address, "to open this request's session", exc)

    async def _unless_left(self, calls: list, session_id: str | None, timeout_s: float) -> list:
        """The results of ``calls`` (one RPC per stage making ``session_id``), exceptions included. When the caller
        is cancelled meanwhile (its client left while a slow stage still answered), ``session_id`` (None: keep
        it, a resumed session) is closed on every stage in the background, since the stages that answered
        already hold it; then the cancellation goes on."""
        try:
            return await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:
            if session_id is not None:
                task = asyncio.ensure_future(self.close_session(session_id, timeout_s))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            raise

    def forget(self, session_id: str) -> None:
        """Stop counting ``session_id`` as open through this pipeline (placement's load) without closing
        it: for a session that ended inside a batch group, which frees its KV row itself."""
        self.sessions.discard(session_id)

    async def close_session(self, session_id: str, timeout_s: float) -> None:
        """Free ``session_id``'s KV on every stage at once; failures are logged, never raised."""
        self.sessions.discard(session_id)
        request, deadline_s = pb.CloseSessionRequest(session_id=session_id), self._kv_deadline_s(timeout_s)
        results = await asyncio.gather(
            *(self.channels.stub(a).CloseSession(request, timeout=deadline_s) for a in self.addresses),
            return_exceptions=True,
        )
        for address, r in zip(self.addresses, results):
            if isinstance(r, BaseException):
                log.warning("session %s: close on %s failed: %s", session_id, address, describe(r))

    async def _on_every_stage(self, rpc: str, request, timeout_s: float, what: str) -> list:  # noqa: ANN001
        """Call ``rpc`` with ``request`` on every stage at once; the replies in stage order. Raises
        ``StageFailure`` naming the first stage that failed (``what`` says what failed)."""
        deadline_s = self._kv_deadline_s(timeout_s)
        results = await asyncio.gather(
            *(getattr(self.channels.stub(a), rpc)(request, timeout=deadline_s) for a in self.addresses),
            return_exceptions=True,
        )
        for index, (address, r) in enumerate(zip(self.addresses, results)):
            if isinstance(r, BaseException):
                raise _failure(index, address, what, r)
        return results

    async def copy(self, session_id: str, source: str, row: int, tokens: int, max_context: int,
                   timeout_s: float, detach: bool = False) -> None:
        """Make ``session_id`` on every stage from the first ``tokens`` visible slots of ``row`` of
        ``source`` (the ``Copy`` RPC; ``source`` is untouched; ``detach``: the row is leaving it and its
        reservation moves to the copy). Raises ``Overloaded`` when a stage has no room, ``CopyRefused`` when a
        stage no longer holds that prefix, ``StageFailure`` otherwise; the copy is closed again on every stage on
        failure."""
        self.sessions.add(session_id)
        request = pb.CopyRequest(session_id=session_id, source=source, row=row, tokens=tokens,
                                 max_context=max_context, manifest_sha256=self.manifest_sha256, detach=detach,
                                 owner=self.channels.owner)
        deadline_s = self._kv_deadline_s(timeout_s)
        results = await self._unless_left([self.channels.stub(a).Copy(request, timeout=deadline_s)
                                           for a in self.addresses], session_id, timeout_s)
        errors = [(a, r) for a, r in zip(self.addresses, results) if isinstance(r, BaseException)]
        if errors:
            await self.close_session(session_id, timeout_s)
            address, exc = errors[0]
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(f"worker {address} has no room for the copy: {exc.details()}")
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                raise CopyRefused(f"worker {address}: {exc.details()}")
            raise _failure(self.addresses.index(address), address, "to copy a retained session's KV", exc)

    async def compact(self, session_id: str, past_length: int, hide_slots: list[int], timeout_s: float,
                      hide_rows: list[int] = ()) -> int:
        """Drop the session's invisible KV slots (after hiding ``hide_slots`` of ``hide_rows``) on every
        stage at once; returns the new physical length. Raises ``StageFailure`` when a stage fails or
        the stages disagree on the result."""
        request = pb.CompactRequest(session_id=session_id, past_length=past_length, hide_slots=list(hide_slots),
                                    hide_rows=list(hide_rows), manifest_sha256=self.manifest_sha256)
        results = await self._on_every_stage("Compact", request, timeout_s, "a KV compaction")
        lengths = {r.length for r in results}
        if len(lengths) != 1:
            raise StageFailure(f"session {session_id}: stages disagree after compaction: {sorted(lengths)}")
        return lengths.pop()

    async def merge(self, session_id: str, sources: list[str], max_context: int, timeout_s: float) -> int:
        """Make batch group ``session_id`` of the ``sources`` sessions on every stage at once (see the
        ``Merge`` RPC); returns its physical length. Raises ``StageFailure`` when a stage fails or the
        stages disagree."""
        request = pb.MergeRequest(session_id=session_id, sources=list(sources), max_context=max_context,
                                  manifest_sha256=self.manifest_sha256, owner=self.channels.owner)
        results = await self._on_every_stage("Merge", request, timeout_s, "to add this request to a decode batch")
        shapes = {(r.length, r.rows) for r in results}
        if len(shapes) != 1:
            raise StageFailure(f"batch group {session_id}: stages disagree after merge: {sorted(shapes)}")
        return shapes.pop()[0]

    # -- steps ---------------------------------------------------------------------------------
    async def step(self, session_id: str, tokens: list[int] | np.ndarray, past_length: int,
                   start_position: int | list[int], logits_count: int, top_k: int, timeout_s: float,
                   hide_slots: list[int] = (), hide_rows: list[int] = (), pads: list[int] = (),
                   keep_rows: list[int] = (), token_mask: np.ndarray | None = None) -> StepOutput | None:
        """Run ``tokens`` (one chunk: [S] for a session, [B, S] int64 for a batch group) through every stage.

        A group gives per-row ``start_position`` and ``pads`` and may drop rows (``keep_rows``); see
        the ``ForwardRequest`` fields; ``token_mask`` [B * logits_count, ceil(V / 32)] int32, the allowed tokens
        of each returned position (grammar-constrained decoding). Returns candidates for the chunk's last ``logits_count``
        positions ([B * N, k], row-major), or None when ``logits_count`` is 0. Raises ``StageFailure``
        naming the stage when any stage fails or the step misses its deadline (``timeout_s``).
        """
        if self._broken:
            raise self._broken.again()
        ids = np.atleast_2d(np.asarray(tokens, dtype=np.int64))
        size = ids.size.bit_length()
        timeout_s = self._deadline_s(size, timeout_s)
        step_id = next(self._steps)
        request = pb.ForwardRequest(
            session_id=session_id, step_id=step_id, stage=0,
            input=to_tensor(ids),
            past_length=past_length, hide_slots=list(hide_slots), hide_rows=list(hide_rows), row_pads=list(pads),
            keep_rows=list(keep_rows),
            route=self.addresses[1:], logits_count=logits_count, top_k=top_k,
            reply_to=self.subscriber_id, manifest_sha256=self.manifest_sha256, timeout_ms=timeout_s * 1000,
        )
        if token_mask is not None:
            request.token_mask.CopyFrom(to_tensor(token_mask))
        if isinstance(start_position, int):
            request.start_position = start_position
        else:
            request.row_start_positions.extend(start_position)
        key = (session_id, step_id)
        waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
        sent, deadline = time.perf_counter(), asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):  # the write and the result together
                await self._link.write(request)
            result = await self._result(waiter, deadline)
        except TimeoutError:
            raise StageFailure(f"a pipeline step missed its {timeout_s:.1f} s deadline (a stage is overloaded "
                               "or stuck); send the request again", detail=f"session {session_id}") from None
        except StreamClosed as exc:
            self._fail(stage_lost(0, self.addresses[0], f"the link to stage 0 failed: {exc}"))
            raise self._broken.again() from exc
        finally:
            self._waiters.pop(key, None)
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # failed while this step was still writing: retrieved, not logged as lost
        seconds = time.perf_counter() - sent
        self._slowest[size] = max(seconds, STEP_TIME_DECAY * self._slowest.get(size, 0.0))
        if self.observe_link is not None:
            self.observe_link(max(0.0, seconds - sum(result.handle_ms) / 1000))
        if not logits_count:
            return None
        return self._candidates(result)

    def _candidates(self, result: pb.StepResult) -> StepOutput:
        """The last stage's candidates in ``result``. Raises ``StageFailure`` naming the last stage when they
        are malformed (another dtype or shape, NaN or +inf log-probabilities, ids outside the vocabulary):
        such a result would reach the client as a 500, a literal NaN in its stream, or blame stage 0 for
        the token it was fed next."""
        try:
            ids = from_tensor(result.top_ids, dtype="int32", ndim=2)  # [N, k]
            logprobs = from_tensor(result.top_logprobs, dtype="float32", ndim=2)  # [N, k]
            if ids.shape != logprobs.shape:
                raise WireError(f"{list(ids.shape)} ids beside {list(logprobs.shape)} log-probabilities")
            if np.isnan(logprobs).any() or np.isposinf(logprobs).any():
                raise WireError("NaN or +inf log-probabilities")
            if ids.size and (ids.min() < 0 or (self.vocab_size and ids.max() >= self.vocab_size)):
                raise WireError(f"token ids {ids.min()}..{ids.max()} outside the vocabulary (0..{self.vocab_size - 1})")
        except WireError as exc:
            last = len(self.addresses) - 1
            raise stage_failed(last, self.addresses[last], "a pipeline step", f"its candidates: {exc}") from None
        return StepOutput(ids, logprobs)

    async def _result(self, waiter: asyncio.Future, deadline: float) -> pb.ForwardResult:
        """``waiter``'s step result by ``deadline`` (the event loop's clock), or later while a worker of this
        pipeline is suspect (``suspect()``: late for a health check, or just found gone): slow is not gone, and
        the registry's verdict closes the pipeline (failing ``waiter``) if it is gone. Raises ``TimeoutError``
        past the deadline with no worker suspect (a stage answers its health checks but not this step), or
        ``VERDICT_WAIT_S`` past it in any case."""
        verdict_by = deadline + VERDICT_WAIT_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    return await asyncio.shield(waiter)
            except TimeoutError:
                now = asyncio.get_running_loop().time()
                if not waiter.done() and (not self.suspect() or now > verdict_by):
                    raise
                deadline = now + SUSPECT_POLL_S

    def _deadline_s(self, size: int, timeout_s: float) -> float:
        """A step's deadline (``queued_deadline_s``) given ``timeout_s``, the configured one: the slowest recent
        step of its chunk size class ``size``, the steps in flight now, and the links' round trips."""
        return queued_deadline_s(timeout_s, self._slowest.get(size, 0.0), len(self._waiters), self.link_rtt_s())

    def _kv_deadline_s(self, timeout_s: float) -> float:
        """A KV operation's deadline (open, close, copy, merge, compaction; ``queued_deadline_s``) given
        ``timeout_s``, the configured one: at each stage it waits behind the steps queued there, so it counts the
        slowest recent step of any size. (A rehearsal on 2 loaded cores: 20 concurrent schema streams, a merge into
        a decode batch behind the batch groups' steps at stage 0 outlasted 4 x the slowest step.)"""
        slowest = max(self._slowest.values(), default=0.0)
        return queued_deadline_s(timeout_s, slowest, len(self._waiters), self.link_rtt_s())

    def ack_failure(self, ack: pb.LinkAck) -> StageFailure:
        """The failure a ``LinkAck`` reports. A stage that could not reach the next one reports ``stage N
        at ADDRESS: ...``, nested down the chain, so the innermost such prefix names the stage that
        failed; without one, stage 0 itself failed. A stage reporting DEADLINE_EXCEEDED itself (the step's
        deadline passed while it computed or queued there: worker/server.py) answered, so it is slow, not
        lost: the step missed its deadline as when the coordinator's own wait runs out (no stage named, no
        failover: a stalled or overloaded PC is not a dead one)."""
        stage, address, rest = 0, self.addresses[0], ack.details
        while m := re.match(r"stage (\d+) at (\S+): ", rest):
            stage, address, rest = int(m.group(1)), m.group(2), rest[m.end():]
        code = _CODES.get(ack.code, grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return StageFailure(f"a pipeline step ran past its deadline at stage {stage}, whose worker {address} "
                                "answered late (overloaded or stalled); send the request again",
                                detail=f"{code.name}: {ack.details}")
        return _classified(stage, address, "a pipeline step", code, f"{code.name}: {ack.details}")


_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _failure(stage: int, address: str, what: str, exc: BaseException) -> StageFailure:
    """The ``StageFailure`` of ``stage`` at ``address`` failing ``what`` with ``exc``, in plain words: a
    worker that cannot be reached (or did not answer in time) stopped answering, else it failed; the gRPC
    status and details go to the ``detail``."""
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
    return _classified(stage, address, what, code, describe(exc))


def _classified(stage: int, address: str, what: str, code: grpc.StatusCode | None, description: str) -> StageFailure:
    """``stage_lost`` for a status that means the worker is gone or silent (``_LOST``), else ``stage_failed``;
    ``description`` (the status and its details) goes to the detail after ``what``."""
    detail = f"{what}: {description}"
    if code in _LOST:
        return stage_lost(stage, address, detail)
    return stage_failed(stage, address, what, detail)

