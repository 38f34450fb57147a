"""What the image and audio operators share: the counters of their work and the pool they decode on.

``MediaCounters`` is kept by an image or audio step's spec and read off the graph as metrics
(``aisp.observe.operator_counters``): items decoded and refused, bytes in, seconds spent
decoding (summed over the pool's threads) and the pixels or samples made. ``decode_pool`` is a
thread pool sized to the cores: OpenCV, libsndfile and soxr release the GIL while they work, so
one step's rows decode on every core at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aisp.batch import Batch
from aisp.transform.operators import OperatorContext

__all__ = ["MediaCounters", "dead_letter_rows", "decode_pool", "run_sliced"]

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def decode_pool(threads: int = 0) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` threads (0: one per core), shared by the steps that
    ask for the same size."""
    size = threads or os.cpu_count() or 1
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="aisp-decode")
        return pool


def run_sliced(
    pool: ThreadPoolExecutor, rows: int, fn: Callable[[int, int], T], min_rows: int = 2
) -> list[T]:
    """``fn(start, end)`` over ``rows`` cut into one contiguous slice per pool thread (at least
    ``min_rows`` rows each), in parallel; the results in slice order."""
    parts = max(1, min(pool._max_workers, rows // max(1, min_rows)))
    if parts == 1:
        return [fn(0, rows)]
    bounds = [rows * i // parts for i in range(parts + 1)]
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(parts)]
    return [f.result() for f in futures]


def dead_letter_rows(ctx: OperatorContext, batch: Batch, bad: Sequence[tuple[int, str]]) -> None:
    """Send each ``(row, reason)`` of ``batch`` to the dead-letter sink, rows with the same
    reason together."""
    by_reason: dict[str, list[int]] = {}
    for row, reason in bad:
        by_reason.setdefault(reason, []).append(row)
    for reason, rows in by_reason.items():
        ctx.dead_letter(batch.take(rows), ctx.step_id, reason)


class MediaCounters:
    """What an image or audio step did (see the module docstring); ``unit`` is what it makes:
    ``pixels`` or ``samples``."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self._lock = threading.Lock()
        self.items = 0
        self.refused = 0
        self.bytes = 0
        self.decode_ns = 0
        self.units = 0

    def add(self, *, items: int, refused: int, nbytes: int, decode_ns: int, units: int) -> None:
        with self._lock:
            self.items += items
            self.refused += refused
            self.bytes += nbytes
            self.decode_ns += decode_ns
            self.units += units

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "unit": self.unit,
                "items": self.items,
                "refused": self.refused,
                "bytes": self.bytes,
                "decode_seconds": self.decode_ns / 1e9,
                "units": self.units,
            }
