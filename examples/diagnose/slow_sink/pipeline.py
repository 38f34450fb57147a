"""Planted: a slow sink. Results go to a store that takes 15 ms per write (a remote database
across a slow link; here the wait is all the store does, so the pipeline's CPU stays idle):
the sink's thread spends its time waiting, and rows back up behind it.

    aisp run examples/diagnose/slow_sink/pipeline.py --rate 20000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from scenario import build_scenario  # noqa: E402

from aisp import Batch, Pipeline  # noqa: E402
from aisp.sinks.base import Sink, SinkPartition  # noqa: E402

RATE = 20_000


@dataclass(frozen=True)
class SlowStoreSink(Sink):
    """Each write waits ``write_ms`` for the store's acknowledgement."""

    write_ms: float = 15.0

    def open(self) -> SinkPartition:
        return _SlowStore(self.write_ms / 1000)

    def describe(self) -> str:
        return f"slow-store({self.write_ms} ms per write)"


class _SlowStore(SinkPartition):
    def __init__(self, write_s: float) -> None:
        self.write_s = write_s
        self.rows = 0

    def write(self, batch: Batch) -> None:
        time.sleep(self.write_s)
        self.rows += batch.num_rows


def build(events: int = 10_000_000, write_ms: float = 15.0) -> Pipeline:
    return build_scenario("slow_sink", events=int(events), sink=SlowStoreSink(write_ms=float(write_ms)))
