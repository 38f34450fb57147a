"""The anomaly control: AIMD on a settable clock (no sleeping), Retry-After with the load, idle
catch-up, and policies from untrusted settings (Hypothesis)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.admission.anomaly import AnomalyControl, AnomalyPolicy
from aisp.batch import Batch
from aisp.errors import ConfigError

POLICY = AnomalyPolicy(
    rate_events_per_s=200_000, window_s=60, step_s=1, max_events_per_s=150_000, score_column="score",
    max_score_share=0.05, consecutive=3, decrease=0.6, increase_events_per_s=10_000,
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def second(c: AnomalyControl, clock: Clock, events: int, high_share: float) -> None:
    """One second of traffic: ``events`` offered, scores with ``high_share`` above 0.92."""
    c.admit(events)
    high = int(events * high_share)
    c.observe_scores(np.r_[np.full(high, 0.99), np.full(events - high, 0.5)])
    clock.t += 1


def test_the_seed_scenario_lowers_200k_to_120k_and_recovers_additively() -> None:
    clock = Clock()
    c = AnomalyControl(POLICY, clock=clock)
    for _ in range(59):  # a quiet minute fills the window
        second(c, clock, 100_000, 0.01)
    assert c.status()["rate_events_per_s"] == 200_000
    rates = []
    for _ in range(120):  # a surge with anomalous scores: the 60 s window crosses 150k/s
        second(c, clock, 400_000, 0.5)
        rates.append(c.status()["rate_events_per_s"])
    assert 120_000 in rates and c.triggered >= 2
    assert rates.index(120_000) < 60  # the window average crosses 150k/s after ~20 s, +3 windows
    low = c.rate
    for _ in range(61):  # the anomaly ends: the window empties of it, then +10k/s a window
        second(c, clock, 100_000, 0.0)
    assert c.rate > low and c.status()["window"]["score_share"] == 0
    for _ in range(30):
        second(c, clock, 100_000, 0.0)
    assert c.rate == 200_000


def test_the_condition_needs_every_part_that_is_set() -> None:
    clock = Clock()
    c = AnomalyControl(POLICY, clock=clock)
    for _ in range(200):
        second(c, clock, 400_000, 0.01)  # a surge of normal scores
    assert c.triggered == 0
    c = AnomalyControl(POLICY, clock=clock)
    for _ in range(200):
        second(c, clock, 1000, 0.9)  # anomalous scores at low load
    assert c.triggered == 0


def test_retry_after_is_about_the_base_and_grows_with_the_load() -> None:
    clock = Clock()
    c = AnomalyControl(AnomalyPolicy(rate_events_per_s=1000, max_p99_ms=100, burst_s=1.0), clock=clock)
    assert c.retry_after_s() == pytest.approx(0.105)  # no load: -30%
    c.offered(100_000)
    assert c.retry_after_s() == pytest.approx(0.195)  # far over: +30%
    assert c.take(1000) == 0.0 and c.take(1000) > 0  # the bucket holds burst_s of the rate


def test_a_chunk_larger_than_the_bucket_is_admitted_once_the_bucket_is_full() -> None:
    clock = Clock()
    c = AnomalyControl(AnomalyPolicy(rate_events_per_s=100, max_p99_ms=100), clock=clock)
    assert c.take(5000) == 0.0  # charged a full bucket: never refused for ever
    assert c.take(5000) > 0


def test_latency_from_written_results_and_a_long_idle_gap() -> None:
    clock = Clock()
    policy = AnomalyPolicy(rate_events_per_s=1000, window_s=2, step_s=1, max_p99_ms=1, consecutive=1)
    c = AnomalyControl(policy, clock=clock)
    batch = Batch.from_columns({"x": [1, 2, 3]}, ingest_ns=1)  # written ~ now - 1 ns ago: very late
    c.observe(batch)
    clock.t = 1
    assert c.status()["window"]["latency_p99_ms"] > 1 and c.triggered == 1
    clock.t = 10_000  # hours idle: empty windows, each one an additive step up
    assert c.status()["rate_events_per_s"] == 1000


def test_a_policy_changes_at_run_time_within_its_new_bounds() -> None:
    c = AnomalyControl(POLICY)
    c.rate = 180_000
    policy = c.update({"rate_events_per_s": 100_000})
    assert policy.rate_events_per_s == 100_000 and c.rate == 100_000


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate_events_per_s": 0}, "rate_events_per_s must be a number > 0"),
        ({"decrease": 1.0}, "decrease must be in"),
        ({"max_score_share": 0.1, "score_column": None}, "needs score_column"),
        ({"max_events_per_s": 0, "max_score_share": 0, "score_column": None}, "at least one part"),
        ({"step_s": 120}, "step_s .* must be <= window_s"),
        ({"colour": "red"}, "unknown setting"),
        ({"window_s": "long"}, "anomaly policy"),
        ({"consecutive": 0}, "consecutive must be >= 1"),
        ({"min_rate_events_per_s": 200_001}, r"min_rate_events_per_s \(200001\) must be <= rate_"),
    ],
)
def test_bad_policies_fail_with_the_setting_named(changes: dict[str, Any], message: str) -> None:
    from dataclasses import asdict

    with pytest.raises(ConfigError, match=message):
        AnomalyPolicy.from_config({**asdict(POLICY), **changes})


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
KEYS = st.sampled_from([f.name for f in __import__("dataclasses").fields(AnomalyPolicy)] + ["x"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=6))
def test_settings_from_a_request_give_a_policy_or_a_config_error(changes: dict[str, Any]) -> None:
    c = AnomalyControl(POLICY)
    try:
        c.update(changes)
    except ConfigError:
        assert c.policy == POLICY  # a refused change leaves the policy alone
    else:
        assert c.policy.floor <= c.rate <= c.policy.rate_events_per_s


def test_a_run_reads_no_faster_than_the_controlled_rate_and_loses_nothing() -> None:
    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.admission.anomaly import control_run
    from aisp.schedule.executor import LocalExecutor
    from aisp.sinks.deadletter import DeadLetterSink

    p, out = Pipeline("scored"), CollectSink(columns=["id"])
    rows = [{"id": i, "score": 0.99} for i in range(3000)]
    p.source("src", TestingSource(rows, batch_rows=100)).sink("out", out)
    ex = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    policy = AnomalyPolicy(rate_events_per_s=6000, window_s=0.2, step_s=0.1, score_column="score",
                           max_score_share=0.5, consecutive=1, decrease=0.5)  # fmt: skip
    control = control_run(ex, p.build(), policy)
    ex.run()
    assert control.triggered >= 1 and control.rate < 6000  # anomalous scores lowered the rate
    assert sorted(r["id"] for r in out.rows) == list(range(3000))
