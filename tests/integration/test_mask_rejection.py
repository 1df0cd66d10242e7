"""Mask-based rejection on real shards (docs/design-worker.md): tokens fed and then hidden through the attention
mask leave the same next-token logits as a run that never fed them; their KV slots stay in the state."""

from __future__ import annotations

import numpy as np
import pytest

from fleet_common.manifest import load_manifest
from worker.runner import ShardRunner
from worker.sessions import SessionStore

pytestmark = pytest.mark.integration


def test_hidden_slots_equal_never_fed(build_2):
    loaded = load_manifest(build_2)
    runners = [ShardRunner(loaded, i, threads=1, inference_precision="f32") for i in range(2)]
    stores = [SessionStore(r.new_request, 4, 60) for r in runners]

    def step(sid: str, ids: list[int], past: int, position: int, hide: list[int] = ()) -> np.ndarray:
        x = np.asarray([ids], dtype=np.int64)
        for runner, store in zip(runners, stores):
            x = runner.run(store.get(sid), x, past, position, list(hide), 1).output
        return x[0, -1]  # [V] logits of the chunk's last position

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    n = len(prompt)
    for sid in ("clean", "rejected"):
        for store in stores:
            store.open(sid, 64)
        step(sid, prompt, 0, 0)

    # clean: x then y at logical positions n, n+1
    step("clean", [282], n, n)
    clean = step("clean", [4649], n + 1, n + 1)
    # rejected: a verify window [x, d1, d2] whose two drafts are rejected, then y at logical n+1,
    # physical slot n+3, with slots n+1 and n+2 hidden from then on
    step("rejected", [282, 77, 999], n, n)
    rejected = step("rejected", [4649], n + 3, n + 1, hide=[n + 1, n + 2])

    assert stores[0].get("rejected").length == n + 4  # rejected KV stays in the state, never trimmed
    assert clean.argmax() == rejected.argmax()
    np.testing.assert_allclose(rejected, clean, atol=1e-4)

    # compaction rewrites the state without the hidden slots: same logits afterwards (to float rounding:
    # the two sessions fed the same tokens in different chunks), fewer slots
    for runner, store in zip(runners, stores):
        length, _ = runner.compact(store.get("rejected"), n + 4, [])
        assert length == n + 2
        assert store.get("rejected").compactions == 1
    after_clean = step("clean", [30], n + 2, n + 2)
    after_compact = step("rejected", [30], n + 2, n + 2)
    np.testing.assert_allclose(after_compact, after_clean, atol=1e-4)


def test_copied_prefix_equals_never_fed_rest(build_2):
    """``SessionStore.copy`` (prefix caching): the first N visible tokens of a session whose state also holds
    hidden (rejected) slots and a different continuation, copied into a new session, leave the same
    logits as a session that was only ever fed those N tokens; the source is untouched, and a copy that
    does not fit the KV budget or names a bad row or count is refused with the source intact."""
    from fleet_common.runtime import ChunkError
    from worker.sessions import SessionLimit

    loaded = load_manifest(build_2)
    runners = [ShardRunner(loaded, i, threads=1, inference_precision="f32") for i in range(2)]
    stores = [SessionStore(r.new_request, 8, 60, kv_bytes_per_slot=1, kv_budget_bytes=400) for r in runners]

    def step(sid: str, ids: list[int], past: int, position: int, hide: list[int] = ()) -> np.ndarray:
        x = np.asarray([ids], dtype=np.int64)
        for runner, store in zip(runners, stores):
            x = runner.run(store.get(sid), x, past, position, list(hide), 1).output
        return x[0, -1]

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    n = len(prompt)
    for sid in ("source", "fresh"):
        for store in stores:
            store.open(sid, 64)
    step("fresh", prompt[:12], 0, 0)
    fresh = step("fresh", [282, 4649], 12, 12)
    # the source: the prompt, a verify window with two rejected drafts, one more token
    step("source", prompt, 0, 0)
    step("source", [30, 77, 999], n, n)
    step("source", [31], n + 3, n + 1, hide=[n + 1, n + 2])
    for store in stores:
        store.copy("copy", "source", 0, 12, 32)
        assert store.get("copy").length == 12 and store.get("source").length == n + 4
    copied = step("copy", [282, 4649], 12, 12)
    np.testing.assert_allclose(copied, fresh, atol=1e-4)
    assert copied.argmax() == fresh.argmax()

    # a copy of the tokens past a hidden slot gathers them in order: the whole visible row (n + 2)
    for store in stores:
        store.copy("all", "source", 0, n + 2, 40)
    np.testing.assert_allclose(step("all", [5], n + 2, n + 2), step("source", [5], n + 4, n + 2), atol=1e-4)

    store = stores[0]
    with pytest.raises(SessionLimit):  # 64 + 64 + 32 + 40 reserved of 400: 300 more do not fit
        store.copy("big", "source", 0, 4, 300)
    with pytest.raises(ChunkError):
        store.copy("bad", "source", 1, 4, 8)  # no row 1
    with pytest.raises(ChunkError):
        store.copy("bad", "source", 0, n + 4, 40)  # more than its n + 3 visible slots
    assert "big" not in {s.session_id for s in store.sessions()} and "bad" not in {s.session_id for s in store.sessions()}
    # resume: the same KV, a new reservation (shrunk to what it holds, then grown within the budget)
    session = store.resume("copy", 14)
    assert session.length == 14 and session.reserved == [14] and session.max_context == 14
    with pytest.raises(SessionLimit):
        store.resume("copy", 400)
    assert store.get("copy").max_context == 14  # refused: unchanged
