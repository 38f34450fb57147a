from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aisp.observe.latency import LatencyHistogram


@given(st.lists(st.integers(1, 10**11), min_size=1, max_size=300), st.sampled_from([50, 90, 99, 99.9]))
def test_percentiles_within_one_percent(values: list[int], q: float) -> None:
    h = LatencyHistogram()
    h.record(np.array(values, dtype=np.int64))
    arr = np.sort(np.array(values))
    exact = arr[max(0, int(np.ceil(len(arr) * q / 100)) - 1)]
    assert abs(h.percentile(q) - exact) <= 0.01 * exact + 1
    assert h.percentile(100) == arr[-1]
    assert h.count == len(values)


def test_merge_and_summary() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.record(np.full(99, 1_000_000))
    b.record(np.array([50_000_000]))
    a.merge(b)
    s = a.summary_ms()
    assert s["max"] == 50.0 and abs(s["p50"] - 1.0) < 0.01 and a.count == 100
