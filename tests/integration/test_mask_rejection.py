"""Mask-based rejection on real shards (design.md §5): tokens fed and then hidden through the attention
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
