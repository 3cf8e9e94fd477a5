"""Prometheus metrics of one server (issue 3, point 1: queue depth, in flight, completed by status, latency)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sandbox_server.api import Status, ToolResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """A private registry, so several servers (or tests) in one process never collide."""

    def __init__(self, queue_depth: Callable[[], float], in_flight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        Gauge("sandbox_queue_depth", "Calls waiting for a worker", registry=self.registry).set_function(queue_depth)
        Gauge("sandbox_in_flight", "Calls running on a worker", registry=self.registry).set_function(in_flight)
        self.completed = Counter(
            "sandbox_completed", "Calls answered, by status", ["status"], registry=self.registry
        )
        for status in Status.SERVER:
            self.completed.labels(status=status)
        self.requests = Counter(
            "sandbox_http_requests", "HTTP requests received, by endpoint", ["endpoint"], registry=self.registry
        )
        self.latency = Histogram(
            "sandbox_latency_seconds", "Queue wait plus execution time of a call", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )  # fmt: skip

    def record(self, result: ToolResult, latency_s: float) -> None:
        """Count one answered call."""
        self.completed.labels(status=result.status).inc()
        self.latency.observe(latency_s)

    def count_rejected(self) -> None:
        """Count a call refused before it reached the queue."""
        self.completed.labels(status=Status.REJECTED).inc()

    def exposition(self) -> bytes:
        """The text format served on /metrics."""
        return generate_latest(self.registry)
