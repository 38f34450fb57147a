"""Event time and watermarks.

A source declared with an ``EventTime`` stamps every row it reads with two metadata columns:

* ``_event_time``: the row's event time in milliseconds since the epoch (from a column of the
  event, in its unit; or the wall clock when it was read, for processing time);
* ``_watermark``: the watermark *before* the row: no event older than this is expected any more.

Watermarks are kept per input partition (a Kafka partition; one partition for a file or a
stream) as the largest event time read so far minus the bounded out-of-orderness; the source's
watermark is the minimum over its partitions, leaving out partitions that have been idle for
``idle_timeout_ms``. Each row carries the watermark as it stood before that row was read, so
what a window decides never depends on how the input was cut into batches, nor on threads.

>>> gen = WatermarkGenerator(EventTime("ts", max_out_of_orderness_ms=2_000))
>>> ts = np.array([10_000, 9_000, 15_000, 12_000])
>>> gen.watermarks(ts, None, now_ns=0).tolist()  # before each row: max(ts so far) - 2000
[-9223372036854775808, 8000, 8000, 13000]
>>> gen.watermarks(np.array([11_000]), None, now_ns=0).tolist()
[13000]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import EVENT_TIME, WATERMARK
from aisp.errors import ConfigError

__all__ = ["EVENT_TIME", "NO_WATERMARK", "WATERMARK", "EventTime", "WatermarkGenerator"]

NO_WATERMARK = int(np.iinfo(np.int64).min)
"""The watermark before any event has been read: every window is still open."""
_NOT_YET = int(np.iinfo(np.int64).max)

_TO_MS = {"ms": (1, 1), "s": (1000, 1), "us": (1, 1000), "ns": (1, 1_000_000)}  # (multiply, divide)


@dataclass(frozen=True)
class EventTime:
    """Where a source's rows get their event time, and how far out of order they may come.

    Args:
        column: the event's timestamp column (integers or floats in ``unit``, or an Arrow
            timestamp); ``None`` for processing time (the wall clock when the row is read).
        unit: ``"ms"``, ``"s"``, ``"us"`` or ``"ns"`` since the epoch.
        max_out_of_orderness_ms: how far behind the newest event an event may still come: the
            watermark is the largest event time read minus this.
        idle_timeout_ms: a partition that has sent nothing for this long (processing time) no
            longer holds the watermark back (0: never).
    """

    column: str | None = None
    unit: str = "ms"
    max_out_of_orderness_ms: int = 0
    idle_timeout_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.unit not in _TO_MS:
            raise ConfigError(f"event time unit must be one of {sorted(_TO_MS)}, got {self.unit!r}")
        if self.max_out_of_orderness_ms < 0:
            raise ConfigError(f"max_out_of_orderness_ms must be >= 0, got {self.max_out_of_orderness_ms}")
        if self.idle_timeout_ms < 0:
            raise ConfigError(f"idle_timeout_ms must be >= 0, got {self.idle_timeout_ms}")

    @property
    def processing_time(self) -> bool:
        return self.column is None

    def event_ms(
        self, column: pa.Array | pa.ChunkedArray
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The event time column in milliseconds, and which rows have one (not null, finite).

        >>> EventTime("ts", unit="s").event_ms(pa.array([1.5, None, 2.0]))[0].tolist()
        [1500, 0, 2000]
        """
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        n = len(column)
        if pa.types.is_null(column.type):
            return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        ok = (
            np.ones(n, dtype=bool)
            if not column.null_count
            else column.is_valid().to_numpy(zero_copy_only=False)
        )
        unit = self.unit
        if pa.types.is_timestamp(column.type):
            unit, column = column.type.unit, column.cast(pa.int64())
        elif not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        values = (column.fill_null(0) if column.null_count else column).to_numpy(zero_copy_only=False)
        mul, div = _TO_MS[unit]
        if values.dtype.kind == "f":
            ms = values * (mul / div)
            ok &= np.isfinite(ms) & (np.abs(ms) < 2.0**62)
            return np.floor(np.where(ok, ms, 0.0)).astype(np.int64), ok
        values = values.astype(np.int64, copy=False)
        if mul == 1:
            return values // div, ok
        ok &= np.abs(values) < (2**62) // mul
        return np.where(ok, values, 0) * mul, ok


class WatermarkGenerator:
    """One source's watermarks (see the module docstring); state for checkpoints in ``snapshot``."""

    def __init__(self, spec: EventTime) -> None:
        self.spec = spec
        self._max: dict[int, int] = {}  # partition -> largest event time read
        self._seen_ns: dict[int, int] = {}  # partition -> when it last sent an event (monotonic)

    @property
    def watermark(self) -> int:
        """The source's current watermark (after every row read so far)."""
        return self._combine({p: m for p, m in self._max.items() if self._active(p, time.monotonic_ns(), ())})

    def _combine(self, maxima: dict[int, int]) -> int:
        if not maxima:
            return NO_WATERMARK
        return min(maxima.values()) - self.spec.max_out_of_orderness_ms

    def _active(self, partition: int, now_ns: int, present: Any) -> bool:
        timeout = self.spec.idle_timeout_ms
        return (
            not timeout
            or partition in present
            or now_ns - self._seen_ns.get(partition, now_ns) < timeout * 1e6
        )

    def watermarks(
        self, event_ms: npt.NDArray[np.int64], partitions: npt.NDArray[np.int64] | None, now_ns: int
    ) -> npt.NDArray[np.int64]:
        """The watermark before each row, and the state advanced past them (vectorised)."""
        if partitions is None and set(self._max) <= {0}:
            return self._one_partition(event_ms, now_ns)
        return self._by_partition(event_ms, partitions, now_ns)[0]

    def partition_watermarks(
        self, event_ms: npt.NDArray[np.int64], partitions: npt.NDArray[np.int64], now_ns: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each row's own partition's watermark before it (second): what state that moves with
        its partition decides by, so the outcome does not depend on which other partitions the
        process reads; and the watermark over all partitions *after* each row (first): up to
        where windows may close once the row is taken, whichever partitions it brought in
        (see ``aisp.transform.windows.base``).

        >>> gen = WatermarkGenerator(EventTime("ts"))
        >>> wm, own = gen.partition_watermarks(np.array([50, 10, 60, 20]), np.array([0, 1, 0, 1]), 0)
        >>> wm.tolist()[1:], own[2:].tolist(), bool(own[1] == NO_WATERMARK)
        ([10, 10, 20], [50, 10], True)
        """
        return self._by_partition(event_ms, partitions, now_ns, own=True)

    def _by_partition(
        self,
        event_ms: npt.NDArray[np.int64],
        partitions: npt.NDArray[np.int64] | None,
        now_ns: int,
        *,
        own: bool = False,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        n = event_ms.shape[0]
        if partitions is None:
            partitions = np.zeros(n, dtype=np.int64)
        present = np.unique(partitions).tolist() if n else []
        known = [p for p in self._max if self._active(p, now_ns, present)]
        every = sorted(set(known) | set(present))
        if not every:
            return np.full(n, NO_WATERMARK, dtype=np.int64), np.full(n, NO_WATERMARK, dtype=np.int64)
        # each partition's largest event time before each row (NO_WATERMARK where none yet), and
        # with ``own`` after each row too
        before = np.empty((len(every), n), dtype=np.int64)
        after = np.empty((len(every), n), dtype=np.int64) if own else before
        for i, p in enumerate(every):
            mine = np.where(partitions == p, event_ms, NO_WATERMARK)
            running = np.maximum.accumulate(mine) if n else mine
            before[i, 0] = self._max.get(p, NO_WATERMARK)
            before[i, 1:] = np.maximum(running[:-1], before[i, 0])
            if own:
                np.maximum(running, before[i, 0], out=after[i])
            if p not in self._max:  # a new partition holds nothing back before its first event
                before[i][before[i] == NO_WATERMARK] = _NOT_YET
                if own:
                    after[i][after[i] == NO_WATERMARK] = _NOT_YET
            if n and p in present:
                self._max[p] = int(max(self._max.get(p, NO_WATERMARK), int(running[-1])))
                self._seen_ns[p] = now_ns
        if not own:
            low = self._less_slack(before.min(axis=0))
            return low, low
        mine = before[np.searchsorted(np.asarray(every), partitions), np.arange(n)]
        return self._less_slack(after.min(axis=0)), self._less_slack(mine)

    def _less_slack(self, newest: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        unknown = (newest == NO_WATERMARK) | (newest == _NOT_YET)
        return np.where(unknown, NO_WATERMARK, newest - self.spec.max_out_of_orderness_ms).astype(np.int64)

    def _one_partition(self, event_ms: npt.NDArray[np.int64], now_ns: int) -> npt.NDArray[np.int64]:
        """``watermarks`` for a source with one partition (files, streams): a running maximum."""
        n = event_ms.shape[0]
        out = np.empty(n, dtype=np.int64)
        if not n:
            return out
        newest = self._max.get(0, NO_WATERMARK)
        out[0] = newest
        np.maximum.accumulate(event_ms[:-1], out=out[1:])
        np.maximum(out[1:], newest, out=out[1:])
        self._max[0] = int(max(newest, int(out[-1]), int(event_ms[-1])))
        self._seen_ns[0] = now_ns
        unknown = out == NO_WATERMARK
        out -= self.spec.max_out_of_orderness_ms
        out[unknown] = NO_WATERMARK
        return out

    def snapshot(self) -> dict[str, int]:
        """The largest event time per partition (JSON-able, for a checkpoint's manifest)."""
        return {str(p): m for p, m in self._max.items()}

    def newest(self, partition: int) -> int | None:
        """The largest event time read from ``partition`` (None: nothing yet)."""
        return self._max.get(partition)

    def take_over(self, partition: int, newest: int | None) -> None:
        """``partition`` (state that moves with it, taken over) has read up to ``newest``."""
        self._max.pop(partition, None)
        self._seen_ns.pop(partition, None)
        if newest is not None:
            self._max[partition] = int(newest)
            self._seen_ns[partition] = time.monotonic_ns()

    def restore(self, state: dict[str, int]) -> None:
        now = time.monotonic_ns()
        self._max = {int(p): int(m) for p, m in state.items()}
        self._seen_ns = dict.fromkeys(self._max, now)
