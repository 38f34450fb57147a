"""A bounded hot layer: keys evicted at checkpoints, their state read back from the store."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.state.keyed import KeyIndex
from aisp.state.store import LmdbStateStore
from aisp.transform.operators import KeyBy, OperatorContext
from aisp.transform.stateful import RunningStats

POOLS = {
    "short strings": [f"u{i}" for i in range(12)],  # packed into uint64
    "long strings": [f"customer-{i:04d}" for i in range(12)],  # the dict path
    "integers": [i * 1_000_003 for i in range(12)],
}


@settings(max_examples=25, deadline=None)
@given(
    pool=st.sampled_from(sorted(POOLS)),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=15), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    keep=st.integers(1, 6),
)
def test_running_stats_with_evictions_equal_a_sequential_reference(
    pool: str, steps: list[tuple[list[int], bool]], keep: int
) -> None:
    keys = POOLS[pool]
    with tempfile.TemporaryDirectory() as d:
        store = LmdbStateStore(Path(d))
        c = OperatorContext("t", lambda b, s, r: None)
        key_op = KeyBy("user", "k").build(c)
        stats = RunningStats("amount", "k", count="n", sum=None, mean="m").build(c)
        stats.page_from(store, b"stats\x1f")  # type: ignore[attr-defined]
        index = c.key_index("k")
        count: dict[object, int] = {}
        total: dict[object, float] = {}
        recent: set[object] = set()  # seen since the last checkpoint: never evicted
        for version, (picks, checkpoint) in enumerate(steps, start=1):
            users = [keys[i] for i in picks]
            recent.update(users)
            amounts = np.arange(len(users), dtype=np.float64) + version
            ((_, keyed),) = key_op.process(Batch.from_columns({"user": users, "amount": amounts}))
            ((_, out),) = stats.process(keyed)
            expected_n, expected_m = [], []
            for u, a in zip(users, amounts.tolist(), strict=True):
                count[u] = count.get(u, 0) + 1
                total[u] = total.get(u, 0.0) + a
                expected_n.append(count[u])
                expected_m.append(total[u] / count[u])
            assert out.numpy("n").tolist() == expected_n
            assert np.allclose(out.numpy("m"), expected_m)
            if checkpoint:  # as the executor does: dirty rows taken, eviction, then the write
                codes, columns = stats.take_dirty()  # type: ignore[attr-defined]
                dirty_keys = index.frozen_keys(codes)
                survivors = index.evict(keep=keep) if len(index) > keep else None
                if survivors is not None:
                    stats.evict(survivors)  # type: ignore[attr-defined]
                index.advance()
                store.write_rows(version, {"stats\x1f": (dirty_keys(), columns)})
                assert len(index) <= max(keep, len(recent))
                recent.clear()
        store.close()


def test_evicted_keys_come_back_with_new_codes_and_are_reported() -> None:
    idx = KeyIndex()
    idx.encode(pa.array([10, 20, 30]))
    idx.advance()
    idx.encode(pa.array([40]))
    idx.advance()
    idx.encode(pa.array([30]))
    survivors = idx.evict(keep=2)  # 10 and 20 were seen longest ago
    assert survivors is not None and survivors.tolist() == [2, 3]
    assert idx.keys() == [30, 40] and idx.evicted == 2
    codes = idx.encode(pa.array([20, 50, 30]))
    assert codes.tolist() == [2, 3, 0]
    assert idx.was_evicted(codes).tolist() == [True, False, False]


def test_keys_seen_since_the_last_checkpoint_are_never_evicted() -> None:
    idx = KeyIndex()
    idx.encode(pa.array(["a", "b", "c"]))
    assert idx.evict(keep=1) is None  # all seen in this epoch: their state is not in the store yet
    idx.advance()
    idx.encode(pa.array(["b", "c"]))
    assert idx.evict(keep=1) is not None and idx.keys() == ["b", "c"]


def test_marked_keys_are_reported_evicted_also_after_a_switch_to_the_dict_path() -> None:
    idx = KeyIndex()
    idx.mark_evicted(pa.array(["a", "bb"]))
    assert idx.was_evicted(idx.encode(pa.array(["bb", "zz"]))).tolist() == [True, False]
    codes = idx.encode(pa.array(["a", "a-key-longer-than-seven-bytes"]))  # switches to the dict path
    assert idx.was_evicted(codes).tolist() == [True, False]


@pytest.mark.parametrize("writer_process", [False, True])
def test_latest_reads_the_newest_value_of_each_name(tmp_path: Path, writer_process: bool) -> None:
    store = LmdbStateStore(tmp_path, writer_process=writer_process)
    store.write(1, [b"p\x1fa", b"p\x1fab"], [b"1", b"2"])
    store.write(3, [b"p\x1fa"], [b"3"])
    store.write(2, [b"p\x1fb"], [b"4"])
    assert store.latest([b"p\x1fa", b"p\x1fab", b"p\x1fb", b"p\x1fc", b"p\x1f", b"q"]) == [
        b"3", b"2", b"4", None, None, None,
    ]  # fmt: skip
    store.close()


def test_keys_are_tagged_with_their_input_partition_and_dropped_by_it() -> None:
    from aisp.state.keyed import KeyPartitionError

    idx = KeyIndex()
    codes = idx.encode(pa.array(["a", "b", "c"]))
    idx.tag(codes, np.array([0, 1, 0]))
    assert idx.codes_in([0]).tolist() == [0, 2] and idx.codes_in([1, 5]).tolist() == [1]
    with pytest.raises(KeyPartitionError, match="key 'b' arrives from input partitions 1 and 0"):
        idx.tag(idx.encode(pa.array(["b"])), np.array([0]))
    fresh = KeyIndex()  # a new key from two partitions within one batch
    with pytest.raises(KeyPartitionError, match="key 'x' arrives from input partitions 2 and 3"):
        fresh.tag(fresh.encode(pa.array(["y", "x", "y", "x"])), np.array([1, 3, 1, 2]))
    survivors = idx.drop(idx.codes_in([0]), remember=False)
    assert survivors.tolist() == [1] and idx.keys() == ["b"] and idx.codes_in([1]).tolist() == [0]
    assert not idx.was_evicted(idx.encode(pa.array(["a"]))).any()  # forgotten, not in a store


def test_a_partition_is_claimed_by_one_owner_at_a_time(tmp_path: Path) -> None:
    import threading

    from aisp.errors import StateError
    from aisp.state.partitions import PartitionStates

    first = PartitionStates(tmp_path, claim_timeout_s=0.3)
    assert first.claim(3) is None  # no state yet
    assert first.write(3, {"keys.k": pa.table({"key": ["a"]})}, {"offset": 7})
    second = PartitionStates(tmp_path, claim_timeout_s=0.3)
    with pytest.raises(StateError, match="input partition 3's state stayed locked"):
        second.claim(3)
    second = PartitionStates(tmp_path, claim_timeout_s=10)
    threading.Timer(0.3, first.release, args=(3,)).start()  # the owner lets go: the claim goes on
    checkpoint = second.claim(3)
    assert checkpoint is not None and checkpoint.meta["offset"] == 7 and second.owned == [3]
    assert not first.write(3, {}, {"offset": 8})  # released: an old owner writes nothing
    second.close()
