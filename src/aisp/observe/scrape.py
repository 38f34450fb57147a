"""Readings of a Prometheus ``/metrics`` page and the window between two of them: counter
deltas, gauges, and histograms with quantiles interpolated inside buckets (as Prometheus'
``histogram_quantile``)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "metrics_url"]

Labels = tuple[tuple[str, str], ...]


def metrics_url(url: str) -> str:
    """``http://host:port`` or ``.../metrics`` -> the ``/metrics`` address."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


class Scrape:
    """One reading of a ``/metrics`` page: every sample by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[s.name][tuple(sorted(s.labels.items()))] = float(s.value)

    def get(self, name: str, **labels: str) -> float:
        """The one sample of ``name`` with exactly ``labels`` (0 when absent)."""
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def series(self, name: str) -> dict[Labels, float]:
        return self.samples.get(name, {})


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
        want = set(labels.items())
        for key in self.after.series(name + "_bucket"):
            d = dict(key)
            if set(d.items()) - {("le", d.get("le", ""))} == want:
                le = d["le"]
                bounds.append((float(le), self.delta(name + "_bucket", **labels, le=le)))
        bounds.sort()
        return _Hist(bounds, self.delta(name + "_count", **labels), self.delta(name + "_sum", **labels))
