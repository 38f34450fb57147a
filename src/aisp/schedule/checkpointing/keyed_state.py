"""The executor's keyed state outside the hot path: what checkpoints take and restore, a bounded
hot layer over the state store, and state that follows the partitions of a Kafka input.

Operators keep keyed state as numpy columns indexed by the codes of their key space's
``KeyIndex`` (``aisp.state.keyed``). Everything here runs while no row is in flight (a
checkpoint's pause, or a source's rebalance callback after the rows it handed out were
written), because it renumbers codes, loads keys or drops them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.errors import AispError, ConfigError
from aisp.state.checkpoint import Checkpoint
from aisp.state.keyed import KeyIndex
from aisp.state.partitions import PartitionStateStore
from aisp.state.store import LmdbStateStore, decode_keys, decode_rows
from aisp.state.window_log import WindowLog
from aisp.transform.operators import Checkpointable, IncrementalState, LoggedState, Operator
from aisp.transform.windows.base import WindowsBase

__all__ = ["Captured", "KeyedStateKeeper", "PartitionCapture"]

log = logging.getLogger("aisp.executor")


@dataclass
class Captured:
    """One partition's state as captured under a pause: per key space (space, its keys made
    later, {step: state columns}); per window step (the windows' keys made later, their
    columns); per source, the largest event time read from it."""

    keyed: list[tuple[str, Callable[[], pa.Array], dict[str, dict[str, Any]]]] = field(default_factory=list)
    windows: dict[str, tuple[Callable[[], pa.Array], dict[str, Any]]] = field(default_factory=dict)
    event_time: dict[str, int] = field(default_factory=dict)


PartitionCapture = dict[int, Captured]


class KeyedStateKeeper:
    """The key spaces and operators of one executor (the same dicts, filled as it builds), and
    where their state goes besides checkpoint files: a state store, or partition states."""

    def __init__(
        self,
        pipeline: str,
        key_indexes: dict[str, KeyIndex],
        ops: Mapping[str, Operator],
        *,
        state_store: LmdbStateStore | None = None,
        partition_states: PartitionStateStore | None = None,
        max_keys: int = 0,
    ) -> None:
        self._pipeline = pipeline
        self._indexes = key_indexes
        self._ops = ops
        self.state_store = state_store
        self._window_log = WindowLog(state_store) if state_store is not None else None
        self.partition_states = partition_states
        self.max_keys = max_keys

    @property
    def spaces(self) -> list[str]:
        """The key spaces (each a ``key_by`` step id)."""
        return sorted(self._indexes)

    def share(self, other: KeyedStateKeeper, spaces: Iterable[str]) -> None:
        """(Before this executor builds its operators) use ``other``'s key indexes for
        ``spaces``: a topology update's new graph takes the keys over without copying them, and
        its operators' rows follow the same key codes (``aisp.serve.pipelines.topology``)."""
        for space in spaces:
            self._indexes[space] = other._indexes[space]

    def _keyed(self, space: str | None = None) -> list[tuple[str, IncrementalState]]:
        return [(sid, op) for sid, op in self._ops.items()
                if isinstance(op, IncrementalState) and (space is None or op.space == space)]  # fmt: skip

    def _windows(self, space: str) -> list[tuple[str, WindowsBase]]:
        return [
            (sid, op) for sid, op in self._ops.items() if isinstance(op, WindowsBase) and op.space == space
        ]

    # -- checkpoint files and the state store -------------------------------------------------
    def restore(self, checkpoint: Checkpoint) -> None:
        """Load a checkpoint's keyed and operator state (from its files, or the state store)."""
        if "state_store" in checkpoint.meta:
            if self.state_store is None:
                raise AispError(f"checkpoint {checkpoint.id} keeps its keyed state in a state store; open it")
            self._restore_from_store(checkpoint)
        for name, table in checkpoint.tables.items():
            kind, _, target = name.partition(".")
            if kind == "keys":
                self._indexes.setdefault(target, KeyIndex()).restore(table.column("key").combine_chunks())
        for name, table in checkpoint.tables.items():
            kind, _, target = name.partition(".")
            if kind == "op":
                op = self._ops.get(target)
                if not isinstance(op, Checkpointable):
                    raise AispError(
                        f"checkpoint {checkpoint.id} has state for step {target!r}, which this pipeline"
                        " does not have (or has no state): was the pipeline changed?"
                    )
                op.restore({c: table.column(c).to_numpy() for c in table.column_names})

    def _restore_from_store(self, checkpoint: Checkpoint) -> None:
        assert self.state_store is not None
        layout = checkpoint.meta["state_store"]
        for sid, descr in layout["ops"].items():
            op = self._ops.get(sid)
            if not isinstance(op, IncrementalState):
                raise AispError(
                    f"checkpoint {checkpoint.id} has keyed state for step {sid!r}, which this pipeline lacks"
                )
            prefix = f"{sid}\x1f".encode()
            if self.max_keys:  # nothing loaded: each key is read back when seen
                names = (name for name, _ in self.state_store.read(layout["version"], prefix))
                while chunk := list(itertools.islice(names, 65536)):
                    op.index.mark_evicted(pa.array(decode_keys(prefix, chunk)))
                continue
            entries = list(self.state_store.read(layout["version"], prefix))
            if not entries:
                continue
            keys, columns = decode_rows(prefix, entries, descr)
            op.restore_rows(op.index.encode(pa.array(keys)), columns)
        for sid in layout.get("windows", []):
            window_op = self._ops.get(sid)
            if not isinstance(window_op, LoggedState):
                raise AispError(
                    f"checkpoint {checkpoint.id} has windows of step {sid!r}, which this pipeline lacks"
                )
            assert self._window_log is not None
            windows = self._window_log.read(layout["version"], sid)
            if windows is None:
                raise AispError(
                    f"the state store lacks the windows of step {sid!r} at checkpoint {checkpoint.id}"
                )
            window_op.restore(windows)

    def page_from_store(self) -> None:
        """With a bounded hot layer: operators read evicted keys back from the state store."""
        if self.state_store is not None and self.max_keys:
            for sid, op in self._keyed():
                op.page_from(self.state_store, f"{sid}\x1f".encode())

    def write_to_store(
        self,
        version: int,
        changed: dict[str, tuple[pa.Array, dict[str, Any]]],
        before: int,
        logged: Mapping[str, tuple[dict[str, Any], npt.NDArray[np.int64], bool]] | None = None,
    ) -> dict[str, Any]:
        """Write the changed keys' state at ``version`` (before the manifest), and the window
        steps' changes (``logged``: columns, closed serials, whether a base); what restore needs."""
        assert self.state_store is not None and self._window_log is not None
        parts = {f"{sid}\x1f": part for sid, part in changed.items()}
        layout = self.state_store.write_rows(version, parts, before)
        for sid, (columns, gone, base) in (logged or {}).items():
            self._window_log.write(version, sid, columns, gone, base=base, before=before)
        return {"version": version, "ops": {prefix[:-1]: descr for prefix, descr in layout.items()},
                "windows": sorted(logged or {})}  # fmt: skip

    def base_due(self, step: str, open_windows: int) -> bool:
        """Whether window step ``step``'s next checkpoint writes its whole state (``WindowLog``)."""
        assert self._window_log is not None
        return self._window_log.base_due(step, open_windows)

    def over_bound(self) -> bool:
        """A key space holds more keys than ``max_keys`` (the next checkpoint evicts)."""
        return bool(self.max_keys) and any(len(index) > self.max_keys for index in self._indexes.values())

    def full(self) -> bool:
        """A key space holds half again as many keys as ``max_keys``: checkpoints, which evict,
        fell behind, and sources wait for one (backpressure)."""
        return bool(self.max_keys) and any(
            2 * len(index) > 3 * self.max_keys for index in self._indexes.values()
        )

    def evict(self) -> None:
        """Shrink each key space over ``max_keys`` to 80% of it (the keys not seen for the
        longest go; their state is in the store), after the checkpoint took the dirty state."""
        for space, index in self._indexes.items():
            if len(index) <= self.max_keys:
                continue
            survivors = index.evict(keep=self.max_keys * 4 // 5)
            if survivors is not None:
                for _, op in self._keyed(space):
                    op.evict(survivors)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per key space: keys in memory, keys evicted and read back so far."""
        out = {space: {"keys": len(index), "evicted": index.evicted, "reloaded": 0}
               for space, index in self._indexes.items()}  # fmt: skip
        for _, op in self._keyed():
            if op.space in out:
                out[op.space]["reloaded"] += getattr(op, "reloaded", 0)
        return out

    # -- state that follows input partitions --------------------------------------------------
    def follow_partitions(
        self, partition_of: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]]
    ) -> None:
        """Tag keys with their input partition (``partition_of`` maps engine ids to it)."""
        if self.state_store is not None:
            raise ConfigError("keyed state follows input partitions or lives in a state store, not both")
        for index in self._indexes.values():
            index.partition_of = partition_of

    def capture_partitions(
        self, partitions: list[int], event_time: Callable[[int], dict[str, int]] | None = None
    ) -> PartitionCapture:
        """The keys and state of each partition (keyed steps and windows), as copies or views
        that stay valid, and what ``event_time`` says the partition read (by source)."""
        out: PartitionCapture = {}
        for partition in partitions:
            part = out[partition] = Captured(event_time=event_time(partition) if event_time else {})
            for space, index in self._indexes.items():
                codes = index.codes_in([partition])
                columns = {sid: op.rows(codes) for sid, op in self._keyed(space)}
                part.keyed.append((space, index.frozen_keys(codes), columns))
        for space, index in self._indexes.items():  # each window step's open windows, read once
            for sid, window_op in self._windows(space):
                key_codes, window_columns = window_op.windows_of()
                of = index.partitions_of(key_codes)
                for partition in partitions:
                    mine = of == partition
                    picked = {name: col[mine] for name, col in window_columns.items()}
                    out[partition].windows[sid] = (index.frozen_keys(key_codes[mine]), picked)
        return out

    def write_partitions(self, captured: PartitionCapture, offsets: Mapping[str, int]) -> None:
        """Checkpoint each captured partition with its position (``offsets``, by partition):
        tables ``keys.<space>`` and ``op.<step>`` (keyed steps), ``win.<step>`` (window steps'
        open windows, their keys in ``_key``); ``meta["event_time"]``: per source, the largest
        event time read from the partition."""
        assert self.partition_states is not None
        for partition, part in captured.items():
            offset = offsets.get(str(partition))
            if offset is None:  # nothing read from it yet: its state is what it was claimed with
                continue
            tables: dict[str, pa.Table] = {}
            space_of: dict[str, str] = {}
            for space, keys, columns in part.keyed:
                tables[f"keys.{space}"] = pa.table({"key": keys()})
                tables.update({f"op.{sid}": pa.table(cols) for sid, cols in columns.items()})
                space_of.update(dict.fromkeys(columns, space))
            for sid, (keys, columns) in part.windows.items():
                tables[f"win.{sid}"] = pa.table({"_key": keys(), **columns})
            meta = {"pipeline": self._pipeline, "partition": partition, "offset": offset, "spaces": space_of,
                    "windows": sorted(part.windows), "event_time": part.event_time}  # fmt: skip
            self.partition_states.write(partition, tables, meta)

    def load_partition(self, partition: int, checkpoint: Checkpoint) -> int:
        """Load a partition's checkpoint (its keys join the key spaces); returns its offset."""
        if checkpoint.meta.get("pipeline") != self._pipeline:
            raise ConfigError(
                f"{checkpoint.path} holds state of pipeline {checkpoint.meta.get('pipeline')!r},"
                f" not {self._pipeline!r}"
            )
        codes_of: dict[str, npt.NDArray[np.int64]] = {}
        keys = 0
        for name, table in checkpoint.tables.items():
            kind, _, target = name.partition(".")
            op = self._ops.get(target)
            if kind == "op" and "_key" in table.column_names:  # a step's rows with their keys
                if not isinstance(op, IncrementalState):
                    raise ConfigError(
                        f"{checkpoint.path} holds keyed state of step {target!r}, which this pipeline"
                        " lacks (or keeps no keyed state in)"
                    )
                index = self._indexes[op.space]
                codes = index.encode(table.column("_key").combine_chunks())
                index.tag(codes, np.full(codes.shape[0], partition, dtype=np.int64))
                op.restore_rows(
                    codes, {c: table.column(c).to_numpy() for c in table.column_names if c != "_key"}
                )
                keys += codes.shape[0]
            if kind == "win":  # a window step's open windows, with their keys
                if not isinstance(op, WindowsBase):
                    raise ConfigError(
                        f"{checkpoint.path} holds windows of step {target!r}, which this pipeline lacks"
                    )
                index = self._indexes[op.space]
                codes = index.encode(table.column("_key").combine_chunks())
                index.tag(codes, np.full(codes.shape[0], partition, dtype=np.int64))
                op.add_windows(
                    codes, {c: table.column(c).to_numpy() for c in table.column_names if c != "_key"}
                )
            if kind == "keys" and target in self._indexes:
                index = self._indexes[target]
                codes = index.encode(table.column("key").combine_chunks())
                index.tag(codes, np.full(codes.shape[0], partition, dtype=np.int64))
                codes_of[target] = codes
        for name, table in checkpoint.tables.items():
            kind, _, target = name.partition(".")
            op = self._ops.get(target)
            if kind == "op" and isinstance(op, IncrementalState) and op.space in codes_of:
                op.restore_rows(
                    codes_of[op.space], {c: table.column(c).to_numpy() for c in table.column_names}
                )
        offset = int(checkpoint.meta["offset"])
        log.info(
            "input partition %d: state of %d keys taken over from %s, from offset %d",
            partition, keys + sum(c.shape[0] for c in codes_of.values()), checkpoint.path, offset,
        )  # fmt: skip
        return offset

    def drop_partitions(self, partitions: list[int]) -> None:
        """Forget the keys of ``partitions`` (taken away; their state was written)."""
        for space, index in self._indexes.items():
            victims = index.codes_in(partitions)
            if victims.size:
                survivors = index.drop(victims, remember=False)
                for _, op in self._keyed(space):
                    op.evict(survivors)
                for _, window_op in self._windows(space):
                    window_op.drop_keys(victims, survivors)
