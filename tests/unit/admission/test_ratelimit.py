from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.admission.ratelimit import Limiter, RateLimits, TokenBucket
from aisp.errors import ConfigError


def test_bucket_refills_at_its_rate_and_caps_at_burst() -> None:
    now = [0.0]
    b = TokenBucket(rate_per_s=100, burst=10, clock=lambda: now[0])
    assert b.take(10) == 0.0 and b.take(1) == pytest.approx(0.01)
    now[0] = 10.0  # long idle: never more than the burst
    assert b.take(10) == 0.0 and b.take(1) > 0


@given(st.lists(st.tuples(st.floats(0, 0.05), st.integers(1, 20)), max_size=60))
def test_granted_never_exceeds_burst_plus_rate_times_time(steps: list[tuple[float, int]]) -> None:
    now = [0.0]
    b = TokenBucket(rate_per_s=200, burst=20, clock=lambda: now[0])
    granted = 0
    for dt, n in steps:
        now[0] += dt
        if b.take(n) == 0.0:
            granted += n
    assert granted <= 20 + 200 * now[0] + 1e-6


def test_limiter_per_key_and_per_tier() -> None:
    now = [0.0]
    lim = Limiter(RateLimits(per_key_rps=10, per_tier_rps={0: 5}, burst_s=1.0), clock=lambda: now[0])
    assert lim.admit("alice", 2, 10) == 0.0 and lim.admit("alice", 2, 1) > 0
    assert lim.admit("bob", 2, 10) == 0.0  # keys are independent
    assert lim.admit("carol", 0, 5) == 0.0 and lim.admit("dave", 0, 1) > 0  # the bronze tier is shared
    assert Limiter.retry_after(0.2) == "1" and Limiter.retry_after(2.5) == "3"


def test_config_names_tiers() -> None:
    tiers = {"bronze": 0, "silver": 1, "gold": 2}
    limits = RateLimits.from_config({"per_key_rps": 100, "tiers": {"bronze": 10}}, tiers)
    assert limits.per_tier_rps == {0: 10.0} and limits.enabled
    with pytest.raises(ConfigError, match="unknown tier 'platinum'"):
        RateLimits.from_config({"tiers": {"platinum": 1}}, tiers)
