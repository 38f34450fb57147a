"""A worker's local copies of the changelog state of input partitions it owned, so that taking a
partition over again (at the next rebalance, or after a restart) reads only the changelog's tail.

When a partition is released (a revoke, the end of the run) and at most every ``every_s`` at a
checkpoint, the worker writes what it last wrote to (or restored from) the partition's
changelogs: each step's keys and rows, the keys whose stale records are still to be written
over, the input offset that state covers, and per changelog topic the offset after the last
record it includes. The copy goes to ``DIR/changelog/p-<partition>/`` of the worker's own
checkpoint directory, in the verified checkpoint format (the last two kept). A takeover starts
from the newest copy that covers no more than the group's committed offset (a copy past it holds
a checkpoint whose commit never landed) and reads each changelog from the copy's offset on: the
records of whoever owned the partition meanwhile, and its own after the copy.

A copy older than ``max_age_s`` is not used: compaction may have removed tombstones written
after it (``delete.retention.ms``, a day by default), and the deleted keys would come back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from aisp.errors import StateError
from aisp.observe.clock import wall_ms
from aisp.state.checkpoint import CheckpointStore, CorruptCheckpoint
from aisp.state.store import decode_keys

__all__ = ["LocalCopies", "LocalCopy", "Rows", "merge_tail"]

log = logging.getLogger("aisp.changelog")

Rows = tuple[pa.Array, dict[str, npt.NDArray[Any]]]
"""A step's state: its keys and a column per state field, row for row."""


@dataclass
class LocalCopy:
    """One partition's state as last written to (or restored from) its changelogs."""

    covers: int
    """The input offset the state covers."""
    ends: dict[str, int]
    """Per changelog topic, the offset after the last record the state includes."""
    steps: dict[str, Rows] = field(default_factory=dict)
    stale: dict[str, set[bytes]] = field(default_factory=dict)


class LocalCopies:
    """The local copies under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, *, every_s: float = 30.0, max_age_s: float = 12 * 3600.0) -> None:
        self.root = Path(root)
        self._every_s, self._max_age_s = every_s, max_age_s
        self._stores: dict[int, CheckpointStore] = {}
        self._saved: dict[int, float] = {}

    def _store(self, partition: int) -> CheckpointStore:
        store = self._stores.get(partition)
        if store is None:
            store = self._stores[partition] = CheckpointStore(self.root / f"p-{partition}", keep=2)
        return store

    def due(self, partition: int) -> bool:
        """Whether ``partition``'s copy is older than ``every_s`` (or there is none)."""
        return time.monotonic() - self._saved.get(partition, -float("inf")) >= self._every_s

    def save(self, partition: int, copy: LocalCopy) -> None:
        if copy.covers < 0:  # nothing read or restored yet: nothing worth keeping
            return
        tables: dict[str, pa.Table] = {}
        for step, (keys, columns) in copy.steps.items():
            tables[f"op.{step}"] = pa.table({"_key": keys, **columns})
        for step, stale in copy.stale.items():
            if stale:
                tables[f"stale.{step}"] = pa.table({"key": pa.array(sorted(stale), pa.binary())})
        meta = {"partition": partition, "covers": copy.covers, "ends": copy.ends, "saved_ms": wall_ms()}
        store = self._store(partition)
        store.write(store.next_id(), tables, meta)
        self._saved[partition] = time.monotonic()

    def load(self, partition: int, committed: int | None) -> LocalCopy | None:
        """The newest usable copy of ``partition`` (see the module docstring), or None."""
        if committed is None or not (self.root / f"p-{partition}").is_dir():
            return None
        store = self._store(partition)
        for checkpoint_id in reversed(store.ids()):
            try:
                checkpoint = store.load(checkpoint_id)
            except CorruptCheckpoint as exc:
                log.warning("input partition %d: local copy skipped: %s", partition, exc)
                continue
            meta = checkpoint.meta
            if wall_ms() - int(meta["saved_ms"]) > self._max_age_s * 1000:
                return None  # the older ones are older still
            if int(meta["covers"]) > committed:
                continue  # its checkpoint's commit never landed
            copy = LocalCopy(int(meta["covers"]), {str(k): int(v) for k, v in meta["ends"].items()})
            for name, table in checkpoint.tables.items():
                kind, _, step = name.partition(".")
                if kind == "op":
                    columns = {
                        c: np.asarray(table.column(c).to_numpy()) for c in table.column_names if c != "_key"
                    }
                    copy.steps[step] = (table.column("_key").combine_chunks(), columns)
                elif kind == "stale":
                    copy.stale[step] = set(table.column("key").to_pylist())
            return copy
        return None


def merge_tail(
    name: str,
    base: Rows | None,
    live: list[bytes],
    columns: dict[str, npt.NDArray[Any]],
    gone: list[bytes],
) -> Rows | None:
    """``base`` with the tail of changelog ``name`` applied: the rows of the ``live`` record keys
    (``columns``) replace or join it, the keys of ``gone`` leave it."""
    touched = live + gone
    if base is None:
        if not live:
            return None
        return pa.array(decode_keys(b"", live)), columns
    keys, old = base
    if not touched:
        return base
    if live and set(old) != set(columns):
        raise StateError(
            f"changelog {name!r} holds rows of another layout ({sorted(columns)}) than the local copy"
            f" ({sorted(old)}): the step's state changed shape; start a new group to begin afresh"
        )
    touched_keys = pa.array(decode_keys(b"", touched), type=keys.type)
    kept = pc.invert(pc.is_in(keys, value_set=touched_keys))
    mask = np.asarray(kept.to_numpy(zero_copy_only=False), dtype=bool)
    out_keys = pa.concat_arrays([keys.filter(kept), pa.array(decode_keys(b"", live), type=keys.type)])
    added = {c: columns[c].astype(col.dtype, copy=False) if live else col[:0] for c, col in old.items()}
    out = {c: np.concatenate([col[mask], added[c]]) for c, col in old.items()}
    return out_keys, out
