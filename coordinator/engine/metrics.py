"""The coordinator's Prometheus metrics, served at ``/metrics`` by the HTTP API.

Requests by outcome, prompt and completion tokens, TTFT, TPOT, per-request decode tokens/s,
speculative drafted/accepted tokens, pipeline step time, per-link hop latency, errors; and, read at
scrape time, the queue depth, running requests and every worker's KV bytes, sessions and health from
its last health check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet_common.metrics import LATENCY_BUCKETS, error_counter, link_histogram

TOKEN_RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 200)


class CoordinatorMetrics:
    """Counters and histograms the engine updates; gauges come from ``state`` at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fleet_requests", "Chat completion requests by outcome "
                                "(finished, failed, cancelled, refused)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("fleet_prompt_tokens", "Prompt tokens of requests that ran", registry=r)
        self.cached_tokens = Counter("fleet_prompt_cached_tokens", "Prompt tokens served from retained KV (prefix "
                                     "cache) instead of being prefilled", registry=r)
        self.prefix_evictions = Counter("fleet_prefix_cache_evictions", "Retained sessions freed (LRU, idle, "
                                        "admission pressure)", registry=r)
        self.completion_tokens = Counter("fleet_completion_tokens", "Completion tokens generated", registry=r)
        self.ttft = Histogram("fleet_ttft_seconds", "Time to first token (request start to first token, queue "
                              "included)", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("fleet_tpot_seconds", "Time per output token after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.decode_rate = Histogram("fleet_request_decode_tokens_per_second", "Decode tokens/s of each request "
                                     "(1 / TPOT)", buckets=TOKEN_RATE_BUCKETS, registry=r)
        self.drafted = Counter("fleet_spec_drafted_tokens", "Draft tokens sent for verification", registry=r)
        self.accepted = Counter("fleet_spec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.compactions = Counter("fleet_kv_compactions", "KV compactions (one state rewrite per stage)",
                                   registry=r)
        self.step = Histogram("fleet_pipeline_step_seconds", "Wall time of one step through every stage",
                              ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.failovers = Counter("fleet_failovers", "Sessions moved to replicas after a stage failed (KV rebuilt "
                                 "by prefilling their visible tokens again)", registry=r)
        self.link = link_histogram(r)
        self.errors = error_counter(r)

    def watch(self, state: Callable[[], dict]) -> None:
        """Export the gauges ``state()`` returns at each scrape: ``queued``, ``running`` and
        ``workers`` (dicts with address, stage, healthy, sessions, sequences, kv_bytes,
        kv_reserved_bytes, kv_budget_bytes, busy)."""
        self.registry.register(_StateCollector(state))

    def finished(self, request) -> None:  # noqa: ANN001 - engine.Request
        """Count one request that ran (any outcome but refused)."""
        self.requests.labels(request.status.value).inc()
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.cached_tokens.inc(request.cached_tokens)
        self.completion_tokens.inc(len(request.output_ids))
        if request.ttft_ms is not None:
            self.ttft.observe(request.ttft_ms / 1000)
        if (rate := request.decode_tokens_per_s) is not None:
            self.tpot.observe(1 / rate)
            self.decode_rate.observe(rate)
        self.drafted.inc(request.drafted)
        self.accepted.inc(request.accepted)
        self.compactions.inc(request.compactions)


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], dict]) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.state()
        yield GaugeMetricFamily("fleet_queue_depth", "Requests waiting for a slot or for KV room", value=s["queued"])
        yield GaugeMetricFamily("fleet_running_requests", "Requests generating now", value=s["running"])
        yield GaugeMetricFamily("fleet_prefix_cache_sessions", "Retained sessions (prefix cache)",
                                value=s.get("retained_sessions", 0))
        yield GaugeMetricFamily("fleet_prefix_cache_tokens", "Tokens the retained sessions hold",
                                value=s.get("retained_tokens", 0))
        series = {
            "healthy": "1 if the worker passed its last health check",
            "sessions": "KV states the worker holds (sessions and batch groups)",
            "sequences": "Sequences in those states",
            "kv_bytes": "KV cache bytes the worker holds",
            "kv_reserved_bytes": "KV bytes reserved by admitted sessions",
            "kv_budget_bytes": "The worker's KV budget",
            "busy": "Chunks queued or running at the worker",
        }
        for key, doc in series.items():
            family = GaugeMetricFamily(f"fleet_stage_{key}", doc, labels=["stage", "address"])
            for w in s["workers"]:
                family.add_metric([str(w["stage"]), w["address"]], float(w[key]))
            yield family
