"""Planted: a model held to tiny batches. The fraud MLP is cheap per row, but its batcher
allows one row per call, so each row pays a whole call's fixed cost and rows queue for the
model although it has room to score hundreds per call.

    aisp run examples/diagnose/small_batches/pipeline.py --rate 20000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario import build_scenario  # noqa: E402

from aisp import BatcherConfig, NullSink, Pipeline  # noqa: E402

RATE = 20_000


def build(events: int = 10_000_000) -> Pipeline:
    return build_scenario(
        "small_batches",
        events=int(events),
        sink=NullSink(),
        batcher=BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, capacity_rows=1024),
    )
