"""Prometheus metrics of the model server (``GET /metrics``), in a registry of its own.

Request counts by protocol, model and code; request latency; rows per model call (batch size);
queued rows per model, read at scrape time. Label values are bounded: models come from the
repository, codes from the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from aisp.serve.models import ModelServer

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _QueueCollector:
    def __init__(self, models: ModelServer | None) -> None:
        self._models = models

    def collect(self) -> Iterator[Any]:
        if self._models is None:
            return
        g = GaugeMetricFamily(
            "aisp_model_queue_rows", "Rows waiting in the model's batcher queue", labels=["model"]
        )
        for name, rows in self._models.queue_rows().items():
            g.add_metric([name], rows)
        yield g


class ServerMetrics:
    def __init__(self, models: ModelServer | None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aisp_requests", "Inference requests", ["protocol", "model", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "aisp_request_latency_seconds",
            "Inference request latency, receipt to answer",
            ["protocol", "model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.batch_rows = Histogram(
            "aisp_batch_size_rows",
            "Rows per model call",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_QueueCollector(models))
        if models is not None:
            models.on_batch = lambda model, rows: self.batch_rows.labels(model).observe(rows)

    def observe(self, protocol: str, model: str, code: str, seconds: float) -> None:
        self.requests.labels(protocol, model, code).inc()
        self.latency.labels(protocol, model).observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
