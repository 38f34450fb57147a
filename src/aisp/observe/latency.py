"""A vectorised latency histogram with HDR-style log-linear buckets (about 1% relative error).

``record(values_ns)`` takes a whole numpy array at once, so a sink records the end-to-end
latency of every event of a batch with one ``bincount``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["LatencyHistogram", "histogram_buckets"]

_LINEAR = 128  # values below this are counted exactly
_HALF = 64  # sub-buckets per power of two above it -> <= 0.8% relative error (bucket midpoints)
_MAX_EXP = 48  # up to 2**48 ns ~ 78 hours
_BUCKETS = _LINEAR + _MAX_EXP * _HALF


class LatencyHistogram:
    """Counts of nanosecond latencies.

    >>> h = LatencyHistogram()
    >>> h.record(np.array([1_000_000, 2_000_000, 3_000_000]))
    >>> round(h.percentile(50) / 1e6, 1), h.count
    (2.0, 3)
    """

    _PENDING = 16384  # raw values buffered before they are folded into buckets

    def __init__(self) -> None:
        self._counts = np.zeros(_BUCKETS, dtype=np.int64)
        self._lock = threading.Lock()
        self._pending = np.empty(self._PENDING, dtype=np.int64)
        self._npending = 0
        self._count = 0
        self._max_ns = 0
        self._sum_ns = 0

    @property
    def count(self) -> int:
        with self._lock:
            return self._count + self._npending

    @property
    def max_ns(self) -> int:
        with self._lock:
            self._fold()
            return self._max_ns

    @property
    def sum_ns(self) -> int:
        with self._lock:
            self._fold()
            return self._sum_ns

    def _fold(self) -> None:
        """Under the lock: move buffered raw values into the buckets."""
        n = self._npending
        if not n:
            return
        values = self._pending[:n]
        add = np.bincount(self._index(values))
        self._counts[: add.shape[0]] += add
        self._count += n
        self._max_ns = max(self._max_ns, int(values.max()))
        self._sum_ns += int(values.sum())
        self._npending = 0

    @staticmethod
    def _index(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        v = np.clip(values, 0, (1 << _MAX_EXP) - 1).astype(np.int64)
        _, e = np.frexp(v.astype(np.float64))  # v = m * 2**e with m in [0.5, 1): floor(log2 v) = e - 1
        exp = np.maximum(e.astype(np.int64) - 7, 0)
        big = v >= _LINEAR
        return np.where(big, _LINEAR + (exp - 1) * _HALF + ((v >> exp) - _HALF), v)

    @staticmethod
    def _value(index: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        big = index >= _LINEAR
        exp, sub = np.divmod(np.maximum(index - _LINEAR, 0), _HALF)
        exp = exp + 1
        mid = (sub + _HALF + 0.5) * np.exp2(exp.astype(np.float64))
        return np.where(big, mid, index.astype(np.float64))

    def record(self, values_ns: npt.NDArray[np.int64]) -> None:
        """Add latencies; cost is a copy into a buffer, bucketing happens once per 16k values."""
        n = values_ns.shape[0]
        if n == 0:
            return
        with self._lock:
            if self._npending + n > self._PENDING:
                self._fold()
            if n > self._PENDING:
                self._pending = np.empty(n, dtype=np.int64)
            self._pending[self._npending : self._npending + n] = values_ns
            self._npending += n

    def record_one(self, value_ns: int) -> None:
        """Add one value (a per-batch duration)."""
        with self._lock:
            if self._npending == self._PENDING:
                self._fold()
            self._pending[self._npending] = value_ns
            self._npending += 1

    def cumulative(self, bounds_ns: list[float]) -> list[int]:
        """Counts of values <= each bound (ascending), by bucket midpoints: Prometheus buckets.

        >>> h = LatencyHistogram()
        >>> h.record(np.array([1_000, 5_000, 9_000_000]))
        >>> h.cumulative([2_000.0, 10_000.0, 1e9])
        [1, 2, 3]
        """
        split = _splits(tuple(bounds_ns))
        with self._lock:
            self._fold()
            cum = np.cumsum(self._counts)
        return np.where(split > 0, cum[split - 1], 0).tolist()  # type: ignore[no-any-return]

    def merge(self, other: LatencyHistogram) -> None:
        snap = other.snapshot()
        with self._lock:
            self._fold()
            self._counts += snap._counts
            self._count += snap._count
            self._max_ns = max(self._max_ns, snap._max_ns)
            self._sum_ns += snap._sum_ns

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the buckets hit, count, sum, max) for another process: ``from_dict``."""
        with self._lock:
            self._fold()
            hit = np.flatnonzero(self._counts)
            return {
                "buckets": hit.tolist(),
                "counts": self._counts[hit].tolist(),
                "count": self._count,
                "sum_ns": self._sum_ns,
                "max_ns": self._max_ns,
            }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        h = cls()
        h._counts[np.asarray(data["buckets"], dtype=np.int64)] = np.asarray(data["counts"], dtype=np.int64)
        h._count, h._sum_ns, h._max_ns = int(data["count"]), int(data["sum_ns"]), int(data["max_ns"])
        return h

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile in nanoseconds (0 when empty); ``q=100`` is the exact max."""
        with self._lock:
            self._fold()
            count, max_ns, counts = self._count, self._max_ns, self._counts.copy()
        if count == 0:
            return 0.0
        if q >= 100:
            return float(max_ns)
        rank = max(1, int(np.ceil(count * q / 100.0)))
        i = int(np.searchsorted(np.cumsum(counts), rank))
        return float(min(self._value(np.array([i]))[0], max_ns))

    def summary_ms(self) -> dict[str, float]:
        count, total = self.count, self.sum_ns
        return {
            "p50": round(self.percentile(50) / 1e6, 3),
            "p90": round(self.percentile(90) / 1e6, 3),
            "p99": round(self.percentile(99) / 1e6, 3),
            "p999": round(self.percentile(99.9) / 1e6, 3),
            "max": round(self.max_ns / 1e6, 3),
            "mean": round(total / count / 1e6, 3) if count else 0.0,
        }

    def since(self, earlier: LatencyHistogram) -> LatencyHistogram:
        """What was recorded after ``earlier`` (a ``snapshot`` of this histogram).

        The max of the difference is not kept, so it is the top of the highest bucket hit.
        """
        now = self.snapshot()
        h = LatencyHistogram()
        h._counts = now._counts - earlier._counts
        h._count = now._count - earlier._count
        h._sum_ns = now._sum_ns - earlier._sum_ns
        hit = np.flatnonzero(h._counts)
        h._max_ns = int(self._value(hit[-1:])[0]) if hit.size else 0
        return h

    def snapshot(self) -> LatencyHistogram:
        h = LatencyHistogram()
        with self._lock:
            self._fold()
            h._counts = self._counts.copy()
            h._count, h._max_ns, h._sum_ns = self._count, self._max_ns, self._sum_ns
        return h


_SPLITS: dict[tuple[float, ...], npt.NDArray[np.int64]] = {}


def _splits(bounds_ns: tuple[float, ...]) -> npt.NDArray[np.int64]:
    """For each bound, how many buckets have their midpoint at or below it (the midpoints
    increase with the bucket index); computed once per set of bounds."""
    split = _SPLITS.get(bounds_ns)
    if split is None:
        mids = LatencyHistogram._value(np.arange(_BUCKETS, dtype=np.int64))
        split = np.searchsorted(mids, np.asarray(bounds_ns, dtype=np.float64), side="right").astype(np.int64)
        _SPLITS[bounds_ns] = split
    return split


def histogram_buckets(
    hist: LatencyHistogram, bounds: tuple[float, ...], scale: float
) -> tuple[list[Any], float]:
    """Prometheus (bound, cumulative count) pairs and the sum, from a histogram of raw units."""
    counts = hist.cumulative([b * scale for b in bounds])
    pairs: list[Any] = [(repr(float(b)), c) for b, c in zip(bounds, counts, strict=True)]
    pairs.append(("+Inf", hist.count))
    return pairs, hist.sum_ns / scale
