"""Retrieval confidence: the sliding window's verdicts and alerts, and the score counters."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.observe.retrieval import SCORE_BUCKETS, ConfidenceWindow, RetrievalConfidence, RetrievalCounters


def reference(verdicts: list[bool], cfg: RetrievalConfidence) -> tuple[list[int], list[float]]:
    """The windows that alert and every window's share, by brute force over the whole list."""
    alerts, shares, over, alerted = [], [], 0, False
    for end in range(cfg.hop, len(verdicts) + 1, cfg.hop):
        if end < cfg.window_queries:
            continue
        share = sum(verdicts[end - cfg.window_queries : end]) / cfg.window_queries
        shares.append(share)
        over = over + 1 if share > cfg.target_share else 0
        alerted = alerted and share > cfg.target_share
        if over >= cfg.consecutive and not alerted:
            alerted = True
            alerts.append(len(shares))
    return alerts, shares


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.data(),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    st.lists(st.tuples(st.integers(0, 60), st.floats(0.0, 1.0)), min_size=1, max_size=12),
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
)
def test_the_window_alerts_as_the_brute_force_does_however_queries_arrive(
    window: int, data: Any, consecutive: int, target: float, phases: list[tuple[int, float]], cuts: list[int]
) -> None:
    hop = data.draw(st.integers(1, window))
    cfg = RetrievalConfidence(
        window_queries=window, hop_queries=hop, consecutive=consecutive, target_share=target
    )
    rng = np.random.default_rng(len(phases))
    verdicts = [bool(v) for n, p in phases for v in rng.random(n) < p]  # the share shifts phase by phase
    raised: list[dict[str, Any]] = []
    counters = RetrievalCounters()
    w = ConfidenceWindow("index", cfg, counters, raised.append)
    at, i = 0, 0
    while at < len(verdicts):  # in batches of any size
        n = cuts[i % len(cuts)]
        w.observe(np.asarray(verdicts[at : at + n], dtype=bool))
        at, i = at + n, i + 1
    alerts, shares = reference(verdicts, cfg)
    assert [a["window"] for a in raised] == alerts
    assert w.windows == len(shares)
    assert counters.alerts == len(alerts)
    if shares:
        assert counters.share == pytest.approx(shares[-1])
    for a in raised:
        assert a["type"] == "retrieval_confidence" and a["stage"] == "index"
        assert a["share"] > target and a["windows"] >= consecutive


def test_a_steady_share_under_the_target_never_alerts_and_one_over_alerts_once() -> None:
    cfg = RetrievalConfidence(window_queries=100, target_share=0.2, consecutive=3)
    for share, expected in ((0.1, 0), (0.5, 1)):
        raised: list[dict[str, Any]] = []
        w = ConfidenceWindow("s", cfg, RetrievalCounters(), raised.append)
        verdicts = np.arange(10_000) % 100 < share * 100
        w.observe(verdicts)
        assert len(raised) == expected


def test_the_counters_bucket_scores_as_prometheus_does() -> None:
    c = RetrievalCounters()
    best = np.array([0.95, 0.5, -0.3, np.nan])
    topk = np.array([0.95, 0.9, 0.5, 0.45, -0.3, 1.0])
    c.add(best, topk, low=2)
    stats = c.stats()
    assert (stats["queries"], stats["low"]) == (4, 2)
    assert sum(stats["best"]["buckets"]) == 3  # the query with no hit has no best score
    edges = list(SCORE_BUCKETS)
    for values, got in ((best[~np.isnan(best)], stats["best"]["buckets"]), (topk, stats["topk"]["buckets"])):
        cumulative = np.cumsum(got)
        for i, le in enumerate(edges):
            assert cumulative[i] == sum(v <= le + 1e-9 for v in values)
        assert cumulative[-1] == len(values)
    assert stats["best"]["sum"] == pytest.approx(0.95 + 0.5 - 0.3)


@pytest.mark.parametrize(
    "settings_",
    [{"threshold": 1.5}, {"target_share": 1.0}, {"window_queries": 0}, {"consecutive": 0},
     {"window_queries": 10, "hop_queries": 11}],
)  # fmt: skip
def test_settings_that_cannot_work_fail_where_declared(settings_: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RetrievalConfidence(**settings_)


def test_a_running_pipelines_alert_reaches_a_redis_stream() -> None:
    """The executor connects the step's stream target when the run starts (as a drift alert's):
    the planted scenario's alert lands in Redis once."""
    import importlib.util
    import json
    import uuid
    from pathlib import Path

    import redis

    from aisp.runner import run

    path = (
        Path(__file__).resolve().parents[3] / "examples" / "diagnose" / "retrieval_confidence" / "pipeline.py"
    )
    spec = importlib.util.spec_from_file_location("retrieval_scenario", path)
    assert spec is not None and spec.loader is not None
    scenario = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scenario)
    stream = f"aisp-test-retrieval-{uuid.uuid4().hex[:8]}"
    p = scenario.build(events=5_000, alert=f"redis://127.0.0.1:6379/{stream}")
    r = redis.Redis()
    try:
        run(p)
        alerts = [json.loads(f[b"data"]) for _, f in r.xrange(stream)]
        assert len(alerts) == 1, alerts
        assert alerts[0]["type"] == "retrieval_confidence" and alerts[0]["stage"] == "index"
        assert alerts[0]["share"] > 0.2
    finally:
        r.delete(stream)
