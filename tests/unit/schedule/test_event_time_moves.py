"""Event time that moves on without rows (a partition given up or taken over, one idle past its
timeout) closes windows then, not only when the next rows come: a worker whose input is all read
still emits the windows a revoke or a takeover lets close."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from aisp import CollectSink, Count, EventTime, Pipeline, Tumbling
from aisp.batch import Batch
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.observe.stats import RunStats
from aisp.schedule.executor import LocalExecutor
from aisp.schedule.watermarks import SourceClocks
from aisp.sinks.deadletter import DeadLetterSink

ROWS = [  # (partition, key, event time): partition 1 is behind and holds the watermark back
    (1, "c", 1), (0, "a", 0), (0, "a", 5), (0, "b", 12), (0, "a", 25),
]  # fmt: skip


class _TwoPartitions(Source):
    """``ROWS`` in one batch, then empty reads (a caught-up broker) until told to stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    @staticmethod
    def partition_of(ids: np.ndarray) -> np.ndarray:
        return ids >> 32

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        stop, sent = self.stop, [False]

        class Part(SourcePartition):
            def next_batch(self, max_rows: int) -> Batch | None:
                if stop.is_set():
                    return None
                if sent[0]:
                    time.sleep(0.01)
                    return Batch.from_columns(
                        {"k": pa.array([], pa.string()), "t": np.array([], np.int64)},
                        ids=np.array([], np.int64),
                    )
                sent[0] = True
                ids = np.array([(p << 32) + i for i, (p, _, _) in enumerate(ROWS)], dtype=np.int64)
                cols = {"k": [k for _, k, _ in ROWS], "t": np.array([t for _, _, t in ROWS], np.int64)}
                return Batch.from_columns(cols, ids=ids)

        return Part()


def _windows(sink: CollectSink) -> list[tuple[str, int, int]]:
    return sorted((r["k"], r["window_start"], r["n"]) for r in sink.rows)


def test_windows_close_when_a_partition_that_held_them_back_is_given_up_without_new_rows() -> None:
    src, out = _TwoPartitions(), CollectSink()
    p = Pipeline("moves")
    s = p.source("src", src, event_time=EventTime("t"))
    s.key_by("by", "k").window("w", Tumbling(10), {"n": Count()}).sink("out", out)
    ex = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    ex.start()
    try:
        time.sleep(0.3)
        assert out.rows == []  # partition 1 (at 1) holds every window open
        ex.clocks.take_over(1, None)  # a revoke: what was read of it no longer holds time back
        deadline = time.monotonic() + 5
        while len(out.rows) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        # partition 0 alone is at 25: windows [0, 10) and [10, 20) close, [20, 30) stays open
        assert _windows(out) == [("a", 0, 2), ("b", 10, 1), ("c", 0, 1)]
    finally:
        src.stop.set()
        ex.join(10)
    assert _windows(out) == [("a", 0, 2), ("a", 20, 1), ("b", 10, 1), ("c", 0, 1)]  # the last at the end


def test_the_clocks_say_once_that_event_time_moved_without_rows() -> None:
    p = Pipeline("clocks")
    p.source("src", _TwoPartitions(), event_time=EventTime("t")).sink("out", CollectSink())
    sources = {n.step_id: n for n in p.build().nodes if n.kind == "source"}
    clocks = SourceClocks(sources)
    part = _TwoPartitions().open(SourceContext("src", lambda _: None, 100))
    batch = part.next_batch(100)
    assert batch is not None
    clocks.stamp("src", batch, RunStats(), DeadLetterSink().open())
    assert clocks.moved("src") is None  # the rows carried it
    clocks.take_over(1, None)
    assert clocks.moved("src") == 25
    assert clocks.moved("src") is None
    clocks.take_over(
        1, {"src": 3}
    )  # a partition that is behind taken over: time steps back, nothing to close
    assert clocks.moved("src") is None
