"""Vectorised, mergeable aggregates for windows.

An aggregate keeps its state in fixed-width numpy columns, one entry per open window, and
follows a four-step interface that user-defined aggregates implement too:

* ``init()``: the state columns, ``{name: (dtype, fill)}``;
* ``update(groups, values, times)``: the partial state of each group of a batch's rows (one
  group per window), computed for all groups at once (``Groups.reduce`` is ``ufunc.reduceat``);
* ``merge(a, b)``: two states combined entry by entry, ``a`` holding the earlier events (a
  window's state with a batch's partial, or two sessions that a late event joined);
* ``result(state)``: the output column.

Rows reach ``update`` sorted by group, in arrival order; an aggregate with ``by_time`` gets
them by event time within a group (ties in arrival order), so ``First`` and ``Last`` are the
earliest and latest events by event time.

>>> g = Groups.of(np.array([0, 1, 0, 1, 1]), np.array([5, 3, 1, 4, 2]))
>>> s = Sum("x").update(g, g.sorted(np.array([1.0, 2.0, 3.0, 4.0, 5.0])), g.sorted(np.arange(5)))
>>> s["sum"].tolist()
[4.0, 11.0]
>>> m = Max("x")
>>> m.result(m.merge({"max": np.array([7.0, 1.0])}, {"max": np.array([3.0, 9.0])})).tolist()
[7.0, 9.0]
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "Aggregate",
    "Count",
    "First",
    "Groups",
    "Last",
    "Max",
    "Mean",
    "Min",
    "State",
    "Std",
    "Sum",
    "Var",
]

State = dict[str, npt.NDArray[Any]]
_BIG = np.iinfo(np.int64).max
_SMALL = np.iinfo(np.int64).min


@dataclass(frozen=True)
class Groups:
    """A batch's rows grouped: ``order`` sorts rows by group, then by time (stable, so ties keep
    arrival order); ``starts`` is where each group begins in that order; ``keys`` the groups."""

    order: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    keys: npt.NDArray[np.int64]

    @classmethod
    def of(cls, group: npt.NDArray[np.int64], times: npt.NDArray[np.int64] | None) -> Groups:
        """Rows grouped by ``group``, by ``times`` within a group (None: arrival order only)."""
        order = np.argsort(group, kind="stable") if times is None else np.lexsort((times, group))
        g = group[order]
        n = g.shape[0]
        change = np.ones(n, dtype=bool)
        change[1:] = g[1:] != g[:-1]
        starts = np.flatnonzero(change)
        sizes = np.diff(np.append(starts, n))
        return cls(order=order, starts=starts, sizes=sizes, keys=g[starts])

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def sorted(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``values`` (one per row, in arrival order) in group order."""
        return values[self.order]

    def reduce(self, ufunc: np.ufunc, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``ufunc`` over each group of ``values`` (already in group order)."""
        out: npt.NDArray[Any] = ufunc.reduceat(values, self.starts) if values.shape[0] else values[:0]
        return out

    def first(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return values[self.starts]

    def last(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        ends: npt.NDArray[np.int64] = self.starts + self.sizes - 1
        return values[ends]

    def spread(self, per_group: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A value per group repeated for each of its rows (in group order)."""
        return np.repeat(per_group, self.sizes)


class Aggregate(abc.ABC):
    """A vectorised, mergeable aggregate (see the module docstring). ``column`` is the input
    column (``None`` when the aggregate reads none, as ``Count``)."""

    column: str | None = None
    by_time: ClassVar[bool] = False
    """Whether ``update`` needs each group's rows in event-time order (``First``, ``Last``)."""

    @abc.abstractmethod
    def init(self) -> dict[str, tuple[str, Any]]:
        """The state columns: ``{name: (dtype, fill)}``, or ``(dtype, fill, width)`` for a
        fixed-width row per window (a sketch's registers); ``fill`` is the state of no events."""

    def prepare(self, column: pa.Array) -> npt.NDArray[Any]:
        """The values ``update`` gets, from the input column (once per batch): by default the
        column as numpy; a sketch may hash it instead."""
        values: npt.NDArray[Any] = column.to_numpy(zero_copy_only=False)
        return values

    @abc.abstractmethod
    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        """Each group's partial state (``values``/``times`` in group order; ``values`` is
        empty when ``column`` is ``None``)."""

    @abc.abstractmethod
    def merge(self, a: State, b: State) -> State:
        """``a`` and ``b`` combined entry by entry; ``a`` has the earlier events."""

    @abc.abstractmethod
    def result(self, state: State) -> npt.NDArray[Any]:
        """The output value of each entry."""

    def dump(self, state: State) -> State:
        """The state as columns a checkpoint can hold (numbers, bytes); ``load`` undoes it."""
        return state

    def load(self, state: State) -> State:
        return state


def _floats(values: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    return values.astype(np.float64, copy=False)


class Count(Aggregate):
    """The number of events."""

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"n": ("int64", 0)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {"n": groups.sizes.astype(np.int64)}

    def merge(self, a: State, b: State) -> State:
        return {"n": a["n"] + b["n"]}

    def result(self, state: State) -> npt.NDArray[Any]:
        return state["n"]


@dataclass(frozen=True)
class _Reduce(Aggregate):
    """A sum, minimum or maximum of ``column`` (as float64)."""

    column: str
    _name: ClassVar[str] = ""
    _ufunc: ClassVar[Callable[..., Any]] = np.add
    _fill: ClassVar[float] = 0.0

    def init(self) -> dict[str, tuple[str, Any]]:
        return {self._name: ("float64", self._fill)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {self._name: groups.reduce(self._ufunc, _floats(values))}  # type: ignore[arg-type]

    def merge(self, a: State, b: State) -> State:
        return {self._name: self._ufunc(a[self._name], b[self._name])}

    def result(self, state: State) -> npt.NDArray[Any]:
        return state[self._name]


@dataclass(frozen=True)
class Sum(_Reduce):
    """The sum of ``column`` (float64)."""

    _name = "sum"


@dataclass(frozen=True)
class Min(_Reduce):
    """The smallest value of ``column`` (float64)."""

    _name = "min"
    _ufunc = np.minimum
    _fill = np.inf


@dataclass(frozen=True)
class Max(_Reduce):
    """The largest value of ``column`` (float64)."""

    _name = "max"
    _ufunc = np.maximum
    _fill = -np.inf


@dataclass(frozen=True)
class Mean(Aggregate):
    """The mean of ``column``."""

    column: str

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"n": ("int64", 0), "sum": ("float64", 0.0)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {"n": groups.sizes.astype(np.int64), "sum": groups.reduce(np.add, _floats(values))}

    def merge(self, a: State, b: State) -> State:
        return {"n": a["n"] + b["n"], "sum": a["sum"] + b["sum"]}

    def result(self, state: State) -> npt.NDArray[Any]:
        with np.errstate(invalid="ignore", divide="ignore"):
            return state["sum"] / state["n"]


@dataclass(frozen=True)
class Var(Aggregate):
    """The variance of ``column`` (``ddof`` 0: population; 1: sample), merged with Chan's
    parallel formula, so it is stable however the events are split."""

    column: str
    ddof: int = 0

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"n": ("int64", 0), "mean": ("float64", 0.0), "m2": ("float64", 0.0)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        x = _floats(values)
        n = groups.sizes.astype(np.int64)
        mean = groups.reduce(np.add, x) / n
        dev = x - groups.spread(mean)
        return {"n": n, "mean": mean, "m2": groups.reduce(np.add, dev * dev)}

    def merge(self, a: State, b: State) -> State:
        n = a["n"] + b["n"]
        safe = np.maximum(n, 1)
        delta = b["mean"] - a["mean"]
        mean = a["mean"] + delta * (b["n"] / safe)
        m2 = a["m2"] + b["m2"] + delta * delta * (a["n"] * b["n"] / safe)
        return {"n": n, "mean": mean, "m2": m2}

    def result(self, state: State) -> npt.NDArray[Any]:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(state["n"] > self.ddof, state["m2"] / (state["n"] - self.ddof), np.nan)


@dataclass(frozen=True)
class Std(Var):
    """The standard deviation of ``column`` (see ``Var``)."""

    def result(self, state: State) -> npt.NDArray[Any]:
        return np.sqrt(super().result(state))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class First(Aggregate):
    """The value of ``column`` at the earliest event time (the first to arrive among equals)."""

    column: str
    by_time: ClassVar[bool] = True

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"t": ("int64", _BIG), "v": ("float64", np.nan)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {"t": groups.first(times), "v": groups.first(_floats(values))}

    def merge(self, a: State, b: State) -> State:
        take_b = b["t"] < a["t"]
        return {"t": np.where(take_b, b["t"], a["t"]), "v": np.where(take_b, b["v"], a["v"])}

    def result(self, state: State) -> npt.NDArray[Any]:
        return state["v"]


@dataclass(frozen=True)
class Last(Aggregate):
    """The value of ``column`` at the latest event time (the last to arrive among equals)."""

    column: str
    by_time: ClassVar[bool] = True

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"t": ("int64", _SMALL), "v": ("float64", np.nan)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        return {"t": groups.last(times), "v": groups.last(_floats(values))}

    def merge(self, a: State, b: State) -> State:
        take_b = b["t"] >= a["t"]
        return {"t": np.where(take_b, b["t"], a["t"]), "v": np.where(take_b, b["v"], a["v"])}

    def result(self, state: State) -> npt.NDArray[Any]:
        return state["v"]


def check_aggregates(aggregates: Mapping[str, Aggregate]) -> None:
    """Every entry is an ``Aggregate`` with a name (raises ``TypeError``/``ValueError``)."""
    if not aggregates:
        raise ValueError("a window needs at least one aggregate")
    for name, agg in aggregates.items():
        if not isinstance(agg, Aggregate):
            raise TypeError(f"aggregate {name!r} is a {type(agg).__name__}, not an Aggregate")
