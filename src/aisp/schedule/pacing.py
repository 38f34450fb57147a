"""Open-loop pacing: events arrive on a fixed schedule, whatever the pipeline is doing.

Event ``k`` is due at ``start + k / rate``. The source hands out the rows that are due, at least
``linger_ms`` worth at a time (so an idle pipeline still gets batches of a useful size), and more
when it is behind, up to the batch it holds. Each row's ingest time is its due time, so a stall
shows up in the measured latency instead of being hidden (no coordinated omission).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt

from aisp.batch import INGEST_NS, Batch
from aisp.errors import ConfigError

__all__ = ["Pacer"]


class Pacer:
    """Arrival schedule at ``rate`` events/s from ``start_ns``.

    >>> p = Pacer(rate=1000.0, linger_ms=2.0, start_ns=0)
    >>> p.take(now_ns=0, available=10)      # one row due, two wanted: wait until the 2nd is due
    (0, 1000000)
    >>> p.take(now_ns=5_000_000, available=10)  # behind: everything due so far
    (6, 0)
    >>> p.times(6).tolist()[:3]
    [0, 1000000, 2000000]
    """

    def __init__(self, rate: float, linger_ms: float, start_ns: int) -> None:
        if rate <= 0:
            raise ConfigError(f"rate must be > 0 events/s, got {rate}")
        self.rate = rate
        self.start_ns = start_ns
        self.sent = 0
        self.min_rows = max(1, int(rate * linger_ms / 1000))
        self._period_ns = 1e9 / rate

    def due_ns(self, k: int) -> int:
        """When event ``k`` (0-based) is due."""
        return self.start_ns + int(k * self._period_ns)

    def take(self, now_ns: int, available: int) -> tuple[int, int]:
        """``(rows to emit now, 0)`` or ``(0, ns to wait until)`` given ``available`` rows in hand."""
        due = int((now_ns - self.start_ns) // self._period_ns) + 1 - self.sent
        want = min(self.min_rows, available)
        if due >= want:
            return min(due, available), 0
        return 0, self.due_ns(self.sent + want - 1)

    def times(self, n: int) -> npt.NDArray[np.int64]:
        """Due times of the next ``n`` events, which are then counted as sent."""
        ks = np.arange(self.sent, self.sent + n, dtype=np.float64)
        self.sent += n
        return (self.start_ns + ks * self._period_ns).astype(np.int64)

    def due(self, held: Batch, stop: threading.Event) -> tuple[Batch, Batch]:
        """The rows of ``held`` due now, stamped with their due times as ingest times, and the
        rest; none (after waiting until the next are due, or ``stop``) when none is due yet."""
        now = time.monotonic_ns()
        n, wait_until = self.take(now, held.num_rows)
        if n == 0:
            stop.wait((wait_until - now) / 1e9)
            return held.slice(0, 0), held
        return held.slice(0, n).with_columns({INGEST_NS: self.times(n)}), held.slice(n)
