"""Sketch aggregates (distinct count, quantiles, top-k) and user-defined aggregates, in windows,
against exact answers; their state through a checkpoint (Arrow) and back."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import EVENT_TIME, KEY, WATERMARK, Batch
from aisp.state.keyed import KeyIndex
from aisp.state.store import LmdbStateStore
from aisp.state.window_log import WindowLog
from aisp.transform.operators import OperatorContext
from aisp.transform.windows.aggregates import Aggregate, Count, Groups, State
from aisp.transform.windows.event_time import NO_WATERMARK
from aisp.transform.windows.sketches import DistinctCount, Quantile, TopK, hash64
from aisp.transform.windows.spec import Session, Tumbling, WindowSpec


class GeometricMean(Aggregate):
    """A user-defined aggregate: the geometric mean, kept as a count and a sum of logs."""

    column = "x"

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"n": ("int64", 0), "logs": ("float64", 0.0)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {
            "n": groups.sizes.astype(np.int64),
            "logs": groups.reduce(np.add, np.log(values.astype(float))),
        }

    def merge(self, a: State, b: State) -> State:
        return {"n": a["n"] + b["n"], "logs": a["logs"] + b["logs"]}

    def result(self, state: State) -> npt.NDArray[Any]:
        return np.exp(state["logs"] / state["n"])  # type: ignore[no-any-return]


AGGS = {
    "n": Count(), "distinct": DistinctCount("word", precision=14), "median": Quantile("x"),
    "q": Quantile("x", q=[0.1, 0.9]), "top": TopK("word", k=3), "geo": GeometricMean(),
}  # fmt: skip


def run(
    window: Any,
    batches: list[list[tuple[str, int, float, str]]],
    restore_at: int | None = None,
    log: WindowLog | None = None,
) -> list[dict[str, Any]]:
    """(key, time, x, word) rows through a window step (no lateness: all in one window
    each), optionally through a snapshot and a fresh operator at batch ``restore_at``; with
    ``log``, the snapshot is what the log of each batch's changes adds up to."""
    index = KeyIndex()

    def build() -> Any:
        ctx = OperatorContext("w", lambda *a, **k: None, {"s": index})
        spec = WindowSpec(window=window, aggregates=tuple(AGGS.items()), space="s", key_column="key")
        return spec.build(ctx)

    op, rows, next_id = build(), [], 0
    for i, part in enumerate(batches):
        if log is not None and i:  # a checkpoint with a state store after each batch
            log.write(i, "w", *op.changes(everything=i == 1), base=i == 1)
        if i == restore_at:
            if log is None:
                table = pa.table(op.snapshot())  # as a checkpoint stores it
                columns = {c: table.column(c).to_numpy() for c in table.column_names}
            else:
                columns = log.read(i, "w") or {}
            op = build()
            if columns:
                op.restore(columns)
        keys, t, x, words = (list(c) for c in zip(*part, strict=True))
        b = Batch.from_columns({"key": keys, "x": x, "word": words, EVENT_TIME: np.array(t, np.int64),
                                WATERMARK: np.full(len(t), NO_WATERMARK, np.int64)},
                               ids=np.arange(next_id, next_id + len(t)))  # fmt: skip
        next_id += len(t)
        for _, out in op.process(b.with_columns({KEY: index.encode(b.column("key"))})):
            rows += out.record_batch.to_pylist()
    for _, out in op.flush():
        rows += out.record_batch.to_pylist()
    return rows


def check(rows: list[dict[str, Any]], events: list[tuple[str, int, float, str]]) -> None:
    by_key: dict[str, list[tuple[str, int, float, str]]] = {}
    for e in events:
        by_key.setdefault(e[0], []).append(e)
    assert sorted(r["key"] for r in rows) == sorted(by_key)
    for r in rows:
        mine = by_key[r["key"]]
        xs = np.array([e[2] for e in mine])
        words = [e[3] for e in mine]
        assert r["n"] == len(mine)
        exact = len(set(words))
        assert abs(r["distinct"] - exact) <= max(1.0, 0.03 * exact)
        assert np.quantile(xs, 0.5, method="inverted_cdf") == r["median"]  # exact below k items
        assert r["q"] == [np.quantile(xs, q, method="inverted_cdf") for q in (0.1, 0.9)]
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        assert [(d["value"], d["count"]) for d in r["top"]] == top
        assert r["geo"] == pytest.approx(float(np.exp(np.log(xs).mean())))


WORDS = st.sampled_from(["x", "y", "zz", "é", ""])
EVENTS = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 99), st.integers(1, 50).map(float), WORDS),
    min_size=1,
    max_size=150,
)


@settings(max_examples=60, deadline=None)
@given(
    EVENTS,
    st.lists(st.integers(0, 150), max_size=4),
    st.sampled_from([Tumbling(100), Session(1000)]),
    st.data(),
)
def test_sketches_and_a_user_aggregate_agree_with_exact_answers(
    tmp_path_factory: Any, events: list[Any], cuts: list[int], window: Any, data: Any
) -> None:
    bounds = sorted({0, len(events), *(min(c, len(events)) for c in cuts)})
    batches = [events[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    restore_at = data.draw(st.one_of(st.none(), st.integers(0, len(batches) - 1)))
    check(run(window, batches, restore_at), events)
    if restore_at is not None:  # the same through the state store's log of changes
        store = LmdbStateStore(tmp_path_factory.mktemp("store"))
        check(run(window, batches, restore_at, WindowLog(store)), events)
        store.close()


def test_distinct_count_is_within_its_error_at_large_cardinalities() -> None:
    d = DistinctCount("v", precision=12)
    g = Groups.of(np.zeros(200_000, dtype=np.int64), None)
    values = d.prepare(pa.array(np.arange(200_000) % 50_000))
    estimate = float(d.result(d.update(g, values, np.zeros(0, np.int64)))[0])
    assert abs(estimate - 50_000) / 50_000 < 0.05  # 1.04 / sqrt(4096) = 1.6% standard error


def test_hash64_sees_slices_nulls_and_equal_values() -> None:
    arr = pa.array(["aa", "b", None, "aa", "ccc"]).slice(1)
    h = hash64(arr)
    assert h[2] == hash64(pa.array(["aa"]))[0] and h[0] != h[3]
    assert hash64(pa.array([0.0]))[0] == hash64(pa.array([-0.0]))[0]
    assert len(set(hash64(pa.array(range(10_000))).tolist())) == 10_000
    with pytest.raises(TypeError, match="cannot hash"):
        hash64(pa.array([[1]]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DistinctCount("v", precision=3), "precision must be 4..16"),
        (lambda: Quantile("v", q=1.5), "q must be in"),
        (lambda: TopK("v", k=0), "k must be >= 1"),
    ],
)
def test_bad_sketch_settings_fail_where_declared(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
