"""What a partition's checkpoint puts in changelog records and takes back: keyed rows, a window
step's open windows (one record per key and window start), the partition's event-time progress;
and which records a write sends."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from aisp.connectors.kafka.records import EVENT_TIME_STEP, changes, record_sets, to_checkpoint
from aisp.state.store import decode_keys, encode_names


def _windows(keys: list[str], starts: list[int], n: list[int]) -> pa.Table:
    return pa.table({
        "_key": keys, "__window": np.array(starts, dtype=np.int64), "__end": np.array(starts) + 10,
        "__first_id": np.array(starts, dtype=np.int64) * 7, "n": np.array(n, dtype=np.int64),
    })  # fmt: skip


def test_keyed_rows_windows_and_event_time_come_back_from_their_records() -> None:
    tables = {
        "keys.by_user": pa.table({"key": ["u1", "u2"]}),
        "op.stats": pa.table({"count": np.array([3, 4], dtype=np.int64)}),
        "win.per_user": _windows(["u1", "u1", "u2"], [0, 10, 0], [1, 2, 3]),
    }
    meta: dict[str, Any] = {
        "spaces": {"stats": "by_user"},
        "windows": ["per_user"],
        "event_time": {"events": 77},
    }
    sets = {step: (keys, columns) for step, keys, columns in record_sets(tables, meta)}
    assert set(sets) == {"stats", "per_user", EVENT_TIME_STEP}
    window_keys = sets["per_user"][0].to_pylist()
    assert len(set(window_keys)) == 3  # one record per (key, window start)
    back: dict[str, pa.Table] = {}
    event_time: dict[str, int] = {}
    for step, (keys, columns) in sets.items():  # as a restore decodes the record keys
        decoded = pa.array(decode_keys(b"", encode_names(b"", keys.to_pylist())))
        to_checkpoint(step, (decoded, columns), back, event_time)
    assert event_time == {"events": 77}
    assert back["op.stats"].column("_key").to_pylist() == ["u1", "u2"]
    assert back["op.stats"].column("count").to_pylist() == [3, 4]
    assert back["win.per_user"].select(["_key", "__window", "n"]).to_pylist() == (
        tables["win.per_user"].select(["_key", "__window", "n"]).to_pylist()
    )


def test_a_write_sends_the_windows_that_changed_opened_or_closed() -> None:
    def records(table: pa.Table) -> tuple[pa.Array, dict[str, Any]]:
        ((_, keys, columns),) = record_sets({"win.w": table}, {"spaces": {}, "windows": ["w"]})
        return keys, columns

    empty = records(_windows([], [], []))
    first = records(_windows(["a", "b"], [0, 0], [1, 1]))
    changed, gone = changes(*first, empty, set())  # after every window had closed
    assert changed.tolist() == [True, True] and gone == []
    second = records(_windows(["a", "b", "b"], [0, 0, 10], [1, 2, 1]))
    changed, gone = changes(*second, first, set())
    assert changed.tolist() == [False, True, True] and gone == []
    third = records(_windows(["b"], [10], [1]))
    changed, gone = changes(*third, second, set())
    assert changed.tolist() == [False] and len(gone) == 2  # a's and b's first windows closed
