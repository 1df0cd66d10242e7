"""Prometheus metrics shared by both roles (``prometheus_client``; one registry per process object, so
several coordinators or workers in one process never collide).

Series names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms, base
units. Tokens/s is ``rate(fleet_completion_tokens_total[1m])``; the acceptance rate is
``fleet_spec_accepted_tokens_total / fleet_spec_drafted_tokens_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# a hop on a LAN is ~0.2-5 ms, over a WAN 10-200 ms; a step is 5 ms to a few seconds (long prefill)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def link_histogram(registry: CollectorRegistry) -> Histogram:
    """``fleet_link_seconds{link}``: a pipeline step's time on its links, i.e. its wall time minus every
    stage's handling time (network, serialization and queues, not compute), per path such as
    ``coordinator->stage0->stage1->coordinator`` (the stages' clocks are never compared)."""
    return Histogram("fleet_link_seconds", "A step's wall time minus every stage's handling time, per path", ["link"],
                     buckets=LATENCY_BUCKETS, registry=registry)


def error_counter(registry: CollectorRegistry) -> Counter:
    """``fleet_errors_total{kind}``: failures by exception class (coordinator) or gRPC status (worker)."""
    return Counter("fleet_errors", "Errors by kind (exception class or gRPC status)", ["kind"], registry=registry)
