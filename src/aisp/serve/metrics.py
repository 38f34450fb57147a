"""Prometheus metrics of the model server (``GET /metrics``), in a registry of its own.

Request counts by protocol, model and code; request latency; rows per model call (batch size);
queued rows per model, read at scrape time. Label values are bounded: models come from the
repository, codes from the protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aisp.observe.export.metrics import BATCH_BUCKETS, LATENCY_BUCKETS_S, TextExposition, histogram_buckets
from aisp.observe.export.rollouts import rollout_families
from aisp.observe.latency import LatencyHistogram
from aisp.serve.models.server import ModelServer

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


class _RolloutCollector:
    """Each served model's rollout (``aisp.observe.export.rollouts``)."""

    def __init__(self, models: ModelServer | None) -> None:
        self._models = models

    def collect(self) -> Iterator[Any]:
        if self._models is not None:
            yield from rollout_families("aisp_rollout", "model", self._models.rollouts())


class ServerMetrics:
    """The server's metrics. ``batch_metric`` names the served models' batch-size histogram
    (default ``aisp_batch_size_rows``; a served pipeline exports that name per stage).

    Requests are recorded in one ``LatencyHistogram`` per protocol, model and code (a buffered
    array write per value, bucketed in bulk): the request counts are their counts, and the
    latency histogram of a protocol and model sums them, when scraped. Per request, the cost is
    a dictionary lookup and the histogram's own lock."""

    def __init__(self, models: ModelServer | None, *, batch_metric: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self._text = TextExposition(self.registry)
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], LatencyHistogram] = {}
        self._batches: dict[str, LatencyHistogram] = {}
        self._batch_metric = batch_metric or "aisp_batch_size_rows"
        self.registry.register(_QueueCollector(models))
        self.registry.register(_RolloutCollector(models))
        self.registry.register(_RequestCollector(self))
        if models is not None:
            models.on_batch = self._batched

    def observe(self, protocol: str, model: str, code: str, seconds: float) -> None:
        key = (protocol, model, code)
        hist = self._requests.get(key)
        if hist is None:
            with self._lock:
                hist = self._requests.setdefault(key, LatencyHistogram())
        hist.record_one(int(seconds * 1e9))

    def _batched(self, model: str, rows: int) -> None:
        hist = self._batches.get(model)
        if hist is None:
            with self._lock:
                hist = self._batches.setdefault(model, LatencyHistogram())
        hist.record_one(rows)

    def render(self) -> bytes:
        return self._text.render()


class _RequestCollector:
    """``aisp_requests_total{protocol,model,code}``, ``aisp_request_latency_seconds{protocol,model}``
    and the batch-size histogram ``{model}``, from ``ServerMetrics``' counters at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Any]:
        m = self._m
        with m._lock:
            requests, batches = dict(m._requests), dict(m._batches)
        counts = CounterMetricFamily(
            "aisp_requests", "Inference requests", labels=["protocol", "model", "code"]
        )
        latency: dict[tuple[str, str], tuple[list[Any], float]] = {}
        for (protocol, model, code), h in sorted(requests.items()):
            pairs, total = histogram_buckets(h, LATENCY_BUCKETS_S, 1e9)
            counts.add_metric([protocol, model, code], pairs[-1][1])  # the +Inf bucket: every request
            seen = latency.get((protocol, model))
            if seen is not None:  # every code's latencies in one histogram
                pairs = [(b, c + d) for (b, c), (_, d) in zip(pairs, seen[0], strict=True)]
                total += seen[1]
            latency[(protocol, model)] = (pairs, total)
        yield counts
        hist = HistogramMetricFamily(
            "aisp_request_latency_seconds",
            "Inference request latency, receipt to answer",
            labels=["protocol", "model"],
        )
        for (protocol, model), (pairs, total) in latency.items():
            hist.add_metric([protocol, model], pairs, total)
        yield hist
        sizes = HistogramMetricFamily(m._batch_metric, "Rows per model call", labels=["model"])
        for model, h in sorted(batches.items()):
            pairs, total = histogram_buckets(h, BATCH_BUCKETS, 1.0)
            sizes.add_metric([model], pairs, total)
        yield sizes
