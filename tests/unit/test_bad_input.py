"""Bad input the fuzz test (tests/integration/test_fuzz.py) found raising unhandled exceptions in a
worker: each must be a ``ChunkError`` (INVALID_ARGUMENT) before any state changes; and the next-stage
channels a worker keeps must stay bounded whatever routes callers name."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from fleet_common.runtime import ChunkError, KVSession, run_chunk
from worker.server import MAX_NEXT_STAGE_CHANNELS, StageService


class Untouched:
    """Stands in for an OpenVINO InferRequest that must not be used: the chunk is refused first."""

    def infer(self, _inputs):  # noqa: ANN001, ANN202
        raise AssertionError("the state was touched")


def _session(rows: int = 1) -> KVSession:
    return KVSession("s", Untouched(), max_context=16, rows=rows)


def test_keep_rows_beyond_int32_is_a_chunk_error():
    with pytest.raises(ChunkError, match="keep_rows"):  # was OverflowError from numpy
        run_chunk(_session(), "input_ids", np.ones((1, 1), np.int64), 0, 0, [], None, keep_rows=[2**32 - 1])


def test_row_start_positions_must_match_the_rows():
    with pytest.raises(ChunkError, match="3 row start positions for a chunk of 2 rows"):  # was a broadcast ValueError
        run_chunk(_session(rows=2), "input_ids", np.ones((2, 1), np.int64), 0, [1, 2, 3], [], None)


def test_next_stage_channels_are_bounded():
    """Every address a caller names in a route got a channel that stayed open forever (~31 KiB each,
    measured): now the least recently used beyond ``MAX_NEXT_STAGE_CHANNELS`` is closed."""

    async def main() -> None:
        service = StageService(SimpleNamespace(stage=0), store=None, manifest_sha256="", max_context=16)
        try:
            for i in range(3 * MAX_NEXT_STAGE_CHANNELS):
                service.channels.stub(f"127.0.{i}.1:1")
            service.channels.stub("127.0.40.1:1")  # a recent one is reused and becomes the most recent
            open_now = service.channels.addresses()
            assert len(open_now) == MAX_NEXT_STAGE_CHANNELS
            assert open_now[-1] == "127.0.40.1:1" and "127.0.0.1:1" not in open_now
            await asyncio.sleep(0.1)
            assert not service.channels.closing  # the evicted ones closed (no calls on them)
        finally:
            await service.close()

    asyncio.run(main())
