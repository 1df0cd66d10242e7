"""Where one request's KV lives on the stages: its pipeline and session, its batch group row once it
decodes, and the moves to replica workers after a stage failure."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .batching import BatchGroup, Member
from .errors import StageFailure
from .request import Request

if TYPE_CHECKING:
    from .engine import Engine


class Seat:
    """Where one request's KV lives: its pipeline and session, and its batch group row once it decodes.
    A stage failure moves it to replica workers (``Engine._fail_over``), which rebuild the KV from the
    tokens the coordinator owns."""

    def __init__(self, engine: Engine, request: Request, pipeline, slots: int,  # noqa: ANN001
                 session: str | None = None, cached: int = 0) -> None:
        self.engine, self.request, self.slots = engine, request, slots
        self.pipeline, self.session = pipeline, session or request.request_id
        self.cached = cached  # prompt tokens the session holds already (a retained session's KV)
        self.draft = None  # the retained draft session of those tokens (a DraftSession), if any
        self.draft_prefill: asyncio.Future | None = None
        self.group: BatchGroup | None = None
        self.member: Member | None = None
        self._joined_compactions = 0  # the group's compactions when it joined (the rest count for it)

    async def prefill(self, prompt: list[int], top_k: int):  # noqa: ANN201 - StepOutput
        """Prefill ``prompt`` on the stages after its ``cached`` tokens; the candidates of its last
        position. On a stage failure the prefill starts over on replicas (a fresh session, given the
        cached tokens again first)."""
        while True:
            try:
                return await self.engine._prefill(self.pipeline, self.session, prompt[self.cached:], top_k,
                                                  logits=True, request=self.request, offset=self.cached)
            except StageFailure as exc:
                await self._move(exc, prompt[:self.cached])

    async def join(self, logical: int) -> None:
        """Move the prefilled session (``logical`` tokens visible) into a batch group of its pipeline,
        failing over if need be."""
        while True:
            self.member = Member(self.session, self.slots, logical)
            self.group = self.engine.batcher.assign(self.pipeline)
            try:
                await self.group.join(self.member)
                self._joined_compactions = self.group.compactions
                return
            except StageFailure as exc:
                await self._fail_over(exc)

    async def step(self, chunk: list[int], logical: int, top_k: int):  # noqa: ANN201 - StepOutput
        """Run ``chunk`` (positions from ``logical``) in the group's next step; on a stage failure, fail
        over, join a group of the replicas and run it there."""
        while True:
            if self.group is None:
                await self.join(logical)
            try:
                return await self.group.step(self.member, chunk, logical, len(chunk), top_k)
            except StageFailure as exc:
                await self._fail_over(exc)

    async def _fail_over(self, failure: StageFailure) -> None:
        """Leave the (broken) group and move to replicas; the stages then hold prompt + output except the
        newest token, which the next chunk feeds."""
        await self._move(failure, self.request.prompt_ids + self.request.output_ids[:-1])

    async def _move(self, failure: StageFailure, visible: list[int]) -> None:
        self.leave()
        self.pipeline, self.session = await self.engine._fail_over(self.request, failure, self.pipeline,
                                                                   self.session, self.slots, visible)

    def count_compactions(self) -> None:
        """Count the group's compactions since the last count for the request."""
        if self.group is not None:
            self.request.compactions += self.group.compactions - self._joined_compactions
            self._joined_compactions = self.group.compactions

    def leave(self) -> bool:
        """Leave the batch group, if in one; True when the group holds the session's KV (and frees it)."""
        if self.group is None:
            return False
        owned = self.member.owned
        self.count_compactions()
        self.group.leave(self.member)
        self.group = None
        return owned

    def detach(self, session_id: str, tokens: int) -> asyncio.Future:
        """Leave the batch group with the first ``tokens`` of the session's KV copied into a new session
        ``session_id`` on every stage (``BatchGroup.detach``); the future the copy's outcome comes in."""
        self.count_compactions()
        group, self.group = self.group, None
        return asyncio.ensure_future(group.detach(self.member, session_id, tokens))
