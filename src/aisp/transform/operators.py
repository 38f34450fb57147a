"""Stateless vectorised operators and the contract every operator follows.

An operator spec is a frozen, config-only object; ``spec.build(ctx)`` returns the runtime
``Operator`` that the executor drives. ``Operator.process(batch)`` returns ``(port, batch)``
pairs; ``flush()`` is called once at end of input. An exception from ``process`` sends that
batch's rows to the dead-letter sink (the executor does it) and the pipeline goes on; operators
that can pin a failure on single rows (``MapRows``) dead-letter only those rows themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.admission.tiers import DEFAULT_TIERS
from aisp.batch import KEY, META_COLUMNS, TIER, Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.observe.drift import alert_sink
from aisp.state.keyed import KeyIndex

if TYPE_CHECKING:
    from aisp.state.store import LmdbStateStore

__all__ = [
    "AssignTier",
    "Checkpointable",
    "Emit",
    "Filter",
    "IncrementalState",
    "KeyBy",
    "LoggedState",
    "MapBatch",
    "MapRows",
    "Operator",
    "OperatorContext",
    "Passthrough",
    "Route",
]

Emit = list[tuple[str, Batch]]
DeadLetterFn = Callable[..., None]
"""``fn(batch, step, reason, fields=None)``: dead-letter ``batch``'s rows; ``fields`` maps a
record field to one value per row (e.g. the window a late event missed)."""


class Operator(Protocol):
    """The runtime side of a step, driven by one executor thread at a time."""

    def process(self, batch: Batch) -> Emit: ...

    def flush(self) -> Emit: ...


@runtime_checkable
class Checkpointable(Protocol):
    """An operator with state: the executor snapshots it at checkpoints and restores it after a
    restart. State is plain columns (numpy arrays of equal length), stored as Arrow."""

    def snapshot(self) -> dict[str, npt.NDArray[Any]]: ...

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None: ...


@runtime_checkable
class LoggedState(Protocol):
    """Operator state that a state store keeps as a log of changes (window steps, see
    ``aisp.state.window_log``): ``changes`` gives the records that changed since the last
    call (or all of them) and the serials of those dropped since; ``restore`` takes what the
    log adds up to, as it takes a ``snapshot``."""

    open_windows: int

    def snapshot(self) -> dict[str, npt.NDArray[Any]]: ...

    def changes(
        self, *, everything: bool = False
    ) -> tuple[dict[str, npt.NDArray[Any]], npt.NDArray[np.int64]]: ...

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None: ...


@runtime_checkable
class IncrementalState(Protocol):
    """Keyed operator state that can be checkpointed by the keys that changed (the state store)."""

    space: str

    @property
    def index(self) -> KeyIndex: ...

    def take_dirty(self) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]: ...

    def rows(self, codes: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]: ...

    def restore_rows(self, codes: npt.NDArray[np.int64], columns: Mapping[str, npt.NDArray[Any]]) -> None: ...

    def page_from(self, store: LmdbStateStore, prefix: bytes) -> None: ...

    def evict(self, survivors: npt.NDArray[np.int64]) -> None: ...


AlertFn = Callable[[dict[str, Any]], None]


@dataclass
class OperatorContext:
    """What a running operator may use from the engine."""

    step_id: str
    dead_letter: DeadLetterFn
    key_indexes: dict[str, KeyIndex] = field(default_factory=dict)
    alerts: Callable[[str | AlertFn, str], AlertFn] = alert_sink
    """``alerts(target, what)``: the function that sends an operator's alerts to ``target``
    (``aisp.observe.drift.alert_sink``'s targets; the executor's also reach broker streams)."""

    def key_index(self, space: str) -> KeyIndex:
        return self.key_indexes.setdefault(space, KeyIndex())


class _Stateless:
    """Base for operators without end-of-input work; ``build`` returns the spec itself."""

    def build(self, ctx: OperatorContext) -> Operator:
        return self  # type: ignore[return-value]

    def flush(self) -> Emit:
        return []


@dataclass(frozen=True)
class Passthrough(_Stateless):
    """Forwards batches unchanged (``union`` uses it)."""

    def process(self, batch: Batch) -> Emit:
        return [(DEFAULT_PORT, batch)]


@dataclass(frozen=True)
class MapBatch(_Stateless):
    """``fn(batch) -> Batch``: the vectorised map. Meta columns missing from the result are kept."""

    fn: Callable[[Batch], Batch]

    def process(self, batch: Batch) -> Emit:
        out = self.fn(batch)
        if not isinstance(out, Batch):
            raise TypeError(f"map_batch function must return a Batch, got {type(out).__name__}")
        if out.num_rows == batch.num_rows:
            missing = {m: batch.column(m) for m in META_COLUMNS if m in batch and m not in out}
            if missing:
                out = out.with_columns(missing)
        return [(DEFAULT_PORT, out)]


@dataclass(frozen=True)
class MapRows:
    """``fn(row: dict) -> dict | None`` per row: the slow fallback for logic that will not vectorise.

    A row whose function raises goes to the dead-letter sink alone; ``None`` drops the row. Meta
    columns are carried over, so latency and ids stay per event.
    """

    fn: Callable[[dict[str, Any]], dict[str, Any] | None]

    def build(self, ctx: OperatorContext) -> Operator:
        return _MapRowsOp(self.fn, ctx)


class _MapRowsOp:
    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any] | None], ctx: OperatorContext):
        self._fn, self._ctx = fn, ctx

    def process(self, batch: Batch) -> Emit:
        user_cols = [c for c in batch.column_names if c not in META_COLUMNS]
        rows = batch.select(user_cols).record_batch.to_pylist()
        out_rows: list[dict[str, Any]] = []
        keep: list[int] = []
        for i, row in enumerate(rows):
            try:
                result = self._fn(row)
            except Exception as exc:  # noqa: BLE001 - one bad row must not fail its batch
                self._ctx.dead_letter(batch.slice(i, 1), self._ctx.step_id, f"{type(exc).__name__}: {exc}")
                continue
            if result is not None:
                out_rows.append(result)
                keep.append(i)
        if not keep:
            return []
        meta = batch.take(np.asarray(keep, dtype=np.int64))
        table = pa.RecordBatch.from_pylist(out_rows)
        cols = {name: table.column(name) for name in table.schema.names}
        cols.update({m: meta.column(m) for m in META_COLUMNS if m in meta})
        return [(DEFAULT_PORT, Batch.from_columns(cols))]

    def flush(self) -> Emit:
        return []


@dataclass(frozen=True)
class Filter(_Stateless):
    """Keep rows where ``predicate(batch)`` (a boolean array over the batch) is true."""

    predicate: Callable[[Batch], npt.NDArray[np.bool_] | pa.BooleanArray]

    def process(self, batch: Batch) -> Emit:
        mask = self.predicate(batch)
        if len(mask) != batch.num_rows:
            raise ValueError(f"filter mask has {len(mask)} entries for {batch.num_rows} rows")
        out = batch.filter(mask)
        return [(DEFAULT_PORT, out)] if out.num_rows else []


@dataclass(frozen=True)
class KeyBy:
    """Adds the ``_key`` column: dense int64 codes of ``column``, shared by the key space ``space``."""

    column: str
    space: str

    def build(self, ctx: OperatorContext) -> Operator:
        return _KeyByOp(self.column, ctx.key_index(self.space))


class _KeyByOp:
    def __init__(self, column: str, index: KeyIndex) -> None:
        self._column, self._index = column, index

    def process(self, batch: Batch) -> Emit:
        codes = self._index.encode(batch.column(self._column))
        if self._index.partition_of is not None:  # state that moves with input partitions
            self._index.tag(codes, self._index.partition_of(batch.ids))
        return [(DEFAULT_PORT, batch.with_columns({KEY: codes}))]

    def flush(self) -> Emit:
        return []


@dataclass(frozen=True)
class Route(_Stateless):
    """Send each row to one branch.

    Either ``column`` holds the branch name of each row (rows naming no branch go to ``default``),
    or ``predicates`` maps branch -> ``fn(batch) -> bool mask`` and the first match wins.
    """

    branches: Sequence[str]
    column: str | None = None
    predicates: Mapping[str, Callable[[Batch], Any]] | None = None
    default: str | None = None

    def __post_init__(self) -> None:
        if (self.column is None) == (self.predicates is None):
            raise ConfigError("route needs exactly one of column= or predicates=")
        if self.default is not None and self.default not in self.branches:
            raise ConfigError(f"route default {self.default!r} is not a branch of {list(self.branches)}")

    def process(self, batch: Batch) -> Emit:
        n = batch.num_rows
        assigned = np.full(n, -1, dtype=np.int64)
        if self.column is not None:
            values = np.asarray(batch.column(self.column).to_numpy(zero_copy_only=False))
            for i, name in enumerate(self.branches):
                assigned[(values == name) & (assigned < 0)] = i
        else:
            assert self.predicates is not None
            for i, name in enumerate(self.branches):
                fn = self.predicates.get(name)
                if fn is not None:
                    assigned[np.asarray(fn(batch), dtype=bool) & (assigned < 0)] = i
        if self.default is not None:
            assigned[assigned < 0] = list(self.branches).index(self.default)
        elif (assigned < 0).any():
            raise ValueError(f"{int((assigned < 0).sum())} row(s) match no branch and route has no default")
        out: Emit = []
        for i, name in enumerate(self.branches):
            mask = assigned == i
            if mask.all():
                return [(name, batch)]
            if mask.any():
                out.append((name, batch.filter(mask)))
        return out


@dataclass(frozen=True)
class AssignTier(_Stateless):
    """Sets ``_tier`` from ``column``, a tier name per row (``levels`` maps names to levels).

    Unknown names and nulls get ``default``. Vectorised: one Arrow ``index_in`` per batch.
    """

    column: str
    levels: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default: int = 0

    def process(self, batch: Batch) -> Emit:
        names = list(self.levels)
        import pyarrow.compute as pc  # ~60 ms and ~12 MB at import: only pipelines with tiers pay

        idx = pc.index_in(batch.column(self.column), value_set=pa.array(names, type=pa.string()))
        table = np.array([*self.levels.values(), self.default], dtype=np.int8)
        pos = idx.fill_null(len(names)).to_numpy(zero_copy_only=False)
        return [(DEFAULT_PORT, batch.with_columns({TIER: table[pos]}))]
