"""Interval joins against a sequential reference: random out-of-order rows on both sides,
watermarks, batch splits (Hypothesis), a checkpoint midway, and the join in a pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp import CollectSink, EventTime, Pipeline, TestingSource
from aisp.batch import EVENT_TIME, WATERMARK, Batch
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.joins import SIDE, IntervalJoinSpec
from aisp.transform.operators import OperatorContext
from aisp.transform.windows.event_time import NO_WATERMARK, WatermarkGenerator
from aisp.transform.windows.event_time import EventTime as Et

Row = tuple[int, str, int, int, int]  # side, key, event time, watermark before it, id


def reference(rows: Sequence[Row], lower: int, upper: int) -> tuple[set[tuple[int, int]], list[int]]:
    """One row at a time: (pairs of (left id, right id), ids of late rows). A row's watermark
    is the lower of the two sides' newest (each side's stamps so far, this row's included)."""
    seen: list[Row] = []
    pairs, late = set(), []
    newest = [NO_WATERMARK, NO_WATERMARK]
    for side, key, t, wm, eid in rows:
        newest[side] = max(newest[side], wm)
        if t < min(newest):
            late.append(eid)
            continue
        for s2, k2, t2, _, e2 in seen:
            if s2 == side or k2 != key:
                continue
            (tl, el), (tr, er) = ((t, eid), (t2, e2)) if side == 0 else ((t2, e2), (t, eid))
            if tl + lower <= tr <= tl + upper:
                pairs.add((el, er))
        seen.append((side, key, t, wm, eid))
    return pairs, late


class Harness:
    def __init__(self, lower: int, upper: int, index: KeyIndex | None = None) -> None:
        self.dead: list[Batch] = []
        spec = IntervalJoinSpec(column="k", right_column="k", lower_ms=lower, upper_ms=upper, space="j")
        ctx = OperatorContext("j", lambda b, step, reason, fields=None: self.dead.append(b),
                              {"j": index or KeyIndex()})  # fmt: skip
        self.op = spec.build(ctx)
        self.pairs: list[tuple[int, int]] = []

    def feed(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        side, keys, t, wm, ids = (list(c) for c in zip(*rows, strict=True))
        batch = Batch.from_columns(
            {"k": keys, "eid": np.array(ids, dtype=np.int64), EVENT_TIME: np.array(t, dtype=np.int64),
             WATERMARK: np.array(wm, dtype=np.int64), SIDE: np.array(side, dtype=np.int8)},
            ids=np.array(ids, dtype=np.int64),
        )  # fmt: skip
        for _, out in self.op.process(batch):
            self.pairs += list(zip(out.pylist("eid"), out.pylist("right_eid"), strict=True))
            assert out.pylist("k") == out.pylist("right_k")

    def late(self) -> list[int]:
        assert all(SIDE not in b and "eid" in b for b in self.dead)  # the row as it came in
        return sorted(i for b in self.dead for i in b.ids.tolist())


@st.composite
def scenarios(draw: Any) -> tuple[list[Row], int, int, list[int]]:
    n = draw(st.integers(0, 60))
    sides = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n))
    times = draw(st.lists(st.integers(0, 120), min_size=n, max_size=n))
    gen = WatermarkGenerator(Et("t", max_out_of_orderness_ms=draw(st.integers(0, 40))))
    wm = gen.watermarks(np.array(times, dtype=np.int64), None, now_ns=0).tolist()
    rows = [(s, k, t, w, i) for i, (s, k, t, w) in enumerate(zip(sides, keys, times, wm, strict=True))]
    lower = draw(st.integers(-25, 25))
    upper = draw(st.integers(lower, lower + 30))
    return rows, lower, upper, sorted(draw(st.lists(st.integers(0, n), max_size=5)))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_join_agrees_with_the_sequential_reference(scenario: Any) -> None:
    rows, lower, upper, cuts = scenario
    pairs, late = reference(rows, lower, upper)
    h = Harness(lower, upper)
    for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True):
        h.feed(rows[a:b])
    assert sorted(h.pairs) == sorted(pairs)  # each pair once
    assert h.late() == sorted(late)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_a_checkpoint_midway_restores_to_the_same_pairs(scenario: Any, data: Any) -> None:
    rows, lower, upper, _ = scenario
    pairs, late = reference(rows, lower, upper)
    at = data.draw(st.integers(0, len(rows)))
    first = Harness(lower, upper)
    first.feed(rows[:at])
    table = pa.table(first.op.snapshot())  # as a checkpoint stores it
    index = KeyIndex()  # a new process: keys come back in another order
    index.encode(pa.array(["c", "b", "a"]))
    second = Harness(lower, upper, index)
    second.op.restore({c: table.column(c).to_numpy() for c in table.column_names})
    second.feed(rows[at:])
    assert sorted(first.pairs + second.pairs) == sorted(pairs)
    assert sorted(first.late() + second.late()) == sorted(late)


def test_the_join_in_a_pipeline_keys_its_output_and_checks_its_settings() -> None:
    p = Pipeline("j")
    clicks = [{"user": u, "ts": t, "ad": a} for u, t, a in (("a", 100, 1), ("b", 105, 2), ("a", 400, 3))]
    buys = [
        {"buyer": u, "ts": t, "amount": x} for u, t, x in (("b", 90, 1.0), ("a", 150, 9.0), ("a", 900, 5.0))
    ]
    # the two sources run in their own threads: whichever comes first, nothing is late
    left = p.source("clicks", TestingSource(clicks), event_time=EventTime("ts")).key_by("by_user", "user")
    right = p.source("buys", TestingSource(buys), event_time=EventTime("ts")).key_by("by_buyer", "buyer")
    out = CollectSink(columns=["user", "ad", "right_buyer", "right_amount"])
    left.interval_join("bought", right, lower_ms=0, upper_ms=200).sink("out", out)
    summary = p.run()
    # a's click at 100 and buy at 150; b bought before clicking; a's buy at 900 is too late for 400
    assert out.rows == [{"user": "a", "ad": 1, "right_buyer": "a", "right_amount": 9.0}]
    assert summary.dead_letters == 0
    with pytest.raises(ConfigError, match="lower_ms <= upper_ms"):
        IntervalJoinSpec(column="k", right_column="k", lower_ms=5, upper_ms=1, space="j")


def test_a_window_over_two_sources_with_event_time_is_refused() -> None:
    from aisp import Count, Tumbling

    p = Pipeline("two")
    a = p.source("a", TestingSource([{"k": "x", "ts": 1}]), event_time=EventTime("ts"))
    b = p.source("b", TestingSource([{"k": "x", "ts": 2}]), event_time=EventTime("ts"))
    p.union("both", a, b).key_by("by", "k").window("w", Tumbling(10), {"n": Count()}).sink(
        "out", CollectSink()
    )
    with pytest.raises(ConfigError, match=r"step 'w' reads rows with event time from \['a', 'b'\]"):
        p.run()
