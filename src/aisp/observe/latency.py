"""A vectorised latency histogram with HDR-style log-linear buckets (about 1% relative error).

``record(values_ns)`` takes a whole numpy array at once, so a sink records the end-to-end
latency of every event of a batch with one ``bincount``.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

__all__ = ["LatencyHistogram"]

_LINEAR = 128  # values below this are counted exactly
_HALF = 64  # sub-buckets per power of two above it -> <= 0.8% relative error (bucket midpoints)
_MAX_EXP = 48  # up to 2**48 ns ~ 78 hours
_BUCKETS = _LINEAR + _MAX_EXP * _HALF


class LatencyHistogram:
    """Counts of nanosecond latencies.

    >>> h = LatencyHistogram()
    >>> h.record(np.array([1_000_000, 2_000_000, 3_000_000]))
    >>> round(h.percentile(50) / 1e6, 2), h.count
    (2.0, 3)
    """

    def __init__(self) -> None:
        self._counts = np.zeros(_BUCKETS, dtype=np.int64)
        self._lock = threading.Lock()
        self.count = 0
        self.max_ns = 0
        self.sum_ns = 0

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
        if values_ns.size == 0:
            return
        idx = self._index(values_ns)
        add = np.bincount(idx)
        with self._lock:
            self._counts[: add.shape[0]] += add
            self.count += int(values_ns.size)
            self.max_ns = max(self.max_ns, int(values_ns.max()))
            self.sum_ns += int(values_ns.sum())

    def merge(self, other: LatencyHistogram) -> None:
        with self._lock:
            self._counts += other._counts
            self.count += other.count
            self.max_ns = max(self.max_ns, other.max_ns)
            self.sum_ns += other.sum_ns

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile in nanoseconds (0 when empty); ``q=100`` is the exact max."""
        if self.count == 0:
            return 0.0
        if q >= 100:
            return float(self.max_ns)
        rank = max(1, int(np.ceil(self.count * q / 100.0)))
        cum = np.cumsum(self._counts)
        i = int(np.searchsorted(cum, rank))
        return float(min(self._value(np.array([i]))[0], self.max_ns))

    def summary_ms(self) -> dict[str, float]:
        return {
            "p50": round(self.percentile(50) / 1e6, 3),
            "p99": round(self.percentile(99) / 1e6, 3),
            "p999": round(self.percentile(99.9) / 1e6, 3),
            "max": round(self.max_ns / 1e6, 3),
            "mean": round(self.sum_ns / self.count / 1e6, 3) if self.count else 0.0,
        }

    def snapshot(self) -> LatencyHistogram:
        h = LatencyHistogram()
        with self._lock:
            h._counts = self._counts.copy()
            h.count, h.max_ns, h.sum_ns = self.count, self.max_ns, self.sum_ns
        return h
