"""Session windows: per key, events less than ``gap_ms`` apart form one window
``[first event, last event + gap)``; an event that bridges two open sessions merges them.

The outcome for an event depends on its key's open sessions as they stand when it arrives
(which have closed by then, which it joins), so a batch is processed in rounds in which every
key has at most one row, in arrival order: each round is vectorised across keys (a key's open
sessions are a row of a small table, at most ``width`` of them, grown when needed). An event is
late when it joins no open session and its own window ``[t, t + gap)`` has closed
(``t + gap + allowed lateness <= the watermark before it``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.transform.operators import Emit, OperatorContext
from aisp.transform.stateful import occurrence_rank
from aisp.transform.windows.aggregates import Groups
from aisp.transform.windows.base import END_OF_INPUT, Session, WindowConfig, WindowsBase

__all__ = ["SessionWindowsOp"]

_NONE = -1


class SessionWindowsOp(WindowsBase):
    """Session windows (see the module docstring); ``slots.window`` holds each session's start
    and ``slots.end`` its end (the last event + gap)."""

    def __init__(self, spec: WindowConfig, ctx: OperatorContext) -> None:
        super().__init__(spec, ctx)
        assert isinstance(spec.window, Session)
        self._gap = spec.window.gap_ms
        self._lateness = spec.allowed_lateness_ms
        self._of_key = np.full((1024, 2), _NONE, dtype=np.int64)  # key code -> its sessions' slots
        self._next_close = END_OF_INPUT  # no open session closes before this watermark

    def _bounds(self, slots: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        return self.slots.window[slots], self.slots.end[slots]

    def process(self, batch: Batch) -> Emit:
        if not batch.num_rows:
            return []
        codes, t, wm, own = self._read(batch)
        self._grow_keys(len(self._index))
        rank = occurrence_rank(codes)
        order = np.argsort(rank, kind="stable")
        bounds = np.searchsorted(rank[order], np.arange(int(rank.max()) + 2))
        late: list[npt.NDArray[np.int64]] = []
        values = self._values_of(batch, np.arange(batch.num_rows))
        ids = batch.ids
        for r in range(bounds.shape[0] - 1):
            rows = order[bounds[r] : bounds[r + 1]]
            late.append(self._round(rows, codes[rows], t[rows], own[rows], ids[rows], values))
        missed = np.sort(np.concatenate(late))
        outs = self._late(batch, missed, t[missed], t[missed] + self._gap)
        return self._finish_batch(outs, int(wm[-1]), int(batch.ingest_ns.max()))

    def _round(self, rows: npt.NDArray[np.int64], codes: npt.NDArray[np.int64], t: npt.NDArray[np.int64],
               wm: npt.NDArray[np.int64], ids: npt.NDArray[np.int64],
               values: dict[str, npt.NDArray[Any]]) -> npt.NDArray[np.int64]:  # fmt: skip
        """Rows of distinct keys: join, merge or open sessions; returns the late rows."""
        cand = self._of_key[codes]
        has = cand >= 0
        safe = np.where(has, cand, 0)
        starts, ends = self.slots.window[safe], self.slots.end[safe]
        open_ = has & (ends + self._lateness > wm[:, None])  # closed sessions take nothing more
        joins = open_ & (starts < (t + self._gap)[:, None]) & (t[:, None] < ends)
        joined = joins.any(axis=1)
        is_late = ~joined & (t + self._gap + self._lateness <= wm)
        target = np.full(rows.shape[0], _NONE, dtype=np.int64)
        if joined.any():
            target[joined] = self._merge(
                codes[joined], cand[joined], joins[joined], starts[joined], t[joined]
            )
        new = ~joined & ~is_late
        if new.any():
            target[new] = self._open(codes[new], t[new], ids[new])
        keep = target >= 0
        slots, kept = target[keep], rows[keep]
        if slots.size:
            self.slots.table.add(Groups.of(slots, None), {c: v[kept] for c, v in values.items()}, t[keep])
            self.slots.touched(slots)
        return rows[is_late]

    def _merge(self, codes: npt.NDArray[np.int64], cand: npt.NDArray[np.int64], joins: npt.NDArray[np.bool_],
               starts: npt.NDArray[np.int64], t: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:  # fmt: skip
        """Each row's event joins the sessions ``joins`` marks, merged into the earliest."""
        first = np.argmin(np.where(joins, starts, END_OF_INPUT), axis=1)
        target = cand[np.arange(cand.shape[0]), first]
        others = joins.copy()
        others[np.arange(cand.shape[0]), first] = False
        start = np.minimum(self.slots.window[target], t)
        end = np.maximum(self.slots.end[target], t + self._gap)
        if others.any():
            r, c = np.nonzero(others)
            gone = cand[r, c]
            rank = occurrence_rank(r)  # a row that bridges several sessions merges them in turn
            for k in range(int(rank.max()) + 1):
                self.slots.table.merge_into(target[r[rank == k]], gone[rank == k])
            np.minimum.at(start, r, self.slots.window[gone])
            np.maximum.at(end, r, self.slots.end[gone])
            self._of_key[codes[r], c] = _NONE
            self.slots.give_back(gone)
        self.slots.window[target], self.slots.end[target] = start, end
        out: npt.NDArray[np.int64] = target
        return out

    def _open(
        self, codes: npt.NDArray[np.int64], t: npt.NDArray[np.int64], ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        slots = self.slots.take(codes.shape[0])
        self.slots.code[slots], self.slots.window[slots] = codes, t
        self.slots.end[slots], self.slots.first_id[slots] = t + self._gap, ids
        self._register(slots)
        return slots

    def _register(self, slots: npt.NDArray[np.int64]) -> None:
        """Put ``slots`` (of distinct keys) in their keys' rows of the table."""
        codes = self.slots.code[slots]
        free = self._of_key[codes] == _NONE
        while not free.any(axis=1).all():
            grown = np.full((self._of_key.shape[0], 2 * self._of_key.shape[1]), _NONE, dtype=np.int64)
            grown[:, : self._of_key.shape[1]] = self._of_key
            self._of_key = grown
            free = self._of_key[codes] == _NONE
        self._of_key[codes, np.argmax(free, axis=1)] = slots
        self._next_close = min(self._next_close, int((self.slots.end[slots] + self._lateness).min()))

    def _reopen(self, slots: npt.NDArray[np.int64]) -> None:
        self._grow_keys(int(self.slots.code[slots].max()) + 1)
        order = occurrence_rank(self.slots.code[slots])  # one slot per key at a time
        for r in range(int(order.max()) + 1):
            self._register(slots[order == r])

    def _forget_windows(self) -> None:
        self._of_key = np.full((1024, 2), _NONE, dtype=np.int64)
        self._next_close = END_OF_INPUT

    def _grow_keys(self, keys: int) -> None:
        if keys > self._of_key.shape[0]:
            grown = np.full(
                (max(keys, 2 * self._of_key.shape[0]), self._of_key.shape[1]), _NONE, dtype=np.int64
            )
            grown[: self._of_key.shape[0]] = self._of_key
            self._of_key = grown

    def _close(self, watermark: int) -> npt.NDArray[np.int64]:
        if watermark < self._next_close:
            return np.empty(0, dtype=np.int64)
        slots = self.slots.open_slots()
        closes = self.slots.end[slots] + self._lateness
        done = watermark == END_OF_INPUT
        ready = slots if done else slots[closes <= watermark]
        left = closes if done else closes[closes > watermark]
        self._next_close = int(left.min()) if left.size and not done else END_OF_INPUT
        ready = ready[np.lexsort((self.slots.code[ready], self.slots.window[ready]))]
        codes = self.slots.code[ready]
        column = np.argmax(self._of_key[codes] == ready[:, None], axis=1)
        self._of_key[codes, column] = _NONE
        return ready
