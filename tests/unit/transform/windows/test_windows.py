"""Windows against a sequential reference: random out-of-order input, lateness, watermarks and
batch splits (Hypothesis), and a checkpoint taken midway."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import EVENT_TIME, KEY, WATERMARK, Batch
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.operators import OperatorContext
from aisp.transform.windows.aggregates import Count, First, Last, Max, Mean, Min, Std, Sum, Var
from aisp.transform.windows.event_time import NO_WATERMARK, EventTime, WatermarkGenerator
from aisp.transform.windows.spec import LATE_PORT, Session, Sliding, Tumbling, WindowSpec

AGGREGATES = {
    "n": Count(), "sum": Sum("x"), "lo": Min("x"), "hi": Max("x"), "avg": Mean("x"),
    "var": Var("x"), "sd": Std("x", ddof=1), "first": First("x"), "last": Last("x"),
}  # fmt: skip
Event = tuple[str, int, float, int, int]  # key, event time, value, watermark before it, id


# -- the sequential reference -----------------------------------------------------------------
def _agg(events: list[tuple[int, float, int]]) -> dict[str, Any]:
    """The aggregates of (time, value, arrival) events, computed the plain way."""
    xs = [x for _, x, _ in events]
    n, mean = len(xs), sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / n
    by_time = sorted(events, key=lambda e: (e[0], e[2]))
    return {
        "n": n, "sum": sum(xs), "lo": min(xs), "hi": max(xs), "avg": mean, "var": var,
        "sd": math.sqrt(var * n / (n - 1)) if n > 1 else math.nan,
        "first": by_time[0][1], "last": by_time[-1][1],
    }  # fmt: skip


def reference(events: Sequence[Event], window: Any, lateness: int) -> tuple[list[dict[str, Any]], list[int]]:
    """One event at a time, with dicts: (window rows, ids of late events)."""
    windows: dict[
        tuple[str, int, int], tuple[int, list[tuple[int, float, int]]]
    ] = {}  # (key, start, opening event) -> end, events: a session no longer open to events and
    # one opened after it may share a start
    late: list[int] = []
    for key, t, x, wm, eid in events:
        if isinstance(window, Session):
            mine = [w for w, (e, _) in windows.items() if w[0] == key and e + lateness > wm]
            joins = [w for w in mine if w[1] < t + window.gap_ms and t < windows[w][0]]
            if not joins and t + window.gap_ms + lateness <= wm:
                late.append(eid)
                continue
            start = min([t] + [w[1] for w in joins])
            end = max([t + window.gap_ms] + [windows[j][0] for j in joins])
            evs = [e for j in joins for e in windows.pop(j)[1]]
            windows[(key, start, min([eid] + [j[2] for j in joins]))] = (end, [*evs, (t, x, eid)])
            continue
        last = (t - window.offset_ms) // window.step_ms * window.step_ms + window.offset_ms
        starts = [s for s in range(last, t - window.size_ms, -window.step_ms)]
        taken = [s for s in starts if s + window.size_ms + lateness > wm]
        if not taken:
            late.append(eid)
        for s in taken:
            end, evs = windows.setdefault((key, s, 0), (s + window.size_ms, []))
            evs.append((t, x, eid))
    rows = [{"key": k, "start": s, "end": e, **_agg(evs)} for (k, s, _), (e, evs) in windows.items()]
    return rows, late


# -- driving the operator ---------------------------------------------------------------------
class Harness:
    def __init__(self, spec: WindowSpec, index: KeyIndex | None = None) -> None:
        self.index = index or KeyIndex()
        self.dead: list[tuple[Batch, str, dict[str, Any]]] = []
        ctx = OperatorContext("w", lambda b, step, reason, fields=None: self.dead.append((b, reason, fields)),
                              {"space": self.index})  # fmt: skip
        self.op = spec.build(ctx)
        self.rows: list[dict[str, Any]] = []
        self.late_rows: list[dict[str, Any]] = []

    def feed(self, events: Sequence[Event]) -> None:
        if not events:
            return
        keys, t, x, wm, ids = (list(c) for c in zip(*events, strict=True))
        batch = Batch.from_columns(
            {"key": keys, "x": np.array(x, dtype=np.float64), EVENT_TIME: np.array(t, dtype=np.int64),
             WATERMARK: np.array(wm, dtype=np.int64)}, ids=np.array(ids, dtype=np.int64))  # fmt: skip
        batch = batch.with_columns({KEY: self.index.encode(batch.column("key"))})
        self._collect(self.op.process(batch))

    def _collect(self, outs: list[tuple[str, Batch]]) -> None:
        for port, b in outs:
            (self.late_rows if port == LATE_PORT else self.rows).extend(b.record_batch.to_pylist())

    def finish(self) -> None:
        self._collect(self.op.flush())

    def late_ids(self) -> list[int]:
        return sorted(
            [i for b, _, _ in self.dead for i in b.ids.tolist()] + [r["_id"] for r in self.late_rows]
        )


def check(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(got) == len(expected), (got, expected)
    got = sorted(got, key=lambda r: (r["key"], r["window_start"], r["window_end"], r["n"]))
    expected = sorted(expected, key=lambda r: (r["key"], r["start"], r["end"], r["n"]))
    for g, e in zip(got, expected, strict=True):
        assert (g["key"], g["window_start"], g["window_end"]) == (e["key"], e["start"], e["end"]), (g, e)
        for name in AGGREGATES:
            assert g[name] == pytest.approx(e[name], rel=1e-9, abs=1e-9, nan_ok=True), (name, g, e)


WINDOWS = st.one_of(
    st.builds(Tumbling, st.integers(1, 40), st.integers(-20, 20)),
    st.integers(1, 40).flatmap(
        lambda size: st.builds(Sliding, st.just(size), st.integers(1, size), st.integers(0, 9))
    ),
    st.builds(Session, st.integers(1, 40)),
)


@st.composite
def scenarios(draw: Any) -> tuple[list[Event], Any, int, list[int]]:
    n = draw(st.integers(0, 80))
    keys = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n, max_size=n))
    times = draw(st.lists(st.integers(-50, 300), min_size=n, max_size=n))
    xs = draw(st.lists(st.integers(-9, 9), min_size=n, max_size=n))
    delay = draw(st.integers(0, 60))
    gen = WatermarkGenerator(EventTime("t", max_out_of_orderness_ms=delay))
    wm = gen.watermarks(np.array(times, dtype=np.int64), None, now_ns=0).tolist()
    events = [(k, t, float(x), w, i) for i, (k, t, x, w) in enumerate(zip(keys, times, xs, wm, strict=True))]
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    return events, draw(WINDOWS), draw(st.integers(0, 40)), cuts


def _spec(window: Any, lateness: int, late: str = "dead_letter") -> WindowSpec:
    return WindowSpec(window=window, aggregates=tuple(AGGREGATES.items()), space="space", key_column="key",
                      allowed_lateness_ms=lateness, late=late)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_window_kind_agrees_with_the_sequential_reference(scenario: Any) -> None:
    events, window, lateness, cuts = scenario
    expected, late = reference(events, window, lateness)
    h = Harness(_spec(window, lateness))
    for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True):
        h.feed(events[a:b])
    h.finish()
    check(h.rows, expected)
    assert h.late_ids() == sorted(late)
    assert all(reason == "late" for _, reason, _ in h.dead)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_the_hash_table_index_agrees_when_the_ring_outgrows_its_budget(scenario: Any) -> None:
    from unittest import mock

    from aisp.transform.windows.spec import AlignedWindowsOp

    events, window, lateness, cuts = scenario
    expected, late = reference(events, window, lateness)
    with mock.patch.object(AlignedWindowsOp, "RING_BUDGET", 2 * 1024):  # two rows of keys
        h = Harness(_spec(window, lateness))
        for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True):
            h.feed(events[a:b])
        h.finish()
    check(h.rows, expected)
    assert h.late_ids() == sorted(late)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_a_checkpoint_midway_restores_to_the_same_windows(scenario: Any, data: Any) -> None:
    events, window, lateness, _ = scenario
    expected, late = reference(events, window, lateness)
    at = data.draw(st.integers(0, len(events)))
    first = Harness(_spec(window, lateness, late="side"))
    first.feed(events[:at])
    columns = first.op.snapshot()
    keys = first.index.keys()
    restored_index = KeyIndex()  # a new process: keys come back in another order, or not at all
    restored_index.encode(pa.array(list(reversed(keys)), pa.string()))
    second = Harness(_spec(window, lateness, late="side"), restored_index)
    second.op.restore({k: np.asarray(v) for k, v in columns.items()})
    second.feed(events[at:])
    second.finish()
    check(first.rows + second.rows, expected)
    assert sorted(first.late_ids() + second.late_ids()) == sorted(late)


def test_a_late_event_is_dead_lettered_with_the_window_it_missed() -> None:
    h = Harness(_spec(Tumbling(10), 5))
    h.feed([("a", 3, 1.0, NO_WATERMARK, 0), ("a", 40, 1.0, 1, 1), ("a", 4, 2.0, 38, 2)])
    h.finish()
    ((batch, reason, fields),) = h.dead
    assert (batch.ids.tolist(), reason, fields) == ([2], "late", {"window": [{"start": 0, "end": 10}]})
    assert [(r["window_start"], r["n"]) for r in h.rows] == [(0, 1), (40, 1)]


def test_early_results_are_marked_and_the_final_row_follows() -> None:
    spec = WindowSpec(window=Tumbling(100), aggregates=(("n", Count()),), space="space", key_column="key",
                      early_every_ms=1e-6)  # fmt: skip
    h = Harness(spec)
    h.feed([("a", 1, 1.0, NO_WATERMARK, 0)])
    h.feed([("a", 2, 1.0, 1, 1)])
    h.finish()
    assert [(r["n"], r["final"]) for r in h.rows] == [(1, False), (2, False), (2, True)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": Tumbling(0)}, "size_ms and step_ms must be > 0"),
        ({"window": Session(-1)}, "gap_ms must be > 0"),
        ({"aggregates": ()}, "at least one aggregate"),
        ({"aggregates": (("n", len),)}, "not an Aggregate"),
        ({"allowed_lateness_ms": -1}, "allowed_lateness_ms must be >= 0"),
        ({"late": "ignore"}, "late must be one of"),
        ({"start_column": "key"}, "must differ"),
    ],
)
def test_a_window_that_cannot_work_fails_where_it_is_declared(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "window": Tumbling(10),
        "aggregates": (("n", Count()),),
        "space": "s",
        "key_column": "key",
    }
    with pytest.raises(ConfigError, match=message):
        WindowSpec(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"workers": 2, "state_max_keys": 0, "partition_state": False}, "--workers N > 1"),
        ({"workers": 1, "state_max_keys": 10, "partition_state": False}, "--state-max-keys"),
    ],
)
def test_options_windows_cannot_keep_up_with_are_refused_clearly(options: dict[str, Any], named: str) -> None:
    from aisp import NullSink, Pipeline, TestingSource
    from aisp.schedule.watermarks import check_event_time_options

    p = Pipeline("w")
    src = p.source("src", TestingSource([{"k": "a", "t": 1}]), event_time=EventTime("t"))
    src.key_by("by", "k").window("w", Tumbling(10), {"n": Count()}).sink("out", NullSink())
    with pytest.raises(ConfigError, match=named):
        check_event_time_options(p.build(), **options)
    check_event_time_options(p.build(), workers=1, state_max_keys=0, partition_state=False)
    # windows move with input partitions; a join's state does not yet
    check_event_time_options(p.build(), workers=1, state_max_keys=0, partition_state=True)
    j = Pipeline("j")
    left = j.source("l", TestingSource([{"k": "a", "t": 1}]), event_time=EventTime("t")).key_by("bl", "k")
    right = j.source("r", TestingSource([{"k": "a", "t": 1}]), event_time=EventTime("t")).key_by("br", "k")
    left.interval_join("joined", right, lower_ms=0, upper_ms=10).sink("out", NullSink())
    with pytest.raises(ConfigError, match="--partition-state"):
        check_event_time_options(j.build(), workers=1, state_max_keys=0, partition_state=True)


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.data())
def test_a_log_of_changes_in_the_state_store_restores_to_the_same_windows(
    tmp_path_factory: Any, scenario: Any, data: Any
) -> None:
    """Each segment's changes go to a ``WindowLog`` (as the checkpoints of a pipeline with a
    state store write them: bases now and then, old entries deleted); a restore from any kept
    version goes on to the same windows as the reference."""
    from aisp.state.store import LmdbStateStore
    from aisp.state.window_log import WindowLog

    events, window, lateness, cuts = scenario
    expected, late = reference(events, window, lateness)
    bounds = list(zip([0, *cuts], [*cuts, len(events)], strict=True))
    store = LmdbStateStore(tmp_path_factory.mktemp("store"))
    log = WindowLog(store)
    first = Harness(_spec(window, lateness, late="side"))
    kept = 1  # the oldest version a restore may ask for
    for version, (a, b) in enumerate(bounds, start=1):
        first.feed(events[a:b])
        base = version == 1 or data.draw(st.booleans())
        columns, gone = first.op.changes(everything=base)
        kept = data.draw(st.integers(kept, version))
        log.write(version, "w", columns, gone, base=base, before=data.draw(st.sampled_from([0, kept])))
    at = data.draw(st.integers(kept, len(bounds)))  # restore from the checkpoint after segment ``at``
    restored = log.read(at, "w")
    assert restored is not None
    second = Harness(_spec(window, lateness, late="side"))
    second.op.restore(restored)
    replay = Harness(_spec(window, lateness, late="side"))  # what the first run did up to ``at``
    for a, b in bounds[:at]:
        replay.feed(events[a:b])
    assert sorted(restored["__uid"].tolist()) == sorted(replay.op.snapshot()["__uid"].tolist())
    for a, b in bounds[at:]:
        second.feed(events[a:b])
    second.finish()
    check(replay.rows + second.rows, expected)
    assert sorted(replay.late_ids() + second.late_ids()) == sorted(late)
    store.close()


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_windows_handed_over_with_their_partition_decide_as_that_partition_alone_would(
    scenario: Any, data: Any
) -> None:
    """State that follows input partitions: keys a, b come from partition 0 and c, d from
    partition 1; a process reads both, then hands partition 1 (its open windows and how far it
    read in event time) to another process. Each partition's windows and late events are those
    of the sequential reference over that partition alone, by its own watermarks."""
    from aisp.batch import PARTITION_WATERMARK

    events, window, lateness, cuts = scenario
    delay = data.draw(st.integers(0, 60))
    part = {"a": 0, "b": 0, "c": 1, "d": 1}
    expected: list[dict[str, Any]] = []
    late: list[int] = []
    for p in (0, 1):  # the reference over each partition alone, by its own watermarks
        mine = [e for e in events if part[e[0]] == p]
        alone = WatermarkGenerator(EventTime("t", max_out_of_orderness_ms=delay))
        wm = alone.watermarks(np.array([e[1] for e in mine], dtype=np.int64), None, now_ns=0).tolist()
        rows, missed = reference([(*e[:3], w, e[4]) for e, w in zip(mine, wm, strict=True)], window, lateness)
        expected += rows
        late += missed

    def feed(h: Harness, gen: WatermarkGenerator, chunk: list[Event]) -> None:
        if not chunk:
            return
        parts = np.array([part[e[0]] for e in chunk], dtype=np.int64)
        wm, own = gen.partition_watermarks(np.array([e[1] for e in chunk], dtype=np.int64), parts, 0)
        keys = [e[0] for e in chunk]
        batch = Batch.from_columns(
            {"key": keys, "x": np.array([e[2] for e in chunk]), EVENT_TIME: np.array([e[1] for e in chunk]),
             WATERMARK: wm, PARTITION_WATERMARK: own}, ids=np.array([e[4] for e in chunk], dtype=np.int64),
        )  # fmt: skip
        h._collect(h.op.process(batch.with_columns({KEY: h.index.encode(batch.column("key"))})))

    at = data.draw(st.integers(0, len(events)))
    first, second = (
        Harness(_spec(window, lateness, late="side")),
        Harness(_spec(window, lateness, late="side")),
    )
    gen_first, gen_second = (WatermarkGenerator(EventTime("t", max_out_of_orderness_ms=delay)) for _ in "12")
    for a, b in zip([0, *[c for c in cuts if c < at]], [*[c for c in cuts if c < at], at], strict=True):
        feed(first, gen_first, events[a:b])
    known = first.index.keys()
    moving = np.array([i for i, k in enumerate(known) if part[k] == 1], dtype=np.int64)
    key_codes, columns = first.op.windows_of(moving)  # type: ignore[attr-defined]
    moved_keys = first.index.frozen_keys(key_codes)()
    survivors = first.index.drop(moving, remember=False)
    first.op.drop_keys(moving, survivors)  # type: ignore[attr-defined]
    second.op.add_windows(second.index.encode(moved_keys), columns)  # type: ignore[attr-defined]
    gen_second.take_over(1, gen_first.newest(1))
    gen_first.take_over(1, None)
    rest = events[at:]
    feed(first, gen_first, [e for e in rest if part[e[0]] == 0])
    feed(second, gen_second, [e for e in rest if part[e[0]] == 1])
    first.finish()
    second.finish()
    check(first.rows + second.rows, expected)
    assert sorted(first.late_ids() + second.late_ids()) == sorted(late)
