"""A worker's Prometheus metrics, served over HTTP with ``fleet-worker --metrics-port``.

Chunks and tokens processed, inference time per chunk and the inference thread's CPU time (the rest of
the process's CPU is what a stage costs beyond its layers), errors by gRPC status, and, read at scrape
time, sessions, sequences, KV bytes held, reserved and budgeted, and chunks in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet_common.metrics import LATENCY_BUCKETS, error_counter


class WorkerMetrics:
    """Counters and histograms the stage service updates; gauges come from ``watch``'s callback."""

    def __init__(self, stage: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage = str(stage)
        self.chunks = Counter("fleet_worker_chunks", "Chunks (steps of a session or batch group) run here", registry=r)
        self.tokens = Counter("fleet_worker_tokens", "Token positions run through this stage", registry=r)
        self.infer = Histogram("fleet_worker_infer_seconds", "Inference time of one chunk at this stage",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.infer_cpu = Counter("fleet_worker_infer_cpu_seconds", "CPU time of the thread running chunks "
                                 "(inputs built, infer, output copied), by thread: the inference thread, or the "
                                 "event loop's for a small step while that one is idle; the rest of the process's "
                                 "CPU is overhead", ["thread"], registry=r)
        self.errors = error_counter(r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, ...

    def watch(self, state: Callable[[], dict[str, float]]) -> None:
        """Export ``state()``'s values as ``fleet_worker_<key>`` gauges at each scrape."""
        self.registry.register(_StateCollector(state, self.stage))

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` from a background thread. Raises ``OSError`` if the
        port cannot be bound."""
        start_http_server(port, addr=host, registry=self.registry)


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], dict[str, float]], stage: str) -> None:
        self.state, self.stage = state, stage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for key, value in self.state().items():
            family = GaugeMetricFamily(f"fleet_worker_{key}", f"{key.replace('_', ' ')} at this stage",
                                       labels=["stage"])
            family.add_metric([self.stage], float(value))
            yield family
