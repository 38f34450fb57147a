"""The load generator's rules: load specs, SLO verdicts, the automatic sweep, the reports."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from pathlib import Path

import pytest

from aisp.bench import LoadSpec, PointResult, Sweep, plot_html, run_point, sweep, workload_lines, write_report
from aisp.errors import ConfigError


class Saturating:
    """A target that answers in 2 ms while requests arrive at up to ``capacity`` a second, and
    ever slower above (a queue that grows), judged by the arrivals of the last 0.1 s: enough
    for the sweep to find the knee."""

    name = "saturating"

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.arrivals: deque[float] = deque()

    async def open(self) -> None:
        self.arrivals.clear()

    async def send(self, body: bytes, events: int) -> tuple[int, Counter[str]]:
        now = time.monotonic()
        self.arrivals.append(now)
        while self.arrivals[0] < now - 0.1:
            self.arrivals.popleft()
        rate = len(self.arrivals) / 0.1
        await asyncio.sleep(0.002 if rate <= self.capacity else 0.002 + 0.2 * (rate / self.capacity - 1))
        return events, Counter()

    async def close(self) -> None:
        return None


def test_a_spec_is_open_or_closed_loop() -> None:
    assert LoadSpec(rate=100).mode == "open"
    assert LoadSpec(concurrency=4).mode == "closed"
    with pytest.raises(ConfigError, match="not both"):
        LoadSpec(rate=100, concurrency=4)
    with pytest.raises(ConfigError, match="not both"):
        LoadSpec()


def point(p99: float, errors: int = 0, achieved: float = 1000.0) -> PointResult:
    lat = {"p50": 1.0, "p90": 2.0, "p99": p99, "p999": p99, "max": p99, "mean": 1.0}
    return PointResult("open", 1000.0, 0, 1.0, 1000, 1000 - errors, achieved, lat, 50.0, 1.0, {"x": errors})


def test_meeting_the_slo_needs_p99_errors_and_the_offered_rate() -> None:
    assert point(40).meets_slo()
    assert not point(60).meets_slo()
    assert not point(40, errors=5).meets_slo()  # 0.5% errors
    assert not point(40, achieved=900).meets_slo()  # fell behind the offered rate


def test_open_loop_measures_from_the_schedule_and_the_auto_sweep_finds_the_knee(tmp_path: Path) -> None:
    target = Saturating(capacity=400)
    lines = workload_lines(64)
    spec = LoadSpec(rate=100, duration_s=0.4, warmup_s=0.1, slo_ms=50)
    p = run_point(target, spec, lines=lines)
    assert 35 <= p.events_sent <= 45 and p.errors == {}
    assert 1.5 <= p.latency_ms["p50"] <= 20
    result = sweep(target, "saturating", spec, refine=2, lines=lines)
    rates = [q.offered_rate for q in result.points]
    assert rates[:4] == [100, 200, 400, 800]  # doubling until the SLO fails
    assert result.best is not None and 400 <= result.best.offered_rate < 800
    write_report(result, tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["best_rate"] == result.best.offered_rate
    assert [q["offered_rate"] for q in report["points"]] == sorted(rates)
    plot_html(result, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert page.count("<polyline") == 4 and "SLO 50 ms" in page


def test_closed_loop_keeps_the_concurrency() -> None:
    target = Saturating(capacity=1e9)
    p = run_point(target, LoadSpec(concurrency=3, duration_s=0.3, warmup_s=0.0), lines=workload_lines(16))
    assert p.mode == "closed" and p.concurrency == 3
    # three requests in flight, about 2 ms each: about 1,500 a second
    assert 200 <= p.achieved_rate <= 2000


def test_workload_lines_are_fraud_events_or_a_file_cycled(tmp_path: Path) -> None:
    lines = workload_lines(5)
    assert len(lines) == 5 and set(json.loads(lines[0])) == {"id", "user", "amount", "ts", "f"}
    (tmp_path / "in.jsonl").write_bytes(b'{"a": 1}\n{"a": 2}\n')
    assert workload_lines(3, str(tmp_path / "in.jsonl")) == [b'{"a": 1}', b'{"a": 2}', b'{"a": 1}']
    empty = Sweep("x", LoadSpec(rate=1))
    assert empty.best is None
