"""Planted: admission overload. Events arrive faster than the model can score them: an
18 -> 2048 -> 2048 -> 1 network (its rows cost many times what the rest of the pipeline spends
on one, on any CPU, so the model and not the ingest is what cannot keep up) in calls of 64 rows
that stay well within the step's budget, behind a bounded queue that sheds what does not fit
(``overload="shed"``). Every stage works as configured; the offered load is the problem, and a
share of the events is turned away.

    aisp run examples/diagnose/admission_overload/pipeline.py --rate 60000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario import build_scenario, mlp_model  # noqa: E402

from aisp import BatcherConfig, NullSink, Pipeline  # noqa: E402

RATE = 60_000


def build(events: int = 10_000_000) -> Pipeline:
    return build_scenario(
        "admission_overload",
        events=int(events),
        sink=NullSink(),
        model=mlp_model(2048),
        model_budget_ms=50.0,
        batcher=BatcherConfig(max_batch_size=64, max_queue_delay_ms=1.0, capacity_rows=1024, overload="shed"),
    )
