"""Changelog records of a partition's state: what a checkpoint of the partition
(``KeyedStateKeeper.write_partitions``) puts in records, which of them a write sends, and the
state columns a restore rebuilds from their values (see ``aisp.connectors.kafka.changelog``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from aisp.connectors.kafka.local_copy import Rows
from aisp.errors import StateError
from aisp.state.store import decode_keys, encode_names

__all__ = ["EVENT_TIME_STEP", "changes", "record_sets", "state_columns", "to_checkpoint"]

EVENT_TIME_STEP = "_event_time"
"""The changelog of each partition's event-time progress (``record_sets``)."""


def record_sets(
    tables: dict[str, pa.Table], meta: dict[str, Any]
) -> Iterator[tuple[str, pa.Array, dict[str, npt.NDArray[Any]]]]:
    """What a partition's checkpoint (``KeyedStateKeeper.write_partitions``) puts in changelogs,
    per step: the record keys' values and the rows. A keyed step's record key is the key; a
    window step's is the window's key, start and opening event (a msgpack of the three: two
    sessions of a key may share a start, and a session that grows earlier is a new record, its
    old one a tombstone); the partition's event-time progress is a step of its own
    (``EVENT_TIME_STEP``, a record per source)."""
    for step, space in meta["spaces"].items():
        yield step, tables[f"keys.{space}"].column("key").combine_chunks(), _numpy(tables[f"op.{step}"])
    encode = msgspec.msgpack.encode
    for step in meta.get("windows", ()):
        columns = _numpy(tables[f"win.{step}"], skip="_key")
        keys = tables[f"win.{step}"].column("_key").to_pylist()
        ids = zip(keys, columns["__window"].tolist(), columns["__first_id"].tolist(), strict=True)
        yield step, pa.array([encode(list(window)) for window in ids], pa.binary()), columns
    newest = meta.get("event_time") or {}
    if newest:
        sources = sorted(newest)
        yield (
            EVENT_TIME_STEP,
            pa.array(sources),
            {"newest": np.array([newest[s] for s in sources], dtype=np.int64)},
        )


def to_checkpoint(step: str, rows: Rows, tables: dict[str, pa.Table], event_time: dict[str, int]) -> None:
    """Put a step's restored rows where ``KeyedStateKeeper.load_partition`` takes them
    (``record_sets`` reversed)."""
    keys, columns = rows
    if step == EVENT_TIME_STEP:
        event_time.update(zip(keys.to_pylist(), columns["newest"].tolist(), strict=True))
    elif "__window" in columns:
        decode = msgspec.msgpack.decode
        window_keys = pa.array([decode(k)[0] for k in keys.to_pylist()])
        tables[f"win.{step}"] = pa.table({"_key": window_keys, **columns})
    else:
        tables[f"op.{step}"] = pa.table({"_key": keys, **columns})


def _numpy(table: pa.Table, skip: str = "") -> dict[str, npt.NDArray[Any]]:
    return {c: np.asarray(table.column(c).to_numpy()) for c in table.column_names if c != skip}


def changes(
    keys: pa.Array,
    columns: dict[str, npt.NDArray[Any]],
    base: tuple[pa.Array, dict[str, npt.NDArray[Any]]] | None,
    stale: set[bytes],
) -> tuple[npt.NDArray[np.bool_], list[bytes]]:
    """Which of ``keys`` changed against ``base`` (new keys, other rows, stale records), and the
    record keys of the keys gone (tombstones), all vectorised but the stale ones."""
    n = len(keys)
    if base is None or not len(base[0]):  # (an empty base: nothing to index into)
        changed = np.ones(n, dtype=bool)
        gone_keys: list[Any] = []
    else:
        old_keys, old_columns = base
        pos = pc.index_in(keys, value_set=old_keys)
        changed = np.asarray(pos.is_null().to_numpy(zero_copy_only=False), dtype=bool).copy()
        at = np.asarray(pos.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
        for name, col in columns.items():
            old = old_columns.get(name)
            if old is None:
                changed[:] = True
                break
            before = old[at]
            differ = col != before
            if np.issubdtype(col.dtype, np.floating):
                differ &= ~(np.isnan(col) & np.isnan(before))
            changed |= differ.reshape(n, -1).any(axis=1) if differ.ndim > 1 else differ
        kept = np.asarray(pc.is_in(old_keys, value_set=keys).to_numpy(zero_copy_only=False), dtype=bool)
        gone_keys = old_keys.filter(pa.array(~kept)).to_pylist()
    gone = set(encode_names(b"", gone_keys))
    if stale:
        present = set(encode_names(b"", keys.to_pylist())) & stale if n else set()
        if present:
            stale_mask = pc.is_in(keys, value_set=pa.array(decode_keys(b"", sorted(present))))
            changed |= np.asarray(stale_mask.to_numpy(zero_copy_only=False), dtype=bool)
        gone |= stale - present
    return changed, sorted(gone)


def state_columns(name: str, layout: bytes | None, values: list[bytes]) -> dict[str, npt.NDArray[Any]]:
    """The state columns of live records' values (each the covered offset, then a packed row)."""
    if layout is None:
        raise StateError(f"changelog {name!r} has rows but no layout record")
    descr = msgspec.json.decode(layout)
    dtype = np.dtype([("_covers", ">u8"), *((str(n), str(code)) for n, code in descr)])
    blob = b"".join(values)
    if len(blob) != dtype.itemsize * len(values):
        raise StateError(
            f"changelog {name!r} holds rows of another layout than its last ({descr}): the step's state"
            " changed shape; start a new group (or delete the changelog) to begin afresh"
        )
    rows = np.frombuffer(blob, dtype=dtype)
    return {str(n): rows[str(n)].copy() for n, _ in descr}
