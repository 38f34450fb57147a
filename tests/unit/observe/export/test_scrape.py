"""Scrape: a /metrics page parsed, or the same samples read straight from a registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aisp.observe.export.scrape import Scrape, _Window


class _Families:
    def __init__(self) -> None:
        self.n = 0

    def collect(self) -> Iterator[Any]:
        n = self.n
        h = HistogramMetricFamily("lat_seconds", "h", labels=["stage", "phase"])
        for stage in ("a", 'we"ird\\name'):
            for phase in ("queue", "compute"):
                h.add_metric([stage, phase], [("0.001", n), ("0.01", 2 * n), ("+Inf", 3 * n)], 0.5 * n)
        yield h
        c = CounterMetricFamily("rows", "c", labels=["stage"])
        c.add_metric(["a"], 10 * n)
        yield c
        g = GaugeMetricFamily("depth", "g")
        g.add_metric([], 7)
        yield g


def test_a_registry_reads_as_its_page_parses() -> None:
    fam = _Families()
    fam.n = 4
    registry = CollectorRegistry()
    registry.register(fam)
    direct, parsed = Scrape.of(registry), Scrape(generate_latest(registry).decode())
    assert dict(direct.samples) == dict(parsed.samples)
    assert direct.get("rows_total", stage="a") == 40.0 and direct.get("depth") == 7.0


def test_window_histograms_from_indexed_buckets() -> None:
    fam = _Families()
    registry = CollectorRegistry()
    registry.register(fam)
    fam.n = 1
    before = Scrape.of(registry)
    fam.n = 3
    after = Scrape.of(registry)
    w = _Window(before, after)
    h = w.hist("lat_seconds", stage='we"ird\\name', phase="compute")
    assert h.bounds == [(0.001, 2.0), (0.01, 4.0), (float("inf"), 6.0)]
    assert (h.count, h.sum) == (6.0, 1.0)
    assert w.hist("lat_seconds", stage="a").bounds == []  # labels must match exactly
    assert w.delta("rows_total", stage="a") == 20.0


def test_text_exposition_writes_what_generate_latest_writes() -> None:
    from prometheus_client import Counter, Gauge, Histogram, Info

    from aisp.observe.export.metrics import TextExposition

    registry = CollectorRegistry()
    fam = _Families()
    fam.n = 2
    registry.register(fam)
    requests = Counter("reqs", "Requests\nwith a \\ in the help", ["code"], registry=registry)
    requests.labels('4"0\n4').inc(3)
    Gauge("temp", "t", registry=registry).set(-1.5e-7)
    h = Histogram("lat", "l", ["m"], buckets=(0.1, 1.0), registry=registry)
    h.labels("x").observe(0.5)
    Info("build", "b", registry=registry).info({"version": "1"})
    text = TextExposition(registry)
    assert text.render() == generate_latest(registry)
    requests.labels("200").inc()  # a new series after the first scrape
    fam.n = 5
    assert text.render() == generate_latest(registry)
