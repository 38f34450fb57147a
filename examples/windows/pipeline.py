"""Tumbling windows per user over event time, with allowed lateness (see README.md here).

    events {"id", "user", "ts", "amount"} (out of order)
      -> event time ``ts`` (ms), watermark = largest ts so far - 2 s
      -> key by user -> 10 s tumbling windows, allowed lateness 5 s
      -> {"user", "window_start", "window_end", "n", "sum", "max"}; late events -> dead letters

Run it: ``aisp run examples/windows/pipeline.py --input IN.jsonl --output OUT.jsonl
--dead-letter DL.jsonl`` (``python examples/windows/events.py IN.jsonl`` writes input).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Annotated

import msgspec

from aisp import Count, EventTime, Max, NullSink, Pipeline, Sum, TestingSource, Tumbling

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["user", "window_start", "window_end", "n", "sum", "max"]

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class Event(msgspec.Struct):
    """One event; decoding checks the types and that every field is there."""

    id: Int64
    user: str
    ts: Int64
    amount: float


def _events_module() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_window_events", HERE / "events.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


events_module = _events_module()


def build(events: int = 20_000, seed: int = 0) -> Pipeline:
    """The windows example; without ``--input`` it windows ``events`` generated events."""
    gen = events_module
    p = Pipeline("windows", output_columns=OUTPUT_COLUMNS)
    src = p.source(
        "events",
        TestingSource(gen.make_events(events, seed)),  # type: ignore[attr-defined]
        schema=Event,
        event_time=EventTime("ts", unit="ms", max_out_of_orderness_ms=gen.OUT_OF_ORDER_MS),  # type: ignore[attr-defined]
    )
    windows = src.key_by("by_user", "user").window(
        "per_user",
        Tumbling(gen.SIZE_MS),  # type: ignore[attr-defined]
        {"n": Count(), "sum": Sum("amount"), "max": Max("amount")},
        allowed_lateness_ms=gen.LATENESS_MS,  # type: ignore[attr-defined]
    )
    windows.sink("out", NullSink())
    return p
