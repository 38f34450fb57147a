"""RunStats' latency trail: a point a second of end-to-end percentiles, whoever watches."""

from __future__ import annotations

import numpy as np

from aisp.observe.latency import LatencyHistogram
from aisp.observe.stats import LatencyTrail, RunStats

S = 1_000_000_000


def test_a_point_per_second_with_events_and_only_that_second_in_it() -> None:
    e2e = LatencyHistogram()
    trail = LatencyTrail(e2e, keep_s=3)
    e2e.record(np.full(100, 2_000_000))  # 2 ms
    trail.tick(10 * S)  # the first tick: everything so far
    trail.tick(10 * S + S // 2)  # not due
    e2e.record(np.full(100, 40_000_000))  # 40 ms, in the next second only
    trail.tick(11 * S)
    trail.tick(12 * S)  # a second without events: no point
    points = trail.points(started_ns=9 * S)
    assert [(p["t"], p["count"]) for p in points] == [(1.0, 100), (2.0, 100)]
    assert abs(points[0]["p99"] - 2.0) < 0.05 and abs(points[1]["p50"] - 40.0) < 0.5
    for k in range(13, 20):  # only the last keep_s points stay
        e2e.record(np.full(10, 1_000_000))
        trail.tick(k * S)
    assert [p["t"] for p in trail.points(started_ns=0)] == [17.0, 18.0, 19.0]


def test_run_stats_carry_a_trail_over_their_e2e_histogram() -> None:
    stats = RunStats()
    stats.e2e.record(np.array([5_000_000]))
    stats.trail.tick(stats.started_ns + S)
    (point,) = stats.trail.points(stats.started_ns)
    assert point["t"] == 1.0 and point["count"] == 1
