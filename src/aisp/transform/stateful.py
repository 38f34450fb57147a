"""Keyed state operators: a user function over the batch and a keyed state view, and built-ins."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import KEY, Batch
from aisp.graph import DEFAULT_PORT
from aisp.state.keyed import KeyedState, KeyIndex
from aisp.transform.operators import Emit, Operator, OperatorContext

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

    @property
    def state(self) -> KeyedState:
        return self._state

    def process(self, batch: Batch) -> Emit:
        codes = batch.numpy(KEY)
        n = len(self._index)
        self._state.ensure(n)
        if n > self._dirty.shape[0]:
            self._dirty = np.concatenate([self._dirty, np.zeros(max(n, self._dirty.shape[0]), dtype=bool)])
        self._dirty[codes] = True
        return [(DEFAULT_PORT, self._fn(batch, StateView(self._state, codes)))]

    @property
    def index(self) -> KeyIndex:
        return self._index

    def take_dirty(self) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]:
        """The codes whose state changed since the last call, and their state; resets the marks."""
        codes = np.flatnonzero(self._dirty[: len(self._index)])
        self._dirty[:] = False
        return codes, {name: self._state.column(name)[codes].copy() for name in self._state.names}

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
