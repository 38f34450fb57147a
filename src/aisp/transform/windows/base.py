"""What every window operator shares: window kinds, settings, late events, emitting rows,
early results and checkpoints (``aisp.transform.windows.spec`` is the user-facing module).

When keyed state follows the partitions of a Kafka input (``aisp run --partition-state``), a
key's windows move between processes with its partition, and rows carry their own partition's
watermark (``_partition_watermark``). What an event joins, and whether it is late, is then
decided by that watermark alone, so it does not depend on which other partitions the process
reads or when it took this one over; windows close by the watermark over the partitions the
process reads (never past any partition's own), which may step back when a partition that is
behind is taken over.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import EVENT_TIME, ID, INGEST_NS, KEY, PARTITION_WATERMARK, WATERMARK, Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.state.keyed import KeyIndex
from aisp.transform.operators import Emit, OperatorContext
from aisp.transform.windows.aggregates import Aggregate, check_aggregates
from aisp.transform.windows.event_time import NO_WATERMARK
from aisp.transform.windows.state import Slots

__all__ = [
    "END_OF_INPUT",
    "LATE_PORT",
    "Session",
    "Sliding",
    "Tumbling",
    "WindowConfig",
    "WindowsBase",
    "window_ids",
]

LATE_PORT = "late"
LATE_POLICIES = ("dead_letter", "side", "drop")
END_OF_INPUT = int(np.iinfo(np.int64).max)
"""The watermark at the end of the input: every window closes."""


@dataclass(frozen=True)
class Tumbling:
    """Windows of ``size_ms`` one after another, aligned to ``offset_ms`` + multiples of the size
    since the epoch: ``[start, start + size)``."""

    size_ms: int
    offset_ms: int = 0

    @property
    def step_ms(self) -> int:
        return self.size_ms


@dataclass(frozen=True)
class Sliding:
    """Windows of ``size_ms`` starting every ``step_ms`` (aligned as ``Tumbling``): an event
    belongs to about ``size / step`` of them."""

    size_ms: int
    step_ms: int
    offset_ms: int = 0


@dataclass(frozen=True)
class Session:
    """Per key, events closer than ``gap_ms`` together form one window: ``[first, last + gap)``;
    a late event that bridges two sessions merges them."""

    gap_ms: int


def _check_window(window: Any) -> None:
    if isinstance(window, Session):
        if window.gap_ms <= 0:
            raise ConfigError(f"session gap_ms must be > 0, got {window.gap_ms}")
        return
    if not isinstance(window, Tumbling | Sliding):
        raise ConfigError(f"window must be Tumbling, Sliding or Session, got {type(window).__name__}")
    if window.size_ms <= 0 or window.step_ms <= 0:
        raise ConfigError(
            f"window size_ms and step_ms must be > 0, got {window.size_ms} and {window.step_ms}"
        )


def window_ids(first_ids: npt.NDArray[np.int64], starts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Event ids for window rows: a 63-bit mix of the window's first event id and its start, so a
    replay after a restore gives each window the id it had."""
    with np.errstate(over="ignore"):
        z = first_ids.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + starts.view(np.uint64)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(1)).view(np.int64)


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """A window step's settings (``WindowSpec`` adds the operator it builds)."""

    window: Tumbling | Sliding | Session
    aggregates: tuple[tuple[str, Aggregate], ...]
    space: str
    key_column: str
    allowed_lateness_ms: int = 0
    late: str = "dead_letter"
    early_every_ms: float = 0.0
    start_column: str = "window_start"
    end_column: str = "window_end"

    def __post_init__(self) -> None:
        _check_window(self.window)
        try:
            check_aggregates(dict(self.aggregates))
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if self.allowed_lateness_ms < 0:
            raise ConfigError(f"allowed_lateness_ms must be >= 0, got {self.allowed_lateness_ms}")
        if self.late not in LATE_POLICIES:
            raise ConfigError(f"late must be one of {LATE_POLICIES}, got {self.late!r}")
        if self.early_every_ms < 0:
            raise ConfigError(f"early_every_ms must be >= 0, got {self.early_every_ms}")
        names = [self.key_column, self.start_column, self.end_column, *(n for n, _ in self.aggregates)]
        if len(set(names)) != len(names):
            raise ConfigError(f"window output columns must differ, got {names}")

    @property
    def ports(self) -> tuple[str, ...]:
        return (DEFAULT_PORT, LATE_PORT) if self.late == "side" else (DEFAULT_PORT,)


class WindowsBase:
    """What every window operator shares: reading a batch's event time and watermarks, late
    events, the open windows' slots, emitting window rows, early results, checkpoints."""

    def __init__(self, spec: WindowConfig, ctx: OperatorContext) -> None:
        self.spec, self._ctx = spec, ctx
        self.space = spec.space
        self._index: KeyIndex = ctx.key_index(spec.space)
        self.slots = Slots(spec.aggregates)
        self.watermark = NO_WATERMARK
        self.late_events = 0
        """Events that missed every window they belong to."""
        self.emitted = 0
        self._last_early_ns = time.monotonic_ns()
        self._inputs = [(name, agg) for name, agg in spec.aggregates if agg.column is not None]
        self._follows = False  # rows carry their partition's watermark (see the module docstring)

    @property
    def open_windows(self) -> int:
        return len(self.slots)

    @abstractmethod
    def _bounds(self, slots: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The start and end of the windows in ``slots``."""

    @abstractmethod
    def _close(self, watermark: int) -> npt.NDArray[np.int64]:
        """Forget the windows ``watermark`` closes (end + allowed lateness <= it); their slots,
        in output order, still holding their state (the caller frees them)."""

    @abstractmethod
    def _reopen(self, slots: npt.NDArray[np.int64]) -> None:
        """Index restored windows (their slots are filled)."""

    @abstractmethod
    def _forget_windows(self) -> None:
        """Empty the indexes of open windows (the slots are replaced)."""

    def _read(
        self, batch: Batch
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Key codes, event times, the step's watermark before each row (windows close by it),
        and the watermark that decides what each row joins (see the module docstring)."""
        if EVENT_TIME not in batch or WATERMARK not in batch:
            raise ConfigError(
                f"window step {self._ctx.step_id!r} got rows without event time: give the source an"
                " EventTime (Pipeline.source(..., event_time=EventTime(column, ...)))"
            )
        if PARTITION_WATERMARK in batch:  # ``_watermark`` is then the one after each row
            self._follows = True
            wm = batch.numpy(WATERMARK)
            return batch.numpy(KEY), batch.numpy(EVENT_TIME), wm, batch.numpy(PARTITION_WATERMARK)
        wm = np.maximum.accumulate(np.maximum(batch.numpy(WATERMARK), self.watermark))
        return batch.numpy(KEY), batch.numpy(EVENT_TIME), wm, wm

    def _values_of(self, batch: Batch, rows: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        """Each aggregate's input values for ``rows`` (``Aggregate.prepare``, once per column
        and kind of preparation)."""
        prepared: dict[tuple[str, Any], npt.NDArray[Any]] = {}
        out = {}
        for name, agg in self._inputs:
            assert agg.column is not None
            key = (agg.column, type(agg).prepare)
            if key not in prepared:
                prepared[key] = agg.prepare(batch.column(agg.column))
            out[name] = prepared[key][rows]
        return out

    def _late(self, batch: Batch, rows: npt.NDArray[np.int64], starts: npt.NDArray[np.int64],
              ends: npt.NDArray[np.int64]) -> Emit:  # fmt: skip
        """Events that missed their windows (``starts``/``ends``: the window each missed)."""
        if not rows.size:
            return []
        self.late_events += int(rows.size)
        late = batch.take(rows)
        spec = self.spec
        if spec.late == "side":
            return [(LATE_PORT, late.with_columns({spec.start_column: starts, spec.end_column: ends}))]
        if spec.late == "dead_letter":
            windows = [{"start": s, "end": e} for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
            self._ctx.dead_letter(late, self._ctx.step_id, "late", {"window": windows})
        return []

    def _finish_batch(self, outs: Emit, watermark: int, ingest_ns: int) -> Emit:
        """After a batch: emit what ``watermark`` closed, and early results when due."""
        self.watermark = watermark if self._follows else max(self.watermark, watermark)
        closed = self._close(self.watermark)
        if closed.size:
            outs.append((DEFAULT_PORT, self._rows(closed, ingest_ns, final=True)))
            self.slots.give_back(closed)
        if self._early_due():
            changed = np.flatnonzero(self.slots.dirty & self.slots.live)
            if changed.size:
                changed = changed[np.lexsort((self.slots.code[changed], self._bounds(changed)[0]))]
                outs.append((DEFAULT_PORT, self._rows(changed, ingest_ns, final=False)))
        return outs

    def _rows(self, slots: npt.NDArray[np.int64], ingest_ns: int, *, final: bool) -> Batch:
        """One output row per window in ``slots``."""
        spec = self.spec
        codes = self.slots.code[slots]
        starts, ends = self._bounds(slots)
        cols: dict[str, Any] = {spec.key_column: self._index.frozen_keys(codes)()}
        cols[spec.start_column] = starts
        cols[spec.end_column] = ends
        cols.update(self.slots.table.results(slots))
        if spec.early_every_ms:
            cols["final"] = np.full(codes.shape[0], final)
        cols[ID] = window_ids(self.slots.first_id[slots], starts)
        cols[INGEST_NS] = np.full(codes.shape[0], ingest_ns, dtype=np.int64)
        cols[KEY] = codes
        cols[EVENT_TIME] = ends - 1
        cols[WATERMARK] = np.full(codes.shape[0], self.watermark, dtype=np.int64)
        self.slots.dirty[slots] = False
        if final:
            self.emitted += int(codes.shape[0])
        return Batch.from_columns(cols)

    def _early_due(self) -> bool:
        if not self.spec.early_every_ms:
            return False
        now = time.monotonic_ns()
        if now - self._last_early_ns < self.spec.early_every_ms * 1e6:
            return False
        self._last_early_ns = now
        return True

    def advance(self, watermark: int) -> Emit:
        """Event time moved on to ``watermark`` without rows (see ``SourceClocks.moved``): emit
        what it closes."""
        return self._finish_batch([], watermark, time.monotonic_ns())

    def hand_over(self) -> None:
        """Forget every open window: another graph took them over (a topology update), so this
        one's end emits none."""
        self.slots = Slots(self.spec.aggregates)
        self._forget_windows()

    def flush(self) -> Emit:
        """End of input: every open window is final."""
        closed = self._close(END_OF_INPUT)
        if not closed.size:
            return []
        out = self._rows(closed, time.monotonic_ns(), final=True)
        self.slots.give_back(closed)
        return [(DEFAULT_PORT, out)]

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        """The open windows, their keys by value (the key space may be restored apart, or not
        at all, as with a state store), and the watermark."""
        return self._columns(self.slots.open_slots())

    def changes(
        self, *, everything: bool = False
    ) -> tuple[dict[str, npt.NDArray[Any]], npt.NDArray[np.int64]]:
        """For a state store: the windows that changed since the last call (``everything``: all
        open windows), as ``snapshot`` gives them, and the serials (``__uid``) of the windows
        that closed since then."""
        slots, gone = self.slots.changes(everything=everything)
        return self._columns(slots), gone

    def _columns(self, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        cols = self.slots.snapshot(slots)
        cols["__code"] = self._index.frozen_keys(cols["__code"])().to_numpy(zero_copy_only=False)
        cols["__wm"] = np.full(slots.shape[0], self.watermark, dtype=np.int64)
        return cols

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        if not len(columns["__code"]):
            return
        self.watermark = int(np.max(columns["__wm"]))  # rows of older checkpoints hold older ones
        rows = {k: np.asarray(v) for k, v in columns.items() if k != "__wm"}
        rows["__code"] = self._index.encode(pa.array(rows["__code"]))
        self._reopen(self.slots.restore(rows))

    # -- state that follows input partitions --------------------------------------------------
    def windows_of(
        self, codes: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]:
        """The open windows of the keys ``codes`` (None: all): their key codes, and their
        columns (copies, as ``snapshot`` gives them, without the key and serial)."""
        slots = self.slots.open_slots()
        if codes is not None:
            slots = slots[np.isin(self.slots.code[slots], codes)]
        columns = self.slots.snapshot(slots)
        del columns["__uid"]
        return columns.pop("__code"), columns

    def add_windows(self, codes: npt.NDArray[np.int64], columns: Mapping[str, npt.NDArray[Any]]) -> None:
        """Open the windows of a partition taken over (``windows_of`` of its last owner, keys
        encoded here as ``codes``)."""
        if codes.size:
            self._reopen(self.slots.restore({**columns, "__code": codes}))

    def drop_keys(self, victims: npt.NDArray[np.int64], survivors: npt.NDArray[np.int64]) -> None:
        """Forget the windows of the keys ``victims`` and renumber the rest as the key index did
        (``KeyIndex.drop``: new code ``i`` was ``survivors[i]``)."""
        columns = self.slots.snapshot(self.slots.open_slots())
        keep = ~np.isin(columns["__code"], victims)
        rows = {name: col[keep] for name, col in columns.items()}
        rows["__code"] = np.searchsorted(survivors, rows["__code"])
        self.slots = Slots(self.spec.aggregates)
        self._forget_windows()
        if keep.any():
            self._reopen(self.slots.restore(rows))
