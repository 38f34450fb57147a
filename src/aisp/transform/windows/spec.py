"""Windows on keyed streams: tumbling, sliding and session windows over event time.

A window step reads rows stamped with event time and watermarks (``aisp.transform.windows.event_time``)
and keeps, per key, the open windows' aggregate state in numpy columns (``aggregates``). For
each batch it assigns every row to its windows, updates all touched windows at once (grouped
reductions, no loop over events), and emits one row per window whose end plus the allowed
lateness the watermark has reached: ``{key, window_start, window_end, <aggregates>}``. At the
end of the input every window still open is emitted.

An event is *late* when every window it belongs to has closed (end + allowed lateness <= the
watermark before it): it goes to the dead letters with reason ``late`` and the window it missed
(or to the step's ``late`` port, or is dropped, per ``late``). With ``early_every_ms`` the step
also emits the windows that changed, at most that often (processing time), marked
``final: false``; the final row of each window is ``final: true``.

Window state is in checkpoints (``snapshot``/``restore``), so a restored pipeline emits each
window once. Output rows carry ``_event_time`` = window end - 1 and the step's watermark, so
windows can follow windows; their ``_id`` is a hash of the window's first event and its start.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.transform.operators import Emit, Operator, OperatorContext
from aisp.transform.windows.aggregates import Groups
from aisp.transform.windows.base import (
    END_OF_INPUT,
    LATE_PORT,
    Session,
    Sliding,
    Tumbling,
    WindowConfig,
    WindowsBase,
    window_ids,
)
from aisp.transform.windows.sessions import SessionWindowsOp
from aisp.transform.windows.state import PairIndex, RingIndex

__all__ = [
    "LATE_PORT",
    "AlignedWindowsOp",
    "Session",
    "SessionWindowsOp",
    "Sliding",
    "Tumbling",
    "WindowSpec",
    "window_ids",
]


@dataclass(frozen=True, kw_only=True)
class WindowSpec(WindowConfig):
    """A window step's configuration (``KeyedStream.window`` builds it).

    >>> WindowSpec(window=Tumbling(10), aggregates=(), space="s", key_column="k")
    Traceback (most recent call last):
    ...
    aisp.errors.ConfigError: a window needs at least one aggregate
    """

    def build(self, ctx: OperatorContext) -> Operator:
        if isinstance(self.window, Session):
            return SessionWindowsOp(self, ctx)
        return AlignedWindowsOp(self, ctx)


class AlignedWindowsOp(WindowsBase):
    """Tumbling and sliding windows. Window ``w`` starts at ``w * step + offset``; the slot of
    (key, ``w``) is found for a whole batch at once (``RingIndex``; a ``PairIndex`` once keys x
    open window indices outgrow ``RING_BUDGET``). The open windows are kept per index too (a
    heap of indices, and the slots opened for each), so closing costs only the windows that
    close."""

    RING_BUDGET = 1 << 24
    """Entries (4 bytes each) the ring index may hold before the hash table takes over."""

    def __init__(self, spec: WindowConfig, ctx: OperatorContext) -> None:
        super().__init__(spec, ctx)
        w = spec.window
        assert isinstance(w, Tumbling | Sliding)
        self._size, self._step, self._offset = w.size_ms, w.step_ms, w.offset_ms
        self._per_event = -(-self._size // self._step)
        self._pairs: RingIndex | PairIndex = RingIndex(self.RING_BUDGET)
        self._open: dict[int, list[npt.NDArray[np.int64]]] = {}  # window index -> its slots
        self._heap: list[int] = []

    def _closes(self, w: Any) -> Any:
        return w * self._step + self._offset + self._size + self.spec.allowed_lateness_ms

    def _bounds(self, slots: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        starts = self.slots.window[slots] * self._step + self._offset
        return starts, starts + self._size

    def process(self, batch: Batch) -> Emit:
        if not batch.num_rows:
            return []
        codes, t, wm, own = self._read(batch)
        idx = ((t - self._offset) // self._step)[:, None] - np.arange(self._per_event)[None, :]
        starts = idx * self._step + self._offset
        take = (starts + self._size > t[:, None]) & (self._closes(idx) > own[:, None])
        missed = np.flatnonzero(~take.any(axis=1))  # the window each missed: its latest
        outs = self._late(batch, missed, starts[missed, 0], starts[missed, 0] + self._size)
        rows, j = np.nonzero(take)
        if rows.size:
            slots = self._slots_of(codes[rows], idx[rows, j], batch.ids[rows])
            table = self.slots.table
            table.add(
                Groups.of(slots, t[rows] if table.by_time else None), self._values_of(batch, rows), t[rows]
            )
            self.slots.touched(slots)
        return self._finish_batch(outs, int(wm[-1]), int(batch.ingest_ns.max()))

    def _slots_of(self, codes: npt.NDArray[np.int64], windows: npt.NDArray[np.int64],
                  ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:  # fmt: skip
        """The slot of each (key, window), opening the windows not open yet."""
        slots = self._pairs.find(codes, windows)
        new = np.flatnonzero(slots < 0)
        if not new.size:
            return slots
        nc, nw = codes[new], windows[new]
        order = np.lexsort((nw, nc))  # stable: each pair's first row comes first
        sc, sw = nc[order], nw[order]
        change = np.ones(order.shape[0], dtype=bool)
        change[1:] = (sc[1:] != sc[:-1]) | (sw[1:] != sw[:-1])
        group = np.cumsum(change) - 1
        heads = order[change]
        fresh = self.slots.take(heads.shape[0])
        self.slots.code[fresh], self.slots.window[fresh] = nc[heads], nw[heads]
        self.slots.first_id[fresh] = ids[new][heads]
        self._index_pairs(nc[heads], nw[heads], fresh)
        self._register(fresh)
        inverse = np.empty(order.shape[0], dtype=np.int64)
        inverse[order] = group
        slots[new] = fresh[inverse]
        return slots

    def _register(self, slots: npt.NDArray[np.int64]) -> None:
        windows = self.slots.window[slots]
        for w in np.unique(windows).tolist():
            if w not in self._open:
                self._open[w] = []
                heapq.heappush(self._heap, w)
            self._open[w].append(slots[windows == w])

    def _index_pairs(self, codes: npt.NDArray[np.int64], windows: npt.NDArray[np.int64],
                     slots: npt.NDArray[np.int64]) -> None:  # fmt: skip
        """Index new (key, window) -> slot pairs: in the ring while it fits its memory budget
        (keys x window indices open at once), else, from then on, in a hash table."""
        if isinstance(self._pairs, RingIndex):
            if self._pairs.insert(codes, windows, slots):
                return
            held = self._pairs.pairs()
            self._pairs = PairIndex()
            if held[0].size:
                self._pairs.insert(*held)
        self._pairs.insert(codes, windows, slots)

    def _reopen(self, slots: npt.NDArray[np.int64]) -> None:
        self._index_pairs(self.slots.code[slots], self.slots.window[slots], slots)
        self._register(slots)

    def _forget_windows(self) -> None:
        self._pairs = RingIndex(self.RING_BUDGET)
        self._open, self._heap = {}, []

    def _close(self, watermark: int) -> npt.NDArray[np.int64]:
        ready: list[npt.NDArray[np.int64]] = []
        while self._heap and (watermark == END_OF_INPUT or self._closes(self._heap[0]) <= watermark):
            ready.append(np.concatenate(self._open.pop(heapq.heappop(self._heap))))
        if not ready:
            return np.empty(0, dtype=np.int64)
        slots = np.concatenate(ready)
        slots = slots[np.lexsort((self.slots.code[slots], self.slots.window[slots]))]
        self._pairs.delete(self.slots.code[slots], self.slots.window[slots])
        return slots
