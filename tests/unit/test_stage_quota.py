"""An empty worker's stage cache under its quota, and the PutStage slots (issue 45): the least recently used builds
are deleted first, never those kept; what no transfer will finish is deleted, what one still writes is not; a
call is stalled when silent or trickling, never while it keeps sending."""

from __future__ import annotations

import asyncio
import os
import time

from worker import stage_quota
from worker.put_slots import MIN_RATE_BYTES_S, STALL_S, Put
from worker.stage_quota import JUNK_AGE_S, MAX_BUILDS, PART_MAX_AGE_S, clean, over


def build(root, name: str, nbytes: int, used: float) -> None:
    folder = root / (name * 64)
    (folder / "stage_1").mkdir(parents=True)
    (folder / "stage_1" / "openvino_model.bin").write_bytes(b"x" * nbytes)
    os.utime(folder, (used, used))


def test_the_least_recently_used_builds_go_first_and_kept_ones_never(tmp_path):
    now = time.time()
    for name, used in (("a", now - 300), ("b", now - 200), ("c", now - 100)):
        build(tmp_path, name, 1000, used)
    assert over(tmp_path, 3500, 1000, keep={"a" * 64}) == (2000, 0)
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["a", "c"]  # b: the oldest not kept
    assert over(tmp_path, 3000, 1000, keep=set()) == (2000, 0)  # fits: nothing deleted
    assert over(tmp_path, 1500, 1000, keep={"a" * 64, "c" * 64}) == (2000, 1500)  # kept: still 1500 bytes over
    assert len(list(tmp_path.iterdir())) == 2


def test_no_more_than_max_builds_are_kept(tmp_path):
    now = time.time()
    for i in range(MAX_BUILDS + 3):
        folder = tmp_path / f"{i:064x}"
        folder.mkdir()
        os.utime(folder, (now - 10_000 + i, now - 10_000 + i))
    over(tmp_path, 1 << 30, 0, keep=set())
    left = sorted(int(p.name, 16) for p in tmp_path.iterdir())
    assert left == list(range(3, MAX_BUILDS + 3))


def test_clean_deletes_what_no_transfer_finishes_and_nothing_being_written(tmp_path):
    old = time.time() - PART_MAX_AGE_S - 60
    keep = tmp_path / ("a" * 64)
    (keep / "stage_1").mkdir(parents=True)
    stale, busy, fresh = (keep / "stage_1" / f"{n}.bin.part" for n in ("stale", "busy", "fresh"))
    for path in (stale, busy, fresh):
        path.write_bytes(b"x")
    for path in (stale, busy):
        os.utime(path, (old, old))
    junk = tmp_path / ("b" * 64)
    junk.mkdir()
    young_junk = tmp_path / ("c" * 64)
    young_junk.mkdir()
    os.utime(junk, (time.time() - JUNK_AGE_S - 60,) * 2)
    mine = tmp_path / "speed.json"  # not the cache's to delete
    mine.write_text("{}")
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / f"{'d' * 64}.json").write_text("{}")  # the index of a .bin no build holds
    (tmp_path / "segments" / f"{'e' * 64}.json").write_text("{}")

    def readable(name: str) -> set[str] | None:
        return {"e" * 64} if name == "a" * 64 else None

    gone = clean(tmp_path, {busy}, readable, "segments")
    assert not stale.exists() and busy.exists() and fresh.exists(), gone
    assert not junk.exists() and young_junk.exists() and mine.exists(), gone
    assert sorted(p.name[0] for p in (tmp_path / "segments").iterdir()) == ["e"], gone
    assert stage_quota.folder_bytes(keep) == 2


def test_a_call_is_stalled_when_silent_or_trickling_never_while_it_sends():
    async def run() -> None:
        put = Put(asyncio.current_task())
        now = time.monotonic()
        assert not put.stalled(now + STALL_S - 1)
        assert put.stalled(now + STALL_S + 1) >= STALL_S  # silent
        put.started, put.last = now - 10 * STALL_S, now
        put.received = int(MIN_RATE_BYTES_S * 10 * STALL_S * 0.5)
        assert put.stalled(now)  # a piece a second ago, but at half the minimum rate on average
        put.received = int(MIN_RATE_BYTES_S * 10 * STALL_S * 2)
        assert not put.stalled(now)

    asyncio.run(run())
