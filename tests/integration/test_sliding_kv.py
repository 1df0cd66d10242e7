"""Gemma 3's local layers keep only their last KV slots (fleet_common/sliding_kv.py) and still compute what
transformers computes.

test_gemma3's tiny random model (8-token window, local layers 0, 1 and 3, global layer 2) with 512 positions, built
into 2 stages (f32 source). The local states are trimmed every few tokens here (``margin`` 4, ``min_trim`` 4: they
hold at most 22 slots between chunks), so every path that moves KV meets a trimmed state:

* a 248-token sequence fed as a prefill and then chunks of 1-8 tokens, some followed by rejected drafts the next
  chunk hides, with compactions on the way: logits within test_architectures' ``ATOL`` of transformers' f32, while
  each local state holds no more than ``held_max`` + one chunk;
* two trimmed sessions merged into a batch group (different lengths and trims), decoding on: each row's logits
  are transformers' for its own sequence;
* a copy of a row's whole prefix continues exactly; a copy of a prefix whose window the local states dropped is
  refused (``ChunkError``), as llama-server re-processes such a prompt;
* a row merged beside a less trimmed one (the group's local states start at the other's) is refused a copy of a
  prefix it no longer holds, also after a compaction of the group (each row's own ``row_start``);
* a real 2-stage fleet (worker processes at the shipped trim) answers 400 greedy tokens as transformers does, and
  the same prompt again (its prefix copy refused: prefilled in full) the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import Fleet, chat

from .test_architectures import ATOL, SEED, VOCAB, hf_greedy, reference_model
from .test_gemma3 import WINDOW, make_gemma3

pytestmark = pytest.mark.integration

POSITIONS = 512
SEQ = 248
SMALL = dict(margin=4, min_trim=4)  # keep 11 visible slots, trim once 11 can go: held_max 22
# (tokens, rejected drafts after them): a 40-token prefill, then chunks whose drafts the next chunk hides
STEPS = ((40, 2),) + ((1, 0), (3, 1), (1, 0), (2, 3), (8, 0), (1, 1), (5, 2), (1, 0), (4, 0)) * 8
COMPACT_AT = (20, 50)  # step indices after which the sessions are compacted
assert sum(n for n, _ in STEPS) == SEQ


@pytest.fixture(scope="module")
def model(tmp_path_factory, demo_hf):  # noqa: ANN201 - (build folder, transformers model)
    from compiler.build import build

    root = tmp_path_factory.mktemp("sliding")
    src = make_gemma3(root / "hf", demo_hf, max_position_embeddings=POSITIONS)["f32"]
    build(src, root / "build", shards=2)
    return root / "build", reference_model(src)


def reference_logits(ref, ids: np.ndarray) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return ref(torch.from_numpy(ids)[None]).logits[0].numpy()


def open_sessions(build: Path, **trim) -> list:
    """A one-row session per stage of ``build`` (f32, one thread) whose local states trim as ``trim`` says."""
    from fleet_common.manifest import load_manifest
    from fleet_common.runtime import KVSession, compile_ir

    manifest = load_manifest(build).manifest
    out = []
    for stage in manifest.stages:
        compiled = compile_ir(build / stage.xml, threads=1, inference_precision="f32")[0]
        sliding = manifest.sliding_kv(stage.index)
        assert sliding is not None and sliding.window == WINDOW
        out.append(KVSession(f"stage-{stage.index}", compiled.create_infer_request(), 2 * SEQ,
                             sliding=dataclasses.replace(sliding, **trim)))
    return out


def step(sessions: list, x: np.ndarray, position: int | list[int], hide: list[int], logits: int,
         hide_rows: list[int] | None = None) -> np.ndarray:
    """One chunk [rows, S] through every stage: the logits of its last ``logits`` positions [rows, logits, V]."""
    from fleet_common.runtime import run_chunk

    for i, session in enumerate(sessions):
        last = i == len(sessions) - 1
        index = np.arange(x.shape[1] - logits, x.shape[1], dtype=np.int64) if last else None
        x, _ = run_chunk(session, "input_ids" if i == 0 else "hidden_states", x, session.length, position, hide,
                         index, hide_rows)
    return x


def fresh(session):  # noqa: ANN001, ANN201 - an InferRequest
    """A new InferRequest of ``session``'s compiled model (an empty state)."""
    return session.request.get_compiled_model().create_infer_request()


def local_slots(session) -> int:  # noqa: ANN001
    """Slots the session's local states hold (each holds as many)."""
    held = {st.state.shape[2] for st in session.request.query_state() if st.name in session.sliding.states}
    assert len(held) == 1
    return held.pop()


def feed(sessions: list, ids: np.ndarray, garbage: np.ndarray, compact_at: tuple[int, ...] = ()) -> np.ndarray:
    """``ids`` fed in ``STEPS`` (rejected drafts from ``garbage``, hidden by the next chunk); the sessions are
    compacted after the steps ``compact_at``. Returns the logits of ``ids`` [len(ids), V]."""
    from fleet_common.runtime import compact

    out, pos, hide = [], 0, []
    for k, (n, rejected) in enumerate(STEPS):
        x = np.concatenate([ids[pos:pos + n], garbage[:rejected]])[None].astype(np.int64)
        out.append(step(sessions, x, pos, hide, n + rejected)[0, :n])
        slot = sessions[0].length
        hide, pos = list(range(slot - rejected, slot)), pos + n
        for session in sessions:
            assert local_slots(session) <= session.sliding.held_max + 8 + 3
        if k in compact_at:
            for session in sessions:
                compact(session, session.length, hide)
            hide = []
    return np.concatenate(out)


def test_trimmed_local_states_match_transformers(model):
    build, ref = model
    rng = np.random.default_rng(SEED)
    ids, garbage = rng.integers(3, VOCAB, SEQ), rng.integers(3, VOCAB, 8)
    sessions = open_sessions(build, **SMALL)
    logits = feed(sessions, ids, garbage, COMPACT_AT)
    assert all(s.local_start > SEQ // 2 and s.compactions == len(COMPACT_AT) for s in sessions)
    np.testing.assert_allclose(logits, reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_merge_and_copy_of_trimmed_sessions(model):
    from fleet_common.runtime import ChunkError, copy_prefix, merge

    build, ref = model
    rng = np.random.default_rng(SEED + 1)
    a_ids, b_ids, garbage = rng.integers(3, VOCAB, SEQ + 6), rng.integers(3, VOCAB, SEQ + 6), rng.integers(3, VOCAB, 8)
    a, b = open_sessions(build, **SMALL), open_sessions(build, **SMALL)
    feed(a, a_ids[:SEQ], garbage)
    for n in (100, 60):  # b: 160 tokens, fed in two chunks (a different length and trim than a's)
        start = b[0].length
        step(b, b_ids[None, start:start + n], start, [], 1)
    assert a[0].local_start != b[0].local_start and min(a[0].local_start, b[0].local_start) > 0
    group = [merge(f"g{i}", [sa, sb], fresh(sa), 2 * SEQ)
             for i, (sa, sb) in enumerate(zip(a, b))]
    positions, got = [SEQ, 160], []
    for k in range(6):
        x = np.array([[a_ids[SEQ + k]], [b_ids[160 + k]]], dtype=np.int64)
        got.append(step(group, x, [p + k for p in positions], [], 1)[:, 0])
    want_a = reference_logits(ref, a_ids[:SEQ + 6])[SEQ:]
    want_b = reference_logits(ref, b_ids[:166])[160:]
    np.testing.assert_allclose(np.stack([g[0] for g in got]), want_a, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.stack([g[1] for g in got]), want_b, atol=ATOL, rtol=0)

    copies = [copy_prefix(f"c{i}", s, 1, 166, fresh(s), 2 * SEQ)
              for i, s in enumerate(group)]  # row b, all 166 tokens: its window is held
    more = step(copies, b_ids[None, 166:170], 166, [], 4)[0]
    b_more = np.concatenate([b_ids[:166], b_ids[166:170]])
    np.testing.assert_allclose(more, reference_logits(ref, b_more)[166:170], atol=ATOL, rtol=0)
    with pytest.raises(ChunkError, match="sliding-window layers hold only"):
        copy_prefix("old", group[0], 1, 60, fresh(group[0]), 2 * SEQ)


def test_hiding_a_dropped_slot_is_refused(model):
    from fleet_common.runtime import ChunkError

    build, _ = model
    ids = np.random.default_rng(SEED + 2).integers(3, VOCAB, 80)
    sessions = open_sessions(build, **SMALL)
    step(sessions, ids[None, :79], 0, [], 1)
    step(sessions, ids[None, 79:80], 79, [], 1)
    start, length = sessions[0].local_start, sessions[0].length
    assert start > 0
    hide = list(range(length - 2 * WINDOW, length))  # more than the margin: the window reaches dropped slots
    with pytest.raises(ChunkError, match="no longer hold slot"):
        step(sessions, ids[None, :1], 80, hide, 1)
    assert sessions[0].length == length and sessions[0].visible[0, :length].all()  # untouched


def test_fleet_long_greedy_matches_transformers(model, tmp_path):
    """A real 2-stage fleet (the workers trim at the shipped margin: keep 39, held_max 103) answers 400 tokens
    as transformers does; asked again (the retained answer's prefix copy is refused: prefilled in full), the same."""
    from coordinator.tokenizer import ChatTokenizer

    build, ref = model
    tokens, prompt = 400, "Tell me a long story."
    ids = ChatTokenizer(build).encode_chat([{"role": "user", "content": prompt}])
    expected = hf_greedy(ref, ids, tokens)
    fleet = Fleet(build, tmp_path, peers=True)
    try:
        bodies = []
        for _ in range(2):
            r = chat(fleet.url, prompt, max_tokens=tokens, ignore_eos=True)
            assert r.status_code == 200, r.text
            bodies.append(r.json())
            assert bodies[-1]["fleet"]["completion_token_ids"] == expected
    finally:
        fleet.stop()
    assert bodies[0]["usage"]["prompt_tokens"] == len(ids) >= 16  # long enough for the prefix cache to look
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    log = (tmp_path / "coordinator.log").read_text()
    assert f"{len(ids) - 1} cached tokens of kv-" in log and "cannot be copied" in log
    assert "sliding-window layers hold only" in log and "could not reuse" not in log


def test_rows_merged_from_sessions_trimmed_apart(model):
    """A short fresh session merged beside a trimmed one is right-aligned (every row ends at the last slot), so the
    group's local states hold no more than the trimmed row did, also after a compaction (packed to the end). The
    trimmed row's old prefix is refused for a copy (it was once allowed, and continued on zeros: a retained
    conversation gave a regenerated answer wrong from its first token); copies whose window each row holds continue
    as transformers does."""
    from fleet_common.runtime import PrefixNotHeld, compact, copy_prefix, merge

    build, ref = model
    rng = np.random.default_rng(SEED + 3)
    a_ids, b_ids = rng.integers(3, VOCAB, 130), rng.integers(3, VOCAB, 30)
    a, b = open_sessions(build, **SMALL), open_sessions(build, **SMALL)
    step(a, a_ids[None, :100], 0, [], 1)
    for k in range(100, 120):
        step(a, a_ids[None, k:k + 1], k, [], 1)
    step(b, b_ids[None, :20], 0, [], 1)
    a_start = a[0].local_start
    assert a_start >= 90 and b[0].local_start == 0
    group = [merge(f"g{i}", [sa, sb], fresh(sa), 2 * SEQ) for i, (sa, sb) in enumerate(zip(a, b))]
    assert (group[0].local_start, group[0].row_start) == (a_start, [a_start, 100])  # b's 20 slots end at 120
    assert local_slots(group[0]) == 120 - a_start
    with pytest.raises(PrefixNotHeld):
        copy_prefix("old", group[0], 0, 60, fresh(group[0]), 2 * SEQ)
    x = np.array([[a_ids[120], a_ids[121]], [b_ids[20], b_ids[21]]], dtype=np.int64)
    step(group, x, [120, 20], [], 1)  # then the second token of each row is rejected and hidden, the group compacted
    for s in group:
        compact(s, s.length, [s.length - 1, s.length - 1], [0, 1])
    assert group[0].length == 121 and group[0].local_start >= 90 and local_slots(group[0]) <= 121 - 90
    with pytest.raises(PrefixNotHeld):
        copy_prefix("old", group[0], 0, 60, fresh(group[0]), 2 * SEQ)
    copies = [copy_prefix(f"c{i}", s, 0, 121, fresh(s), 2 * SEQ) for i, s in enumerate(group)]
    got = step(copies, a_ids[None, 121:125], 121, [], 4)[0]
    np.testing.assert_allclose(got, reference_logits(ref, a_ids[:125])[121:125], atol=ATOL, rtol=0)
    copies = [copy_prefix(f"d{i}", s, 1, 21, fresh(s), 2 * SEQ) for i, s in enumerate(group)]
    got = step(copies, b_ids[None, 21:25], 21, [], 4)[0]
    np.testing.assert_allclose(got, reference_logits(ref, b_ids[:25])[21:25], atol=ATOL, rtol=0)
