"""Planted: batches that wait for rows that do not come. The model step is told to wait up to
50 ms for a batch of up to 4,096 rows, and not to take what is queued when idle
(``eager=False``): at 2,000 events/s a batch holds about a hundred rows when its time is up, and
every event waits about 25 ms in the batcher for a model call that takes well under one.
``aisp diagnose`` names ``slow_batch_fill`` and says to lower ``max_queue_delay_ms``.

    aisp run examples/diagnose/slow_batch_fill/pipeline.py --rate 2000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario import build_scenario  # noqa: E402

from aisp import BatcherConfig, NullSink, Pipeline  # noqa: E402

RATE = 2000


def build(events: int = 10_000_000) -> Pipeline:
    return build_scenario(
        "slow_batch_fill",
        events=int(events),
        sink=NullSink(),
        batcher=BatcherConfig(max_batch_size=4096, max_queue_delay_ms=50.0, eager=False),
    )
