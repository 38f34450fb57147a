"""Interval joins of two keyed streams over event time.

A left row ``l`` and a right row ``r`` with the same key join when ``l.t + lower <= r.t <=
l.t + upper`` (``t``: the event time). Each side's rows wait in a buffer, sorted by (key, time)
when searched; every arriving batch is matched against the other side's buffer at once
(vectorised range searches, no loop over rows) and every pair is emitted as soon as both rows
are in, once: one output row with the left row's columns and the right row's under
``right_prefix``. A row older than the watermark before it is late (its partners may be gone):
it goes to the dead letters with reason ``late``. The watermark also drops what no future row
can join: left rows once ``t + upper`` is below it, right rows once ``t - lower`` is.

Rows from both inputs reach the step through one channel; two tagging steps in front of it
(``STEP.left``, ``STEP.right``, added by ``KeyedStream.interval_join``) mark each row's side.
The buffers are in checkpoints (keys by value), so a restored run emits each pair once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import EVENT_TIME, ID, INGEST_NS, KEY, META_COLUMNS, WATERMARK, Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.transform.operators import Emit, Operator, OperatorContext
from aisp.transform.windows.base import window_ids
from aisp.transform.windows.event_time import NO_WATERMARK

__all__ = ["SIDE", "IntervalJoinOp", "IntervalJoinSpec", "tag_side"]

SIDE = "__side"
"""The column the tagging steps add: 0 for left rows, 1 for right rows."""


def tag_side(side: int) -> Any:
    """A ``map_batch`` function marking every row as coming from ``side``."""

    def tag(batch: Batch) -> Batch:
        return batch.with_columns({SIDE: np.full(batch.num_rows, side, dtype=np.int8)})

    return tag


@dataclass(frozen=True, kw_only=True)
class IntervalJoinSpec:
    """An interval join's settings (``KeyedStream.interval_join`` builds it). ``column`` is the
    left key column (the output is keyed by it)."""

    column: str
    right_column: str
    lower_ms: int
    upper_ms: int
    space: str
    right_prefix: str = "right_"

    def __post_init__(self) -> None:
        if self.lower_ms > self.upper_ms:
            raise ConfigError(
                f"interval join needs lower_ms <= upper_ms, got {self.lower_ms} > {self.upper_ms}"
            )

    def build(self, ctx: OperatorContext) -> Operator:
        return IntervalJoinOp(self, ctx)


class _Buffer:
    """One side's waiting rows: their columns (Arrow), key codes and event times."""

    def __init__(self) -> None:
        self.rows: pa.Table | None = None
        self.code = np.empty(0, dtype=np.int64)
        self.t = np.empty(0, dtype=np.int64)

    def add(self, rows: pa.Table, code: npt.NDArray[np.int64], t: npt.NDArray[np.int64]) -> None:
        if not rows.num_rows:
            return
        self.rows = rows if self.rows is None else pa.concat_tables([self.rows, rows])
        self.code, self.t = np.concatenate([self.code, code]), np.concatenate([self.t, t])

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        if self.rows is not None and not mask.all():
            self.rows = self.rows.filter(pa.array(mask)).combine_chunks()
            self.code, self.t = self.code[mask], self.t[mask]

    def matches(
        self, code: npt.NDArray[np.int64], lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Pairs (query row, buffered row) with the same code and ``lo <= t <= hi``."""
        if not self.t.size or not code.size:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        order = np.lexsort((self.t, self.code))
        sc, st = self.code[order], self.t[order]
        keys, first = np.unique(sc, return_index=True)  # each code's run in (code, time) order
        rank = np.searchsorted(keys, code)
        known = (rank < keys.size) & (keys[np.minimum(rank, keys.size - 1)] == code)
        tmin, tmax = int(st.min()), int(st.max())
        span = tmax - tmin + 3  # times clipped to [tmin - 1, tmax + 1], shifted to [0, span)
        if keys.size * span >= 2**62:
            raise ConfigError("interval join: buffered event times span too much to search at once")
        run = np.repeat(np.arange(keys.size), np.diff(np.append(first, sc.size)))
        flat = run * span + (st - tmin + 1)
        base = np.minimum(rank, keys.size - 1) * span
        start = np.searchsorted(flat, base + np.clip(lo, tmin - 1, tmax + 1) - tmin + 1, "left")
        end = np.searchsorted(flat, base + np.clip(hi, tmin - 1, tmax + 1) - tmin + 1, "right")
        counts = np.where(known, np.maximum(end - start, 0), 0)
        queries = np.repeat(np.arange(code.size), counts)
        offsets = np.arange(queries.size) - np.repeat(np.cumsum(counts) - counts, counts)
        return queries, order[np.repeat(start, counts) + offsets]


class IntervalJoinOp:
    """The running interval join (see the module's docstring)."""

    def __init__(self, spec: IntervalJoinSpec, ctx: OperatorContext) -> None:
        self.spec, self._ctx = spec, ctx
        self.space = spec.space
        self._index = ctx.key_index(spec.space)
        self._sides = (_Buffer(), _Buffer())
        self.watermark = NO_WATERMARK
        self._side_wm = [NO_WATERMARK, NO_WATERMARK]  # each side's newest watermark
        self.late_events = 0

    def process(self, batch: Batch) -> Emit:
        if not batch.num_rows:
            return []
        if EVENT_TIME not in batch or WATERMARK not in batch:
            raise ConfigError(f"interval join {self._ctx.step_id!r} got rows without event time")
        side = batch.numpy(SIDE)
        stamped = batch.numpy(WATERMARK)
        # each side's rows come in order, but not in order with the other side's: a row's
        # watermark is the lower of the two sides' newest (as an operator with two inputs takes
        # the minimum of their watermarks), row by row
        newest = [
            np.maximum.accumulate(
                np.where(side == s, np.maximum(stamped, self._side_wm[s]), self._side_wm[s])
            )
            for s in (0, 1)
        ]
        wm = np.minimum(newest[0], newest[1])
        self._side_wm = [int(newest[0][-1]), int(newest[1][-1])]
        outs: Emit = []
        for s in (0, 1):  # left first: a pair within one batch is found once, by its right row
            rows = np.flatnonzero(side == s)
            if rows.size:
                outs += self._side(s, batch.take(rows), wm[rows])
        self.watermark = max(self.watermark, min(self._side_wm))
        lower, upper = self.spec.lower_ms, self.spec.upper_ms
        left, right = self._sides
        left.keep(left.t + upper >= self.watermark)  # what no future row can join goes
        right.keep(right.t - lower >= self.watermark)
        return outs

    def _side(self, s: int, part: Batch, wm: npt.NDArray[np.int64]) -> Emit:
        t = part.numpy(EVENT_TIME)
        late = t < wm
        if late.any():
            self.late_events += int(late.sum())
            missed = part.take(np.flatnonzero(late))
            missed = missed.select([c for c in missed.column_names if c != SIDE])
            self._ctx.dead_letter(missed, self._ctx.step_id, "late")
            part, t = part.take(np.flatnonzero(~late)), t[~late]
        if not part.num_rows:
            return []
        key_column = self.spec.column if s == 0 else self.spec.right_column
        code = self._index.encode(part.column(key_column))
        lower, upper = self.spec.lower_ms, self.spec.upper_ms
        lo, hi = (t + lower, t + upper) if s == 0 else (t - upper, t - lower)
        queries, partners = self._sides[1 - s].matches(code, lo, hi)
        columns = [c for c in part.column_names if c not in META_COLUMNS and c != SIDE]
        rows = pa.table({c: part.column(c) for c in [*columns, ID, INGEST_NS]})
        self._sides[s].add(rows, code, t)
        if not queries.size:
            return []
        other = self._sides[1 - s]
        assert other.rows is not None
        mine = rows.take(pa.array(queries))
        theirs = other.rows.take(pa.array(partners))
        left, right = (mine, theirs) if s == 0 else (theirs, mine)
        t_left, t_right = (t[queries], other.t[partners]) if s == 0 else (other.t[partners], t[queries])
        return [(DEFAULT_PORT, self._pairs(left, right, code[queries], np.maximum(t_left, t_right)))]

    def _pairs(self, left: pa.Table, right: pa.Table, code: npt.NDArray[np.int64],
               t: npt.NDArray[np.int64]) -> Batch:  # fmt: skip
        prefix = self.spec.right_prefix
        cols: dict[str, Any] = {c: left.column(c) for c in left.column_names if c not in (ID, INGEST_NS)}
        cols.update({prefix + c: right.column(c) for c in right.column_names if c not in (ID, INGEST_NS)})
        if len(cols) != len(left.column_names) + len(right.column_names) - 4:
            raise ConfigError(f"interval join {self._ctx.step_id!r}: output columns clash; set right_prefix")
        left_ids = left.column(ID).to_numpy()
        cols[ID] = window_ids(left_ids, right.column(ID).to_numpy())
        cols[INGEST_NS] = np.maximum(left.column(INGEST_NS).to_numpy(), right.column(INGEST_NS).to_numpy())
        cols[KEY] = code
        cols[EVENT_TIME] = t
        cols[WATERMARK] = np.full(code.shape[0], self.watermark, dtype=np.int64)
        return Batch.from_columns({k: v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v
                                   for k, v in cols.items()})  # fmt: skip

    def flush(self) -> Emit:
        return []

    # -- checkpoints ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        """Both buffers, their keys by value, as Arrow IPC (one row)."""
        out: dict[str, npt.NDArray[Any]] = {
            "__wm": np.array([self.watermark]), "__wm_left": np.array([self._side_wm[0]]),
            "__wm_right": np.array([self._side_wm[1]]),
        }  # fmt: skip
        for name, buffer in zip(("__left", "__right"), self._sides, strict=True):
            blob = b""
            if buffer.rows is not None and buffer.rows.num_rows:
                keys = self._index.frozen_keys(buffer.code)()
                table = buffer.rows.append_column("__keyval", keys).append_column("__t", pa.array(buffer.t))
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table)
                blob = sink.getvalue().to_pybytes()
            out[name] = np.array([blob], dtype=object)
        return out

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        self.watermark = int(columns["__wm"][0])
        self._side_wm = [int(columns["__wm_left"][0]), int(columns["__wm_right"][0])]
        for name, buffer in zip(("__left", "__right"), self._sides, strict=True):
            blob = columns[name][0]
            if not blob:
                continue
            table = pa.ipc.open_stream(pa.py_buffer(blob)).read_all()
            code = self._index.encode(table.column("__keyval").combine_chunks())
            t = table.column("__t").to_numpy()
            buffer.add(table.drop_columns(["__keyval", "__t"]), code, t)
