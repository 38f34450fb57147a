"""Planted: a slow model. The scored model is an 18 -> 2048 -> 2048 -> 1 network (about 4M
multiply-adds per row, about 100x the fraud MLP): at 7,000 events/s its calls keep the step's
thread near saturation and dominate every event's time, and the pipeline misses its latency
target, although batches are well formed. (At 3,500 events/s a 2-vCPU AMD EPYC VM keeps up
within the target, about 200 us a row: then the diagnosis is rightly ``healthy``.)

    aisp run examples/diagnose/slow_model/pipeline.py --rate 7000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario import build_scenario, mlp_model  # noqa: E402

from aisp import BatcherConfig, NullSink, Pipeline  # noqa: E402

RATE = 7000


def build(events: int = 10_000_000) -> Pipeline:
    return build_scenario(
        "slow_model",
        events=int(events),
        sink=NullSink(),
        model=mlp_model(2048),
        batcher=BatcherConfig(max_batch_size=256, max_queue_delay_ms=0.5),
    )
