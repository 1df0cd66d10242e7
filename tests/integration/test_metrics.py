"""Prometheus ``/metrics`` on both roles of a real 2-stage fleet: the series a fleet operator needs
(tokens, TTFT, TPOT, acceptance, queue depth, KV bytes per stage, hop latency per link, errors) are
there and count what happened."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.fleet.local import free_port
from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from tests.conftest import Fleet, chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} missing; have {sorted({k[0] for k in samples})}"
    return samples[key]


def test_metrics_on_coordinator_and_workers(build_2, tmp_path):
    ports = [free_port(), free_port()]
    workers = [start_worker(build_2, shard, tmp_path, "--no-announce", "--metrics-port", str(ports[shard]))
               for shard in range(2)]
    peers = [arg for _, address in workers for arg in ("--peer", address)]
    coordinator, url = start_coordinator(build_2, tmp_path, *peers, "--no-discover", "--draft", "ngram",
                                          "--spec-k", "4")  # drafts every step, whatever the step costs say
    try:
        wait_ready(url)
        for _ in range(2):
            r = chat(url, "List the numbers from one to twenty, separated by commas.", max_tokens=24, ignore_eos=True)
            assert r.status_code == 200, r.text
        with grpc.insecure_channel(workers[1][1]) as channel:  # a refused call counts as an error
            with pytest.raises(grpc.RpcError):
                pb_grpc.StageStub(channel).Compact(pb.CompactRequest(session_id="nobody"), timeout=10)

        c = scrape(f"{url}/metrics")
        assert value(c, "fleet_requests_total", outcome="finished") == 2
        assert value(c, "fleet_completion_tokens_total") == 48
        assert value(c, "fleet_prompt_tokens_total") > 0
        assert value(c, "fleet_ttft_seconds_count") == 2 and value(c, "fleet_tpot_seconds_count") == 2
        assert value(c, "fleet_spec_drafted_tokens_total") >= value(c, "fleet_spec_accepted_tokens_total") > 0
        assert value(c, "fleet_queue_depth") == 0 and value(c, "fleet_running_requests") == 0
        assert value(c, "fleet_pipeline_step_seconds_count", phase="decode") > 0
        path = "coordinator->stage0->stage1->coordinator"  # a step's time on the links: wall minus every stage's
        decode = value(c, "fleet_pipeline_step_seconds_count", phase="decode")
        assert value(c, "fleet_link_seconds_count", link=path) >= decode > 0
        assert 0 < value(c, "fleet_link_seconds_sum", link=path) < sum(
            value(c, "fleet_pipeline_step_seconds_sum", phase=phase) for phase in ("decode", "prefill"))
        for stage, (_, address) in enumerate(workers):
            assert value(c, "fleet_stage_healthy", stage=str(stage), address=address) == 1
            assert value(c, "fleet_stage_kv_budget_bytes", stage=str(stage), address=address) > 0
            value(c, "fleet_stage_kv_bytes", stage=str(stage), address=address)

        w0 = scrape(f"http://127.0.0.1:{ports[0]}/metrics")
        w1 = scrape(f"http://127.0.0.1:{ports[1]}/metrics")
        for w, stage in ((w0, "0"), (w1, "1")):
            assert value(w, "fleet_worker_infer_seconds_count") == value(w, "fleet_worker_chunks_total") > 0
            # every session closed but those the prefix cache keeps
            assert value(w, "fleet_worker_sessions", stage=stage) == value(c, "fleet_prefix_cache_sessions") > 0
            assert value(w, "fleet_worker_kv_budget_bytes", stage=stage) > 0
        for w in (w0, w1):  # the inference thread's CPU is counted apart from the rest of the process's
            infer_cpu = sum(v for (name, _), v in w.items() if name == "fleet_worker_infer_cpu_seconds_total")
            assert 0 < infer_cpu <= value(w, "process_cpu_seconds_total")
            # small steps ran on the event loop's thread while the inference thread was idle
            assert value(w, "fleet_worker_infer_cpu_seconds_total", thread="event_loop") > 0
        assert value(w1, "fleet_errors_total", kind="NOT_FOUND") == 1
    finally:
        coordinator.stop()
        for proc, _ in workers:
            proc.stop()


def test_request_outcomes_streamed_or_not(build_2, tmp_path):
    """A request that ran to its finish is ``finished`` whether it streamed or not (the API closes the
    stream after the finish chunk); one whose client hung up mid-stream is ``cancelled``."""
    fleet = Fleet(build_2, tmp_path, peers=True)
    try:
        for stream in (False, True, True):
            body = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0,
                    "max_tokens": 8, "stream": stream}
            r = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                assert '"finish_reason": "length"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "temperature": 0,
                "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=body, timeout=60) as r:
            contents = (line for line in r.iter_lines() if '"content": "' in line and '"content": ""' not in line)
            for _ in range(3):
                next(contents)  # then hang up mid-stream
        deadline = time.monotonic() + 10
        while ("fleet_requests_total", (("outcome", "cancelled"),)) not in (c := scrape(f"{fleet.url}/metrics")):
            assert time.monotonic() < deadline, "the hung-up request was never counted"
            time.sleep(0.1)
        outcomes = {dict(k[1])["outcome"]: v for k, v in c.items() if k[0] == "fleet_requests_total"}
        assert outcomes == {"finished": 3, "cancelled": 1}, outcomes
        assert value(c, "fleet_running_requests") == 0
    finally:
        fleet.stop()
