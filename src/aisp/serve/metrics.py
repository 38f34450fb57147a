"""Prometheus metrics of the model server (``GET /metrics``), in a registry of its own.

Request counts by protocol, model and code; request latency; rows per model call (batch size);
queued rows per model, read at scrape time. Label values are bounded: models come from the
repository, codes from the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from aisp.observe.metrics import BATCH_BUCKETS, LATENCY_BUCKETS_S, TextExposition
from aisp.serve.models import ModelServer

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
    """The server's metrics. ``batch_metric`` names the served models' batch-size histogram
    (default ``aisp_batch_size_rows``; a served pipeline exports that name per stage)."""

    def __init__(self, models: ModelServer | None, *, batch_metric: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self._text = TextExposition(self.registry)
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
        self.registry.register(_QueueCollector(models))
        if models is not None:
            batch_rows = Histogram(
                batch_metric or "aisp_batch_size_rows",
                "Rows per model call",
                ["model"],
                buckets=BATCH_BUCKETS,
                registry=self.registry,
            )
            models.on_batch = lambda model, rows: batch_rows.labels(model).observe(rows)

        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def observe(self, protocol: str, model: str, code: str, seconds: float) -> None:
        key = (protocol, model, code)
        child = self._children.get(key)
        if child is None:  # labels are bounded (see the module docstring): one lookup each
            child = self._children[key] = (
                self.requests.labels(protocol, model, code),
                self.latency.labels(protocol, model),
            )
        child[0].inc()
        child[1].observe(seconds)

    def render(self) -> bytes:
        return self._text.render()
