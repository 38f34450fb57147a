"""Readings of a Prometheus ``/metrics`` page and the window between two of them: counter
deltas, gauges, and histograms with quantiles interpolated inside buckets (as Prometheus'
``histogram_quantile``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "metrics_url"]

Labels = tuple[tuple[str, str], ...]


def metrics_url(url: str) -> str:
    """``http://host:port`` or ``.../metrics`` -> the ``/metrics`` address."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


class Scrape:
    """One reading of a ``/metrics`` page: every sample by name and labels.

    ``Scrape(text)`` parses a page; ``Scrape.of(registry)`` reads the same samples straight from
    a registry's collectors (in the process that owns them: no page written and parsed again,
    which cost the dashboard ~70 ms a second of the pipeline's GIL).
    """

    def __init__(self, text: str | None = None) -> None:
        self.samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._buckets: dict[tuple[str, Labels], list[tuple[str, float]]] | None = None
        if text is not None:
            self._add(text_string_to_metric_families(text))

    @classmethod
    def of(cls, registry: CollectorRegistry) -> Scrape:
        """The samples ``registry`` would expose now."""
        scrape = cls()
        scrape._add(registry.collect())
        return scrape

    def _add(self, families: Iterable[Metric]) -> None:
        for family in families:
            for s in family.samples:
                self.samples[s.name][tuple(sorted(s.labels.items()))] = float(s.value)

    def get(self, name: str, **labels: str) -> float:
        """The one sample of ``name`` with exactly ``labels`` (0 when absent)."""
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def series(self, name: str) -> dict[Labels, float]:
        return self.samples.get(name, {})

    def buckets(self, name: str, labels: Labels) -> list[tuple[str, float]]:
        """The ``le`` bounds and counts of histogram ``name`` (its ``_bucket`` series) with
        the other labels ``labels`` (sorted), indexed once per scrape."""
        if self._buckets is None:
            index: dict[tuple[str, Labels], list[tuple[str, float]]] = defaultdict(list)
            for series, samples in self.samples.items():
                if series.endswith("_bucket"):
                    for key, value in samples.items():
                        rest = tuple(kv for kv in key if kv[0] != "le")
                        index[(series[: -len("_bucket")], rest)].append((dict(key).get("le", ""), value))
            self._buckets = dict(index)
        return self._buckets.get((name, labels), [])


@dataclass
class _Hist:
    """A histogram over the window: bucket upper bounds with cumulative counts, count, sum."""

    bounds: list[tuple[float, float]]
    count: float
    sum: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else 0.0

    def quantile(self, q: float) -> float:
        """Linear interpolation inside the bucket (as Prometheus' ``histogram_quantile``)."""
        if self.count <= 0:
            return 0.0
        rank, lo, below = q * self.count, 0.0, 0.0
        for le, cum in self.bounds:
            if cum >= rank:
                if math.isinf(le):
                    return lo
                inside = cum - below
                return lo + (le - lo) * ((rank - below) / inside if inside > 0 else 1.0)
            lo, below = le, cum
        return lo


class _Window:
    """Deltas between two scrapes (or the cumulative values of one)."""

    def __init__(self, before: Scrape | None, after: Scrape) -> None:
        self.before, self.after = before, after

    def delta(self, name: str, **labels: str) -> float:
        now = self.after.get(name, **labels)
        return now - self.before.get(name, **labels) if self.before is not None else now

    def gauge(self, name: str, **labels: str) -> float:
        return self.after.get(name, **labels)

    def hist(self, name: str, **labels: str) -> _Hist:
        bounds = []
        for le, _ in self.after.buckets(name, tuple(sorted(labels.items()))):
            bounds.append((float(le), self.delta(name + "_bucket", **labels, le=le)))
        bounds.sort()
        return _Hist(bounds, self.delta(name + "_count", **labels), self.delta(name + "_sum", **labels))
