"""Planted: a slow model. The scored model is an 18 -> 2048 -> 2048 -> 1 network (about 4M
multiply-adds per row, about 100x the fraud MLP): its calls dominate every event's time and
run past the step's 10 ms budget, although batches are well formed.

    aisp run examples/diagnose/slow_model/pipeline.py --rate 3500 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario import build_scenario, mlp_model  # noqa: E402

from aisp import BatcherConfig, NullSink, Pipeline  # noqa: E402

RATE = 3500


def build(events: int = 10_000_000) -> Pipeline:
    return build_scenario(
        "slow_model",
        events=int(events),
        sink=NullSink(),
        model=mlp_model(2048),
        batcher=BatcherConfig(max_batch_size=256, max_queue_delay_ms=0.5),
    )
