"""Planted: a per-row Python function. Before the model, ``enrich`` turns each event into a
dict, loops over its 16 features in Python and builds a new row: tens of microseconds per
row, all of it holding the GIL, where a vectorised map_batch would take well under one. At
30,000 events/s its thread is near saturation (at 20,000 a 2-vCPU AMD EPYC VM sits at the edge,
about 80% busy).

    aisp run examples/diagnose/row_udf/pipeline.py --rate 30000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math  # noqa: E402
from typing import Any  # noqa: E402

from scenario import build_scenario  # noqa: E402

from aisp import NullSink, Pipeline  # noqa: E402
from aisp.pipeline import Stream  # noqa: E402

RATE = 30_000


def enrich(row: dict[str, Any]) -> dict[str, Any]:
    """Standardise the features within the event, squash them and scale them by the user's
    running mean: Python loops over 16 numbers, one row at a time."""
    f = row["f"]
    mean = sum(f) / len(f)
    std = math.sqrt(sum((v - mean) ** 2 for v in f) / len(f)) or 1.0
    scale = math.log1p(abs(row["mean_amount"]))
    row["f"] = [math.tanh((v - mean) / std) * scale for v in f]
    return row


def build(events: int = 10_000_000) -> Pipeline:
    def add_udf(stream: Stream) -> Stream:
        return stream.map("enrich", enrich)

    return build_scenario("row_udf", events=int(events), sink=NullSink(), before_model=add_udf)
