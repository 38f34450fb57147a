from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.schedule.pacing import Pacer


def test_waits_for_linger_worth_of_arrivals_when_idle() -> None:
    p = Pacer(rate=10_000, linger_ms=1.0, start_ns=0)  # 10 rows per ms
    assert p.take(0, available=512) == (0, p.due_ns(9))
    assert p.take(p.due_ns(9), available=512) == (10, 0)


def test_emits_everything_due_when_behind_up_to_what_is_held() -> None:
    p = Pacer(rate=1000, linger_ms=1.0, start_ns=0)
    assert p.take(100_000_000, available=50) == (50, 0)


def test_rate_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="rate must be > 0"):
        Pacer(rate=0, linger_ms=1, start_ns=0)


@given(st.floats(1, 1e6), st.lists(st.integers(1, 600), min_size=1, max_size=30))
def test_due_times_follow_the_schedule_exactly(rate: float, takes: list[int]) -> None:
    p = Pacer(rate=rate, linger_ms=1.0, start_ns=1000)
    k = 0
    for n in takes:
        times = p.times(n)
        assert times.tolist() == [1000 + int(i * 1e9 / rate) for i in range(k, k + n)] or all(
            abs(a - (1000 + i * 1e9 / rate)) <= 1
            for a, i in zip(times.tolist(), range(k, k + n), strict=True)
        )
        k += n
    assert p.sent == k
