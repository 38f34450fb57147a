"""Open windows' state: slots of numpy columns, and a vectorised (key, window) -> slot index.

Every open window has a slot; its key code, its start (or window index), the id of the event
that opened it and the aggregates' state columns (``AggTable``) are entries of arrays at that
slot. ``PairIndex`` finds the slots of a whole batch's (key, window) pairs at once (open
addressing over numpy arrays, as ``aisp.state.keyed``'s key table, with deletion).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import matrix_column
from aisp.transform.windows.aggregates import Aggregate, Groups

__all__ = ["AggTable", "PairIndex", "RingIndex", "Slots"]

_FREE, _GONE = -1, -2  # a cell never used / a cell whose pair was deleted
_NO_WINDOW = np.iinfo(np.int64).min


def _mix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = a.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ b.view(np.uint64) * np.uint64(
            0xC2B2AE3D27D4EB4F
        )
        z ^= z >> np.uint64(29)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(32)
    return z


class PairIndex:
    """(a, b) int64 pairs -> slot, probed for a whole batch at once; deletions leave tombstones,
    and the table is rebuilt when live pairs and tombstones fill a third of it.

    >>> ix = PairIndex()
    >>> ix.insert(np.array([1, 2]), np.array([10, 10]), np.array([0, 1]))
    >>> ix.find(np.array([2, 1, 3]), np.array([10, 10, 10])).tolist()
    [1, 0, -1]
    >>> ix.delete(np.array([1]), np.array([10])); ix.find(np.array([1, 2]), np.array([10, 10])).tolist()
    [-1, 1]
    """

    def __init__(self, bits: int = 12) -> None:
        self._bits = bits
        self._mask = (1 << bits) - 1
        self._a = np.zeros(1 << bits, dtype=np.int64)
        self._b = np.zeros(1 << bits, dtype=np.int64)
        self._slot = np.full(1 << bits, _FREE, dtype=np.int64)
        self.size = 0
        self._gone = 0

    def __len__(self) -> int:
        return self.size

    def _start(
        self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        h = _mix(a, b)
        first = (h >> np.uint64(64 - self._bits)).astype(np.int64)
        step = (h & np.uint64(self._mask)).astype(np.int64) | 1
        return first, step

    def _cells(self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The cell holding each pair, or -1."""
        out = np.full(a.shape[0], -1, dtype=np.int64)
        rows = np.arange(a.shape[0])
        cells, steps = self._start(a, b)
        while rows.size:
            slot = self._slot[cells]
            found = (slot >= 0) & (self._a[cells] == a[rows]) & (self._b[cells] == b[rows])
            out[rows[found]] = cells[found]
            go_on = (slot != _FREE) & ~found
            rows, steps = rows[go_on], steps[go_on]
            cells = (cells[go_on] + steps) & self._mask
        return out

    def find(self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The slot of each pair, or -1 where absent."""
        cells = self._cells(a, b)
        return np.where(cells >= 0, self._slot[np.maximum(cells, 0)], -1)

    def insert(
        self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64], slots: npt.NDArray[np.int64]
    ) -> None:
        """Add distinct pairs that are absent."""
        if 3 * (self.size + self._gone + a.shape[0]) > (1 << self._bits):
            self._rebuild(self.size + a.shape[0])
        rows = np.arange(a.shape[0])
        cells, steps = self._start(a, b)
        while rows.size:
            free = self._slot[cells] < 0
            _, first = np.unique(cells[free], return_index=True)  # one winner per free cell
            win = np.flatnonzero(free)[first]
            at = cells[win]
            self._gone -= int(np.count_nonzero(self._slot[at] == _GONE))
            self._a[at], self._b[at], self._slot[at] = a[rows[win]], b[rows[win]], slots[rows[win]]
            left = np.ones(rows.shape[0], dtype=bool)
            left[win] = False
            rows, cells, steps = rows[left], cells[left], steps[left]
            taken = self._slot[cells] >= 0
            cells[taken] = (cells[taken] + steps[taken]) & self._mask
        self.size += a.shape[0]

    def delete(self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> None:
        """Remove pairs that are present."""
        cells = self._cells(a, b)
        cells = cells[cells >= 0]
        self._slot[cells] = _GONE
        self.size -= cells.shape[0]
        self._gone += cells.shape[0]

    def _rebuild(self, need: int) -> None:
        live = self._slot >= 0
        a, b, slots = self._a[live], self._b[live], self._slot[live]
        bits = 12
        while 6 * need > (1 << bits):  # room to insert and delete a while before the next rebuild
            bits += 1
        self.__init__(bits)  # type: ignore[misc]
        if a.size:
            self.insert(a, b, slots)


class RingIndex:
    """(key code, window index) -> slot for aligned windows, as a matrix: window ``w`` is row
    ``w % rows`` (the rows outnumber the window indices open at once), the key code the column.
    A lookup for a whole batch is one fancy index; closing a window clears its row. Memory is
    rows x keys entries, so ``insert`` answers False when it would need more than ``budget``
    (the caller moves to a ``PairIndex``).

    >>> ix = RingIndex()
    >>> ix.insert(np.array([0, 5]), np.array([7, 8]), np.array([10, 11]))
    True
    >>> ix.find(np.array([5, 0, 0, 9]), np.array([8, 7, 8, 7])).tolist()
    [11, 10, -1, -1]
    >>> ix.delete(np.array([0]), np.array([7])); ix.find(np.array([0]), np.array([7])).tolist()
    [-1]
    """

    def __init__(self, budget: int = 1 << 24) -> None:
        self.budget = budget
        self._slot = np.full((4, 1024), -1, dtype=np.int32)
        self._window = np.full(4, _NO_WINDOW, dtype=np.int64)  # the window index each row holds

    def find(self, codes: npt.NDArray[np.int64], windows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        rows, keys = self._slot.shape
        r = windows % rows
        ok = (self._window[r] == windows) & (codes < keys)
        found = self._slot[r, np.where(ok, codes, 0)].astype(np.int64)
        return np.where(ok, found, -1)

    def insert(
        self, codes: npt.NDArray[np.int64], windows: npt.NDArray[np.int64], slots: npt.NDArray[np.int64]
    ) -> bool:
        """Add absent pairs; False (nothing added) when the matrix would outgrow the budget."""
        rows, keys = self._slot.shape
        need_keys = max(keys, int(codes.max()) + 1)
        held = self._window[windows % rows]
        if ((held != _NO_WINDOW) & (held != windows)).any() or self._clash(windows, rows):
            every = np.union1d(self._window[self._window != _NO_WINDOW], windows)
            span = int(every.max() - every.min())
            rows = max(2 * rows, 1 << span.bit_length())  # more rows than the span: none shared
        if need_keys > keys:
            need_keys = max(need_keys, 2 * keys)
        if (rows, need_keys) != self._slot.shape:
            if rows * need_keys > self.budget:
                return False
            self._resize(rows, need_keys)
        r = windows % rows
        self._window[r] = windows
        self._slot[r, codes] = slots
        return True

    @staticmethod
    def _clash(windows: npt.NDArray[np.int64], rows: int) -> bool:
        """Two of ``windows`` would share a row."""
        distinct = np.unique(windows)
        return bool(np.unique(distinct % rows).shape[0] < distinct.shape[0])

    def _resize(self, rows: int, keys: int) -> None:
        old_slot, old_window = self._slot, self._window
        self._slot = np.full((rows, keys), -1, dtype=np.int32)
        self._window = np.full(rows, _NO_WINDOW, dtype=np.int64)
        for r in np.flatnonzero(old_window != _NO_WINDOW).tolist():
            w = int(old_window[r])
            self._window[w % rows] = w
            self._slot[w % rows, : old_slot.shape[1]] = old_slot[r]

    def delete(self, codes: npt.NDArray[np.int64], windows: npt.NDArray[np.int64]) -> None:
        """Remove pairs; a window whose pairs are all removed frees its row (windows close
        whole: every key's window ``w`` at once)."""
        rows = self._slot.shape[0]
        self._slot[windows % rows, codes] = -1
        for w in np.unique(windows).tolist():
            r = w % rows
            if self._window[r] == w and not (self._slot[r] >= 0).any():
                self._window[r] = _NO_WINDOW

    def pairs(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Every (code, window, slot) held."""
        r, c = np.nonzero(self._slot >= 0)
        return c.astype(np.int64), self._window[r], self._slot[r, c].astype(np.int64)


class AggTable:
    """The aggregates' state columns, one entry (or fixed-width row) per slot."""

    def __init__(self, aggregates: Sequence[tuple[str, Aggregate]], capacity: int) -> None:
        self.aggregates = tuple(aggregates)
        self.by_time = any(agg.by_time for _, agg in self.aggregates)
        """Whether rows must be grouped in event-time order (``Groups.of`` with times)."""
        self._decl: dict[str, tuple[np.dtype[Any], Any, tuple[int, ...]]] = {}
        for name, agg in self.aggregates:
            for col, decl in agg.init().items():
                width: tuple[int, ...] = tuple(decl[2:3])
                self._decl[f"{name}.{col}"] = (np.dtype(decl[0]), decl[1], width)
        self.columns = {k: self._new(k, capacity) for k in self._decl}

    def _new(self, key: str, capacity: int) -> npt.NDArray[Any]:
        dtype, fill, width = self._decl[key]
        return np.full((capacity, *width), fill, dtype)

    def grow(self, capacity: int) -> None:
        for k in self._decl:
            new = self._new(k, capacity)
            old = self.columns[k]
            new[: old.shape[0]] = old
            self.columns[k] = new

    def reset(self, slots: npt.NDArray[np.int64]) -> None:
        for k, (_, fill, _) in self._decl.items():
            self.columns[k][slots] = fill

    def _state(self, name: str, agg: Aggregate, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        return {col: self.columns[f"{name}.{col}"][slots] for col in agg.init()}

    def _store(self, name: str, slots: npt.NDArray[np.int64], state: Mapping[str, npt.NDArray[Any]]) -> None:
        for col, v in state.items():
            self.columns[f"{name}.{col}"][slots] = v

    def add(
        self, groups: Groups, values: Mapping[str, npt.NDArray[Any]], times: npt.NDArray[np.int64]
    ) -> None:
        """Merge each group's rows into the slot ``groups.keys`` names (``values`` by aggregate
        name, rows in arrival order)."""
        slots = groups.keys
        sorted_times = groups.sorted(times)
        empty = np.empty(0)
        for name, agg in self.aggregates:
            rows = groups.sorted(values[name]) if agg.column is not None else empty
            self._store(
                name, slots, agg.merge(self._state(name, agg, slots), agg.update(groups, rows, sorted_times))
            )

    def merge_into(self, into: npt.NDArray[np.int64], other: npt.NDArray[np.int64]) -> None:
        """Merge slot ``other[i]`` (later events) into slot ``into[i]``."""
        for name, agg in self.aggregates:
            self._store(name, into, agg.merge(self._state(name, agg, into), self._state(name, agg, other)))

    def results(self, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        return {name: agg.result(self._state(name, agg, slots)) for name, agg in self.aggregates}

    def take(self, slots: npt.NDArray[np.int64]) -> dict[str, Any]:
        """The state of ``slots`` as checkpoint columns (``Aggregate.dump``; a fixed-width
        state as an Arrow fixed-size list)."""
        out: dict[str, Any] = {}
        for name, agg in self.aggregates:
            for col, v in agg.dump(self._state(name, agg, slots)).items():
                out[f"{name}.{col}"] = matrix_column(v) if v.ndim == 2 else v
        return out

    def put(self, slots: npt.NDArray[np.int64], columns: Mapping[str, Any]) -> None:
        for name, agg in self.aggregates:
            state = {}
            for col in agg.init():
                v = np.asarray(columns[f"{name}.{col}"])
                if v.dtype == object and v.size and isinstance(v[0], np.ndarray):  # a fixed-size list
                    v = np.stack(list(v))
                state[col] = v
            self._store(name, slots, agg.load(state))


class Slots:
    """Open windows' slots: per slot the key code, the window (its index or start), the end
    (sessions), the id of the event that opened it, whether it changed since the last early
    result, and the aggregates' state; freed slots are reused.

    For checkpoints that write only what changed (``changes``), each window also has a serial
    number (``uid``, never reused) and a flag saying it changed since the last ``changes``, and
    the serials of the windows freed since then are kept."""

    def __init__(self, aggregates: Sequence[tuple[str, Aggregate]], capacity: int = 1024) -> None:
        self.code = np.zeros(capacity, dtype=np.int64)
        self.window = np.zeros(capacity, dtype=np.int64)
        self.end = np.zeros(capacity, dtype=np.int64)
        self.first_id = np.zeros(capacity, dtype=np.int64)
        self.dirty = np.zeros(capacity, dtype=bool)
        self.live = np.zeros(capacity, dtype=bool)
        self.uid = np.zeros(capacity, dtype=np.int64)
        self.changed = np.zeros(capacity, dtype=bool)
        self.table = AggTable(aggregates, capacity)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: the top is last
        self._top = capacity
        self._next_uid = 0
        self._gone: list[npt.NDArray[np.int64]] = []

    def __len__(self) -> int:
        return int(self.code.shape[0] - self._top)

    def take(self, n: int) -> npt.NDArray[np.int64]:
        """``n`` free slots (reset), growing when needed."""
        if n > self._top:
            self._grow(max(2 * self.code.shape[0], len(self) + n))
        slots = self._free[self._top - n : self._top][::-1].copy()
        self._top -= n
        self.live[slots] = True
        self.table.reset(slots)
        self.dirty[slots] = False
        self.changed[slots] = True
        self.uid[slots] = np.arange(self._next_uid, self._next_uid + n)
        self._next_uid += n
        return slots

    def touched(self, slots: npt.NDArray[np.int64]) -> None:
        """``slots``' state changed (they are due in the next early result and checkpoint)."""
        self.dirty[slots] = True
        self.changed[slots] = True

    def give_back(self, slots: npt.NDArray[np.int64]) -> None:
        self._gone.append(self.uid[slots])
        self.changed[slots] = False
        self.live[slots] = False
        self._free[self._top : self._top + slots.shape[0]] = slots[::-1]
        self._top += slots.shape[0]

    def _grow(self, capacity: int) -> None:
        old = self.code.shape[0]
        for name in ("code", "window", "end", "first_id", "dirty", "live", "uid", "changed"):
            arr = getattr(self, name)
            new = np.zeros(capacity, dtype=arr.dtype)
            new[:old] = arr
            setattr(self, name, new)
        self.table.grow(capacity)
        free = np.empty(capacity, dtype=np.int64)
        free[: self._top] = self._free[: self._top]
        added = np.arange(capacity - 1, old - 1, -1, dtype=np.int64)
        free[self._top : self._top + added.shape[0]] = added
        self._top += added.shape[0]
        self._free = free

    def open_slots(self) -> npt.NDArray[np.int64]:
        return np.flatnonzero(self.live)

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        cols = {"__code": self.code[slots], "__window": self.window[slots], "__end": self.end[slots],
                "__first_id": self.first_id[slots], "__uid": self.uid[slots]}  # fmt: skip
        cols.update(self.table.take(slots))
        return cols

    def changes(self, *, everything: bool) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The open slots that changed since the last call (``everything``: all open slots) and
        the serials of the windows freed since then; from now on nothing has changed."""
        slots = np.flatnonzero(self.live if everything else self.changed & self.live)
        gone = np.concatenate(self._gone) if self._gone else np.empty(0, dtype=np.int64)
        self.changed[:] = False
        self._gone = []
        return slots, gone

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.int64]:
        """Open a slot per row of ``columns`` (a ``snapshot``); returns them."""
        slots = self.take(int(columns["__code"].shape[0]))
        self.code[slots] = columns["__code"]
        self.window[slots] = columns["__window"]
        self.end[slots] = columns["__end"]
        self.first_id[slots] = columns["__first_id"]
        if "__uid" in columns:  # as stored: the next changes name the same windows
            self.uid[slots] = columns["__uid"]
            self.changed[slots] = False
            if slots.size:
                self._next_uid = max(self._next_uid, int(self.uid[slots].max()) + 1)
        self.table.put(slots, columns)
        return slots
