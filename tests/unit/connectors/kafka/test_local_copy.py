"""Local copies of changelog state: the tail of a changelog applied to a copy gives what the
whole changelog gives, and a copy is used only when the group's committed offset covers it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.connectors.kafka.local_copy import LocalCopies, LocalCopy, merge_tail

NAMES = ["u1", "u2", "u3", "u4", "u5"]
states = st.dictionaries(st.sampled_from(NAMES), st.integers(0, 100), max_size=5)
tails = st.lists(st.tuples(st.sampled_from(NAMES), st.one_of(st.none(), st.integers(0, 100))), max_size=12)


def rows(state: dict[str, int]) -> tuple[pa.Array, dict[str, np.ndarray]]:
    keys = sorted(state)
    return pa.array(keys, pa.string()), {"n": np.asarray([state[k] for k in keys], dtype=np.int64)}


def as_dict(merged: tuple[pa.Array, dict[str, np.ndarray]] | None) -> dict[str, int]:
    if merged is None:
        return {}
    keys, columns = merged
    return dict(zip(keys.to_pylist(), columns["n"].tolist(), strict=True))


@settings(max_examples=200, deadline=None)
@given(base=states, tail=tails)
def test_a_tail_merged_into_a_copy_equals_the_state_the_whole_log_gives(
    base: dict[str, int], tail: list[tuple[str, int | None]]
) -> None:
    last: dict[str, int | None] = {}
    for key, value in tail:  # a changelog resolves to each key's last record
        last.pop(key, None)
        last[key] = value
    live = [k for k, v in last.items() if v is not None]
    gone = [k for k, v in last.items() if v is None]
    encode = msgspec.msgpack.encode
    # as a takeover reads it: no rows (not even empty columns) when the tail holds only tombstones
    columns = {"n": np.asarray([last[k] for k in live], dtype=np.int64)} if live else {}
    merged = merge_tail(
        "t", rows(base) if base else None, [encode(k) for k in live], columns, [encode(k) for k in gone]
    )
    expected = {k: v for k, v in {**base, **last}.items() if v is not None}
    assert as_dict(merged) == expected


def test_the_newest_copy_the_committed_offset_covers_is_used(tmp_path: Path) -> None:
    copies = LocalCopies(tmp_path, every_s=0.0)
    assert copies.due(3)
    copies.save(3, LocalCopy(10, {"t": 4}, {"s": rows({"u1": 1})}, {"s": {b"\xa2u9"}}))
    copies.save(3, LocalCopy(20, {"t": 9}, {"s": rows({"u1": 2, "u2": 1})}))
    newest = copies.load(3, committed=25)
    assert newest is not None and newest.covers == 20 and newest.ends == {"t": 9}
    assert as_dict(newest.steps["s"]) == {"u1": 2, "u2": 1}
    older = copies.load(3, committed=15)  # the commit of offset 20 never landed
    assert older is not None and older.covers == 10 and as_dict(older.steps["s"]) == {"u1": 1}
    assert older.stale == {"s": {b"\xa2u9"}}
    assert copies.load(3, committed=5) is None
    assert copies.load(3, committed=None) is None  # the group never committed: nothing counts
    assert copies.load(4, committed=25) is None


def test_a_copy_older_than_tombstones_are_kept_is_not_used(tmp_path: Path) -> None:
    LocalCopies(tmp_path).save(0, LocalCopy(10, {"t": 4}, {"s": rows({"u1": 1})}))
    assert LocalCopies(tmp_path).load(0, 10) is not None
    assert LocalCopies(tmp_path, max_age_s=-1.0).load(0, 10) is None


def test_nothing_is_kept_of_a_partition_never_read(tmp_path: Path) -> None:
    copies = LocalCopies(tmp_path)
    copies.save(0, LocalCopy(-1, {}, {}))
    assert not (tmp_path / "p-0").exists()
