"""The adaptive batching tuner, driven by a synthetic model of batch cost and an injected clock."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from aisp.batch import Batch
from aisp.infer import AdaptiveConfig, AdaptiveTuner, BatcherConfig, DynamicBatcher, PythonRuntime
from aisp.infer.batching.adaptive import Setting, weighted_p99

CFG = AdaptiveConfig(
    p99_target_ms=10.0, batch_sizes=(16, 64, 256), delays_ms=(0.0, 2.0), trial_s=0.1, trial_batches=5
)


def simulate(setting: Setting, offered_rows_per_s: float) -> tuple[int, int, float]:
    """(rows per batch, latency ns, batches per s) for a model costing 1 ms + 10 us per row."""
    cost_s = lambda rows: 0.001 + 0.00001 * rows  # noqa: E731
    capacity = setting.max_batch_size / cost_s(setting.max_batch_size)
    rate = min(offered_rows_per_s, capacity)
    rows = max(1, min(setting.max_batch_size, int(rate * (cost_s(1) + setting.max_queue_delay_ms / 1000))))
    latency_s = (
        cost_s(rows) + setting.max_queue_delay_ms / 1000 + (0.05 if offered_rows_per_s > capacity else 0)
    )
    return rows, int(latency_s * 1e9), rate / rows


def drive(tuner: AdaptiveTuner, offered: float, now: int, steps: int) -> int:
    for _ in range(steps):
        rows, latency, per_s = simulate(tuner.current, offered)
        dt = 1e9 / per_s
        now += int(dt)
        tuner.arrived(int(offered * dt / 1e9))
        tuner.observe(now, rows, latency)
    return now


def test_explores_every_candidate_then_settles_on_the_best_that_meets_the_target() -> None:
    tuner = AdaptiveTuner(CFG, max_batch_size=256, now_ns=0)
    assert len(tuner.candidates) == 6 and tuner.exploring
    drive(tuner, offered=60_000, now=0, steps=2000)
    assert not tuner.exploring and tuner.decisions == 1
    # 60k rows/s: batches of 16 saturate (~14.5k rows/s); 64 and 256 keep up; eager beats a 2 ms wait
    assert tuner.current in (Setting(64, 0.0), Setting(256, 0.0))
    front = tuner.front()
    assert front and all(r.p99_ms <= front[-1].p99_ms or r.rows_per_s >= front[-1].rows_per_s for r in front)


def test_when_nothing_meets_the_target_the_lowest_p99_wins(caplog: pytest.LogCaptureFixture) -> None:
    cfg = AdaptiveConfig(
        p99_target_ms=0.5, batch_sizes=(16, 64), delays_ms=(0.0, 2.0), trial_s=0.1, trial_batches=5
    )
    tuner = AdaptiveTuner(cfg, max_batch_size=64, now_ns=0)
    with caplog.at_level(logging.INFO, logger="aisp.adaptive"):
        drive(tuner, offered=5_000, now=0, steps=2000)
    assert not tuner.exploring
    assert tuner.current.max_queue_delay_ms == 0.0
    assert "no setting meets it" in caplog.text and "adaptive batching: max_batch_size=" in caplog.text


def test_retunes_when_the_load_changes() -> None:
    tuner = AdaptiveTuner(CFG, max_batch_size=256, now_ns=0)
    now = drive(tuner, offered=60_000, now=0, steps=2000)
    assert tuner.decisions == 1
    now = drive(tuner, offered=2_000, now=now, steps=3000)  # load dropped 30x: explore again
    assert tuner.decisions >= 2


def test_weighted_p99_counts_rows() -> None:
    assert weighted_p99([1_000_000, 50_000_000], [999, 1]) == 1.0
    assert weighted_p99([1_000_000, 50_000_000], [10, 990]) == 50.0


def test_batcher_in_adaptive_mode_tunes_and_reports() -> None:
    now = [0]

    def clock() -> int:
        return now[0]

    def model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        now[0] += 1_000_000 + 10_000 * len(inputs["x"])  # the injected clock advances with the work
        return {"y": inputs["x"]}

    rt = PythonRuntime(model, input_names=("x",), output_names=("y",), name="m")
    fast = AdaptiveConfig(p99_target_ms=10.0, batch_sizes=(16, 64, 256), delays_ms=(0.0, 2.0), trial_s=0.02)
    cfg = BatcherConfig(max_batch_size=256, capacity_rows=32_768, adaptive=fast)
    out: list[int] = []
    batcher = DynamicBatcher(
        rt,
        cfg,
        prepare=lambda b: {"x": b.numpy("x")},
        finish=lambda b, o, r: b,
        emit=lambda b: out.append(b.num_rows),
        dead_letter=lambda b, r: None,
        clock=clock,
    )
    for _ in range(400):
        batcher.submit(Batch.from_columns({"x": np.zeros((50, 1), np.float32)}, ingest_ns=0))
    batcher.close()  # never started: close() dispatches everything on this thread
    state = batcher.batching()
    assert sum(out) == 400 * 50 and state["adaptive"] is True
    assert state["decisions"] >= 1 and state["front"]
