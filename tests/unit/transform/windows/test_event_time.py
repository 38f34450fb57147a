"""Watermarks per partition against a sequential reference, idle partitions, event time units."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.transform.windows.event_time import NO_WATERMARK, EventTime, WatermarkGenerator


def reference(rows: list[tuple[int, int]], delay: int) -> list[int]:
    """Before each (partition, time) row: the minimum over partitions seen of their largest time."""
    newest: dict[int, int] = {}
    out = []
    for p, t in rows:
        out.append(min(newest.values()) - delay if newest else NO_WATERMARK)
        newest[p] = max(newest.get(p, t), t)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(-1000, 1000)), max_size=60),
    st.integers(0, 100),
    st.lists(st.integers(0, 60), max_size=5),
)
def test_watermarks_agree_with_the_sequential_reference_whatever_the_batches(
    rows: list[tuple[int, int]], delay: int, cuts: list[int]
) -> None:
    gen = WatermarkGenerator(EventTime("ts", max_out_of_orderness_ms=delay))
    got: list[int] = []
    bounds = sorted({0, len(rows), *(min(c, len(rows)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = rows[a:b]
        parts = np.array([p for p, _ in part], dtype=np.int64)
        times = np.array([t for _, t in part], dtype=np.int64)
        got += gen.watermarks(times, parts, now_ns=0).tolist()
    assert got == reference(rows, delay)


def test_an_idle_partition_stops_holding_the_watermark_back() -> None:
    gen = WatermarkGenerator(EventTime("ts", idle_timeout_ms=1_000))
    gen.watermarks(np.array([100, 5_000]), np.array([0, 1]), now_ns=0)
    held = gen.watermarks(np.array([6_000]), np.array([1]), now_ns=500_000_000)  # partition 0: 0.5 s idle
    assert held.tolist() == [100]
    freed = gen.watermarks(np.array([7_000, 7_001]), np.array([1, 1]), now_ns=2_000_000_000)  # 2 s idle
    assert freed.tolist() == [6_000, 7_000]


def test_a_checkpointed_generator_continues_where_it_stopped() -> None:
    gen = WatermarkGenerator(EventTime("ts", max_out_of_orderness_ms=10))
    gen.watermarks(np.array([50, 70]), np.array([0, 1]), now_ns=0)
    again = WatermarkGenerator(EventTime("ts", max_out_of_orderness_ms=10))
    again.restore(gen.snapshot())
    assert again.watermarks(np.array([60]), np.array([0]), now_ns=0).tolist() == [40]


@pytest.mark.parametrize(
    ("unit", "column", "expected", "ok"),
    [
        ("s", pa.array([1.5, None, float("nan"), 2.0]), [1500, 0, 0, 2000], [True, False, False, True]),
        ("us", pa.array([1_999, -1_001], pa.int64()), [1, -2], [True, True]),
        ("ms", pa.array([1, 2], pa.timestamp("s")), [1000, 2000], [True, True]),
        ("ms", pa.array(["x", "y"]), [0, 0], [False, False]),
        ("ns", pa.nulls(2), [0, 0], [False, False]),
    ],
)
def test_event_time_columns_in_every_unit(
    unit: str, column: Any, expected: list[int], ok: list[bool]
) -> None:
    ms, valid = EventTime("ts", unit=unit).event_ms(column)
    assert (ms.tolist(), valid.tolist()) == (expected, ok)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unit": "h"}, "unit must be one of"),
        ({"max_out_of_orderness_ms": -1}, ">= 0"),
        ({"idle_timeout_ms": -2}, ">= 0"),
    ],
)
def test_bad_event_time_settings_fail_where_declared(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EventTime("ts", **kwargs)
