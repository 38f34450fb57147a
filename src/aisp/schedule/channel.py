"""Bounded channels between executor tasks, sized in rows.

``put`` blocks while the channel holds ``capacity_rows`` or more, which is how backpressure
travels upstream: a slow stage stalls the task feeding it, and so on up to the source, which
then reads its input more slowly. A batch larger than the capacity is still accepted into an
empty channel, so no batch size can deadlock a pipeline.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from aisp.batch import Batch
from aisp.errors import ConfigError

__all__ = ["Channel"]


class Channel:
    """A multi-producer, single-consumer FIFO of batches bounded by total rows.

    >>> ch = Channel(capacity_rows=10, producers=1)
    >>> ch.put(Batch.from_columns({"x": [1, 2]}, ingest_ns=0)); ch.rows
    2
    >>> ch.close_producer(); ch.get().num_rows, ch.get()
    (2, None)
    """

    def __init__(self, capacity_rows: int, producers: int = 1) -> None:
        if capacity_rows < 1:
            raise ConfigError(f"capacity_rows must be >= 1, got {capacity_rows}")
        self.capacity_rows = capacity_rows
        self._items: deque[tuple[Batch, int]] = deque()  # with the time it was put
        self.last_wait_ns = 0  # how long the batch the consumer got last waited here
        self._rows = 0
        self._open_producers = producers
        self._cond = threading.Condition()
        self.blocked_ns = 0  # total time producers spent waiting for room

    @property
    def rows(self) -> int:
        return self._rows

    def put(self, batch: Batch) -> None:
        n = batch.num_rows
        with self._cond:
            if self._rows and self._rows + n > self.capacity_rows:
                t0 = time.monotonic_ns()
                while self._rows and self._rows + n > self.capacity_rows:
                    self._cond.wait()
                self.blocked_ns += time.monotonic_ns() - t0
            self._items.append((batch, time.monotonic_ns()))
            self._rows += n
            self._cond.notify_all()

    def get(self, max_rows: int = 0) -> Batch | None:
        """The next batch, blocking; ``None`` once every producer closed and the channel is empty.

        With ``max_rows``, the batches queued behind it with the same columns come too, up to
        ``max_rows`` rows in all, as one batch: a consumer that fell behind catches up in
        fewer, larger batches, while one that keeps up gets each batch as it was put (nothing
        ever waits to fill a batch).
        """
        with self._cond:
            while not self._items:
                if self._open_producers <= 0:
                    return None
                self._cond.wait()
            batch, put_ns = self._items.popleft()
            self.last_wait_ns = time.monotonic_ns() - put_ns
            taken, rows = [batch], batch.num_rows
            items = self._items
            while max_rows and items and rows + items[0][0].num_rows <= max_rows:
                if not items[0][0].schema.equals(batch.schema):
                    break
                taken.append(items.popleft()[0])
                rows += taken[-1].num_rows
            self._rows -= rows
            self._cond.notify_all()
        return batch if len(taken) == 1 else _merged(taken)

    def close_producer(self) -> None:
        with self._cond:
            self._open_producers -= 1
            self._cond.notify_all()


def _merged(batches: list[Batch]) -> Batch:
    """``batches`` as one, keeping which events are traced and their producers' trace parents."""
    out = Batch.concat(batches)
    traced = [b.traced for b in batches if b.traced is not None]
    if traced:
        out.traced = np.concatenate(traced)
    parents = [b.traceparents for b in batches if b.traceparents]
    if parents:
        out.traceparents = {k: v for p in parents for k, v in p.items()}
    return out
