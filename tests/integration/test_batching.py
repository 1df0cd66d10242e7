"""Batch groups on the real demo model (in process, f32): sequences merged into one KV state and stepped
together (left padding, hidden rejected slots, a row dropped through ``beam_idx``, compaction) give
each sequence the logits it gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from fleet_common.runtime import ChunkError, KVSession, compact, compile_ir, merge, run_chunk

pytestmark = pytest.mark.integration

TOL = 1e-4  # f32; batched rows measured bit-identical to batch 1 here, masked attention may round differently


@pytest.fixture(scope="module")
def model(build_1):
    compiled, _, _ = compile_ir(build_1 / "stage_0" / "openvino_model.xml", "CPU", 1, "f32")
    return compiled


def solo_logits(model, tokens: list[int], prefill: int) -> np.ndarray:
    """Logits [len(tokens) - prefill, V] of every token after the first ``prefill``, fed one at a time."""
    kv = KVSession("solo", model.create_infer_request(), 256)
    run_chunk(kv, "input_ids", np.array([tokens[:prefill]]), 0, 0, [], np.array([prefill - 1]))
    out = []
    for i in range(prefill, len(tokens)):
        out.append(run_chunk(kv, "input_ids", np.array([[tokens[i]]]), kv.length, i, [], np.array([0]))[0][0, 0])
    return np.stack(out)


def test_group_rows_equal_solo_sessions(model):
    rng = np.random.default_rng(7)
    a = rng.integers(0, 49152, 40).tolist()
    b = rng.integers(0, 49152, 40).tolist()
    c = rng.integers(0, 49152, 40).tolist()
    ref = {name: solo_logits(model, seq, 20) for name, seq in (("a", a), ("b", b), ("c", c))}

    sessions = []
    for name, seq, n in (("a", a, 20), ("b", b, 23), ("c", c, 20)):  # b prefilled further: rows of unequal length
        kv = KVSession(name, model.create_infer_request(), 256)
        run_chunk(kv, "input_ids", np.array([seq[:n]]), 0, 0, [], np.array([n - 1]))
        sessions.append(kv)
    group = merge("group", sessions, model.create_infer_request(), 256)
    assert (group.rows, group.length) == (3, 23)
    assert all(s.request is None for s in sessions)

    # step 1: a and c feed 2 tokens (a "verify" of one draft each), b one token; rows padded on the left
    pos = {"a": 20, "b": 23, "c": 20}
    x = np.array([a[20:22], [0, b[23]], c[20:22]])
    logits, _ = run_chunk(group, "input_ids", x, 23, [20, 23, 20], [], np.arange(2), pads=[0, 1, 0])
    np.testing.assert_allclose(logits[0], ref["a"][0:2], atol=TOL)
    np.testing.assert_allclose(logits[1, 1], ref["b"][3], atol=TOL)
    np.testing.assert_allclose(logits[2], ref["c"][0:2], atol=TOL)
    pos = {"a": 22, "b": 24, "c": 22}

    # step 2: a's second token is rejected (hidden from now on, never trimmed); a re-feeds from 21
    x = np.array([[a[21]], [b[24]], [c[22]]])
    logits, _ = run_chunk(group, "input_ids", x, 25, [21, 24, 22], [24], np.arange(1), hide_rows=[0])
    np.testing.assert_allclose(logits[0, 0], ref["a"][1], atol=TOL)
    np.testing.assert_allclose(logits[1, 0], ref["b"][4], atol=TOL)
    np.testing.assert_allclose(logits[2, 0], ref["c"][2], atol=TOL)
    pos = {"a": 22, "b": 25, "c": 23}

    # step 3: b leaves; keep_rows drops its row (beam_idx) as the step runs
    x = np.array([[a[22]], [c[23]]])
    logits, _ = run_chunk(group, "input_ids", x, 26, [22, 23], [], np.arange(1), keep_rows=[0, 2])
    assert group.rows == 2 and len(group.reserved) == 2
    np.testing.assert_allclose(logits[0, 0], ref["a"][2], atol=TOL)
    np.testing.assert_allclose(logits[1, 0], ref["c"][3], atol=TOL)

    # step 4: c sits the step out (a straggler: its row is padded all the way)
    x = np.array([[a[23]], [0]])
    logits, _ = run_chunk(group, "input_ids", x, 27, [23, 24], [], np.arange(1), pads=[0, 1])
    np.testing.assert_allclose(logits[0, 0], ref["a"][3], atol=TOL)

    # compaction repacks every row (a: 24 visible, c: 24) and later steps still match
    length, _ = compact(group, 28, [])
    assert length == 24 and group.visible[0].sum() == 24 and group.visible[1].sum() == 24
    x = np.array([a[24:26], c[24:26]])
    logits, _ = run_chunk(group, "input_ids", x, 24, [24, 24], [], np.arange(2))
    np.testing.assert_allclose(logits[0], ref["a"][4:6], atol=TOL)
    np.testing.assert_allclose(logits[1], ref["c"][4:6], atol=TOL)


def test_bad_group_arguments_are_refused_untouched(model):
    kv = KVSession("s", model.create_infer_request(), 64)
    run_chunk(kv, "input_ids", np.array([[1, 2, 3]]), 0, 0, [], np.array([2]))
    other = KVSession("t", model.create_infer_request(), 64)
    run_chunk(other, "input_ids", np.array([[4, 5]]), 0, 0, [], np.array([1]))
    group = merge("g", [kv, other], model.create_infer_request(), 64)
    for kwargs, x in (({"keep_rows": [0, 0]}, [[1], [1]]), ({"keep_rows": [2]}, [[1]]), ({}, [[1]]),
                      ({"pads": [2, 0]}, [[1], [1]]), ({"pads": [1, 1]}, [[1], [1]]),
                      ({"hide_rows": [5]}, [[1], [1]])):
        hide = [0] if "hide_rows" in kwargs else []
        with pytest.raises(ChunkError):
            run_chunk(group, "input_ids", np.array(x), 3, [3, 2], hide, np.array([0]), **kwargs)
    assert (group.rows, group.length) == (2, 3)


async def solo_greedy(pipeline, sid: str, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``prompt`` decoded alone on ``pipeline``, one step at a time."""
    await pipeline.open_session(sid, 64, 10)
    out = await pipeline.step(sid, prompt, 0, 0, 1, 1, 30)
    tokens = [int(out.top_ids[-1, 0])]
    for i in range(n - 1):
        pos = len(prompt) + i
        out = await pipeline.step(sid, tokens[-1:], pos, pos, 1, 1, 30)
        tokens.append(int(out.top_ids[-1, 0]))
    await pipeline.close_session(sid, 10)
    return tokens


def test_step_loop_over_real_workers_equals_solo_and_a_slow_reader_stalls_nobody(build_2, tmp_path):
    """Two requests in one batch group of a step loop over a real 2-stage fleet: greedy tokens equal solo
    decoding; while one request's client reads nothing (its deltas queue up), the other's steps go on;
    once both end the group's KV is closed on every stage."""
    import asyncio

    import grpc

    from coordinator.engine.loop import LoopContext, StepLoop
    from coordinator.engine.metrics import CoordinatorMetrics
    from coordinator.engine.output import OutputProcessor
    from coordinator.engine.pipeline import Channels, Pipeline
    from coordinator.engine.request import Request, SamplingParams
    from coordinator.engine.scheduler import Scheduler, Seq
    from coordinator.engine.speculative import StepCostsByLoad
    from coordinator.tokenizer import ChatTokenizer
    from fleet_common import fleet_pb2 as pb
    from fleet_common import fleet_pb2_grpc as pb_grpc
    from fleet_common.manifest import load_manifest
    from tests.conftest import start_worker

    workers = [start_worker(build_2, shard, tmp_path) for shard in range(2)]
    addresses = [address for _, address in workers]
    sha = load_manifest(build_2).sha256
    tokenizer = ChatTokenizer(build_2)
    prompts = {"a": [1, 504, 3060, 282, 4649, 314], "b": [1, 9690, 198, 2683, 359, 253, 5356, 30]}
    lengths = {"a": 6, "b": 14}

    async def main() -> None:
        channels = Channels()
        pipeline = await Pipeline.connect(addresses, channels, sha)
        try:
            ref = {sid: await solo_greedy(pipeline, sid, prompts[sid], lengths[sid]) for sid in prompts}
            costs = StepCostsByLoad(lambda: 2)
            ctx = LoopContext(lambda n: 30.0, CoordinatorMetrics(), costs, None, "none", None, lambda: None, 10.0)
            loop = StepLoop(pipeline, Scheduler(1, 4, 64, 9, 0.5, 8), ctx)
            seqs = {}
            for sid, prompt in prompts.items():
                request = Request(sid, prompt, SamplingParams(max_tokens=lengths[sid], temperature=0.0,
                                                              ignore_eos=True))
                output = OutputProcessor(request, tokenizer, set(), costs, 4, None, drafting=False)
                await pipeline.open_session(sid, 64, 10)
                seqs[sid] = Seq(request, output, pipeline, sid, 64, 1, prompt)
                loop.submit(seqs[sid])
            while True:  # only b is read; a's deltas queue up meanwhile
                delta = await asyncio.wait_for(seqs["b"].outbox.get(), 30)
                if delta.finish_reason is not None:
                    break
            assert seqs["a"].request.finish_reason is not None  # a finished without being read
            got = {sid: seq.request.output_ids for sid, seq in seqs.items()}
            assert got == ref
            assert max(seq.request.batch_max for seq in seqs.values()) == 2
            for seq in seqs.values():
                await asyncio.wait_for(loop.end(seq, retain=False), 10)
            for _ in range(100):
                if loop.idle:
                    break
                await asyncio.sleep(0.05)
            loop.close()
        finally:
            await pipeline.close()
            await channels.close()

    try:
        asyncio.run(main())
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)
            assert (info.sessions, info.sequences, info.kv_reserved_bytes) == (0, 0, 0)
    finally:
        for proc, _ in workers:
            proc.stop()
