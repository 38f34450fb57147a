"""Keyed state operators: a user function over the batch and a keyed state view, and built-ins."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aisp.batch import KEY, Batch
from aisp.graph import DEFAULT_PORT
from aisp.state.keyed import KeyedState, KeyIndex
from aisp.transform.operators import Emit, Operator, OperatorContext

if TYPE_CHECKING:
    from aisp.state.store import LmdbStateStore

__all__ = ["RunningStats", "StateView", "Stateful", "occurrence_rank"]


def occurrence_rank(codes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """For each row, how many earlier rows of the batch have the same key.

    >>> occurrence_rank(np.array([5, 3, 5, 5, 3])).tolist()
    [0, 0, 1, 2, 1]
    """
    n = codes.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = sorted_codes[1:] != sorted_codes[:-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - group_start
    return rank


class StateView:
    """What a keyed-state function sees: state columns indexed by the batch's key codes.

    ``rounds()`` yields index arrays in which every key appears at most once, in input order, so
    a function can update state with plain fancy indexing and still see its own earlier events.
    """

    def __init__(self, state: KeyedState, codes: npt.NDArray[np.int64]) -> None:
        self._state = state
        self.codes = codes

    def column(self, name: str) -> npt.NDArray[Any]:
        return self._state.column(name)

    def rounds(self) -> list[npt.NDArray[np.int64]]:
        rank = occurrence_rank(self.codes)
        top = int(rank.max()) if rank.size else -1
        if top == 0:
            return [np.arange(self.codes.shape[0])]
        return [np.flatnonzero(rank == r) for r in range(top + 1)]


StateFn = Callable[[Batch, StateView], Batch]


@dataclass(frozen=True)
class Stateful:
    """``fn(batch, state) -> Batch`` over keyed state declared as ``(name, dtype, default)``."""

    fn: StateFn
    space: str
    state: Sequence[tuple[str, str, float]] = ()

    def build(self, ctx: OperatorContext) -> Operator:
        return _StatefulOp(self.fn, ctx.key_index(self.space), self.state, self.space)


class _StatefulOp:
    def __init__(
        self, fn: StateFn, index: KeyIndex, decls: Sequence[tuple[str, str, float]], space: str = ""
    ) -> None:
        self._fn, self._index = fn, index
        self.space = space
        self._state = KeyedState()
        for name, dtype, default in decls:
            self._state.declare(name, dtype, default)
        self._dirty = np.zeros(1024, dtype=bool)  # keys changed since the last take_dirty()
        self._store: LmdbStateStore | None = None  # where evicted keys' state is read back
        self._prefix = b""
        self._known = 0  # codes below this have their state in memory
        self.reloaded = 0
        """Keys whose state was read back from the store (evicted before, seen again)."""

    @property
    def state(self) -> KeyedState:
        return self._state

    def process(self, batch: Batch) -> Emit:
        codes = batch.numpy(KEY)
        n = len(self._index)
        self._state.ensure(n)
        if n > self._dirty.shape[0]:
            self._dirty = np.concatenate([self._dirty, np.zeros(max(n, self._dirty.shape[0]), dtype=bool)])
        if self._store is not None and n > self._known:
            self._reload(np.arange(self._known, n))
            self._known = n
        self._dirty[codes] = True
        return [(DEFAULT_PORT, self._fn(batch, StateView(self._state, codes)))]

    def page_from(self, store: LmdbStateStore, prefix: bytes) -> None:
        """Read the state of keys the index evicted back from ``store`` (entries under
        ``prefix``, as checkpoints write them) when they are seen again."""
        self._store, self._prefix = store, prefix

    def _reload(self, codes: npt.NDArray[np.int64]) -> None:
        assert self._store is not None
        back = codes[self._index.was_evicted(codes)]
        if not back.size:
            return
        from aisp.state.store import encode_names

        values = self._store.latest(encode_names(self._prefix, self._index.keys_of(back)))
        found = [i for i, v in enumerate(values) if v is not None]
        if found:
            rows = np.frombuffer(b"".join(values[i] for i in found), dtype=self._state.row_dtype())  # type: ignore[misc]
            at = back[found]
            for name in self._state.names:
                self._state.column(name)[at] = rows[name]
        self.reloaded += int(back.size)

    def evict(self, survivors: npt.NDArray[np.int64]) -> None:
        """Keep only ``survivors``' state, renumbered as the index did (``KeyIndex.evict``); the
        rest is in the store already (called right after ``take_dirty``)."""
        self._state = self._state.take(survivors)
        self._dirty = np.zeros(max(1024, 2 * survivors.shape[0]), dtype=bool)
        self._known = survivors.shape[0]

    @property
    def index(self) -> KeyIndex:
        return self._index

    def take_dirty(self) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]:
        """The codes whose state changed since the last call, and their state; resets the marks."""
        codes = np.flatnonzero(self._dirty[: len(self._index)])
        self._dirty[:] = False
        return codes, self.rows(codes)

    def rows(self, codes: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        """Copies of the state of ``codes``."""
        self._state.ensure(len(self._index))  # keys the index has that never reached this step
        return {name: self._state.column(name)[codes].copy() for name in self._state.names}

    def restore_rows(self, codes: npt.NDArray[np.int64], columns: Mapping[str, npt.NDArray[Any]]) -> None:
        """Put ``columns`` back at ``codes`` (a restore from the state store)."""
        if codes.size:
            self._state.ensure(int(codes.max()) + 1)
            for name, values in columns.items():
                self._state.column(name)[codes] = values

    def flush(self) -> Emit:
        return []

    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        return self._state.snapshot(len(self._index))

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        n = len(next(iter(columns.values()))) if columns else 0
        self.restore_rows(np.arange(n), columns)


@dataclass(frozen=True)
class RunningStats:
    """Per-key running count, sum and mean of ``column``, including the current event.

    Adds the columns named by ``count``/``sum``/``mean`` (``None`` skips one). Updates happen in
    input order with float64 sums, exactly as a sequential loop would compute them.
    """

    column: str
    space: str
    count: str | None = "count"
    sum: str | None = None
    mean: str | None = "mean"

    def build(self, ctx: OperatorContext) -> Operator:
        decls = [("__count", "int64", 0), ("__sum", "float64", 0.0)]
        return _StatefulOp(self._update, ctx.key_index(self.space), decls, self.space)

    def _update(self, batch: Batch, state: StateView) -> Batch:
        values = batch.numpy(self.column).astype(np.float64, copy=False)
        counts, sums = state.column("__count"), state.column("__sum")
        codes = state.codes
        n_out = np.empty(codes.shape[0], dtype=np.int64)
        s_out = np.empty(codes.shape[0], dtype=np.float64)
        for rows in state.rounds():
            keys = codes[rows]
            n_new = counts[keys] + 1
            s_new = sums[keys] + values[rows]
            counts[keys] = n_new
            sums[keys] = s_new
            n_out[rows] = n_new
            s_out[rows] = s_new
        cols: dict[str, npt.NDArray[np.generic]] = {}
        if self.count:
            cols[self.count] = n_out
        if self.sum:
            cols[self.sum] = s_out
        if self.mean:
            cols[self.mean] = s_out / n_out
        return batch.with_columns(cols)
