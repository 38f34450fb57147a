"""In-memory keyed state (``aisp.state.keyed``): ``KeyIndex`` codes against a dict model across
batches (packed keys, the dict path and a switch between them, dictionary-encoded batches),
eviction and its reports, restores and frozen key snapshots; ``KeyedState`` columns against a
model of declared columns, growth and snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import StateError
from aisp.state.keyed import KeyedState, KeyIndex, KeyPartitionError

POOLS: dict[str, list[Any]] = {
    "short strings": [f"u{i}" for i in range(16)],  # packed into uint64
    "long strings": [f"customer-{i:04d}" for i in range(16)],  # the dict path
    "integers": [i * 1_000_003 - 7 for i in range(16)],
    "short then long": [f"u{i}" for i in range(8)] + [f"customer-{i:04d}" for i in range(8)],
}


def as_array(keys: list[Any], chunked: bool) -> pa.Array:
    if chunked and len(keys) > 1:  # encode combines the chunks
        half = len(keys) // 2
        return pa.chunked_array([pa.array(keys[:half]), pa.array(keys[half:])])
    return pa.array(keys)


class Model:
    """Codes in first-seen order, the epoch each key was last seen in, the keys ever evicted."""

    def __init__(self) -> None:
        self.keys: list[Any] = []
        self.seen: dict[Any, int] = {}
        self.evicted: set[Any] = set()
        self.epoch = 0

    def encode(self, batch: list[Any]) -> list[int]:
        for k in batch:
            if k not in self.keys:
                self.keys.append(k)
            self.seen[k] = self.epoch
        return [self.keys.index(k) for k in batch]


@settings(max_examples=60, deadline=None)
@given(
    pool=st.sampled_from(sorted(POOLS)),
    batches=st.lists(st.tuples(st.lists(st.integers(0, 15), max_size=12), st.booleans()), max_size=8),
    probe=st.lists(st.integers(0, 15), max_size=6),
)
def test_keys_get_dense_codes_in_first_seen_order_across_batches(
    pool: str, batches: list[tuple[list[int], bool]], probe: list[int]
) -> None:
    keys = POOLS[pool]
    if pool == "short then long":  # packed first, then a long key switches to the dict path
        batches = sorted(batches, key=lambda b: any(i >= 8 for i in b[0]))
    idx, model = KeyIndex(), Model()
    for picks, chunked in batches:
        batch = [keys[i] for i in picks]
        codes = idx.encode(as_array(batch, chunked))
        assert codes.dtype == np.int64 and codes.tolist() == model.encode(batch)
        assert len(idx) == len(model.keys) and idx.keys() == model.keys
    assert idx.frozen_keys()().to_pylist() == model.keys
    known = [i for i in probe if i < len(model.keys)]
    assert idx.keys_of(np.array(known, dtype=np.int64)) == [model.keys[i] for i in known]
    assert idx.frozen_keys(np.array(known, dtype=np.int64))().to_pylist() == [model.keys[i] for i in known]
    assert not idx.was_evicted(np.arange(len(idx), dtype=np.int64)).any()


@pytest.mark.parametrize("seed", range(4))
def test_large_batches_of_repeating_strings_get_the_same_codes(seed: int) -> None:
    """Batches of 256 rows or more whose strings repeat are dictionary-encoded first (each
    distinct key once): the codes are those a dict model assigns."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)] + [f"a-long-key-{i}" for i in range(40 * (seed % 2))]
    idx, model = KeyIndex(), Model()
    for batch_no in range(24):
        distinct = int(rng.integers(2, len(words)))
        picks = rng.integers(0, distinct, size=int(rng.integers(256, 600))).tolist()
        if batch_no % 5 == 4:  # now and then mostly distinct keys: judged not to repeat for a while
            picks = rng.permutation(len(words)).tolist() * 7
        batch = [words[i] for i in picks]
        assert idx.encode(pa.array(batch)).tolist() == model.encode(batch)
    assert idx.keys() == model.keys


def test_null_keys_are_refused() -> None:
    idx = KeyIndex()
    with pytest.raises(ValueError, match=r"^key column has 2 null value\(s\)$"):
        idx.encode(pa.array(["a", None, None]))
    assert len(idx) == 0


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_restored_index_gives_every_key_its_old_code(pool: str) -> None:
    keys = POOLS[pool]
    idx = KeyIndex()
    for start in (5, 0, 11, 3):
        idx.encode(pa.array(keys[start : start + 6]))
    restored = KeyIndex()
    restored.restore(pa.array(idx.keys()))
    assert restored.keys() == idx.keys()
    probe = pa.array([keys[i] for i in (15, 0, 7, 3, 15)])
    assert restored.encode(probe).tolist() == idx.encode(probe).tolist()
    with pytest.raises(ValueError, match="restore needs an empty key index; this one has 16 keys"):
        restored.restore(pa.array(keys[:1]))
    with pytest.raises(ValueError, match="restored keys are not unique"):
        KeyIndex().restore(pa.array([keys[1], keys[2], keys[1]]))


@settings(max_examples=60, deadline=None)
@given(
    pool=st.sampled_from(sorted(POOLS)),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("encode"), st.lists(st.integers(0, 15), max_size=8)),
            st.tuples(st.just("advance"), st.just([])),
            st.tuples(st.just("evict"), st.lists(st.integers(0, 10), min_size=1, max_size=1)),
        ),
        max_size=25,
    ),
)
def test_eviction_forgets_the_least_recently_seen_cold_keys(
    pool: str, ops: list[tuple[str, list[int]]]
) -> None:
    keys = POOLS[pool]
    idx, model = KeyIndex(), Model()
    evictions = 0
    for op, args in ops:
        if op == "encode":
            batch = [keys[i] for i in args]
            codes = idx.encode(pa.array(batch, pa.int64() if pool == "integers" else pa.string()))
            assert codes.tolist() == model.encode(batch)
            assert idx.was_evicted(codes).tolist() == [k in model.evicted for k in batch]
        elif op == "advance":
            idx.advance()
            model.epoch += 1
            assert idx.epoch == model.epoch
        else:
            (keep,) = args
            cold = [k for k in model.keys if model.seen[k] < model.epoch]
            count = min(len(model.keys) - keep, len(cold))
            survivors = idx.evict(keep=keep)
            if count <= 0:
                assert survivors is None
            else:
                assert survivors is not None and survivors.dtype == np.int64
                old = survivors.tolist()
                assert old == sorted(set(old)) and len(old) == len(model.keys) - count
                victims = [k for i, k in enumerate(model.keys) if i not in old]
                assert set(victims) <= set(cold)  # none seen since the last advance
                kept_cold = [model.seen[k] for k in cold if k not in victims]
                assert max(model.seen[k] for k in victims) <= min(kept_cold, default=model.epoch)
                model.keys = [model.keys[i] for i in old]
                model.evicted.update(victims)
                evictions += count
        assert idx.keys() == model.keys and len(idx) == len(model.keys) and idx.evicted == evictions
    probe = [keys[i] for i in range(16)]  # every key: evicted ones come back with new codes
    codes = idx.encode(pa.array(probe))
    assert codes.tolist() == model.encode(probe)
    assert idx.was_evicted(codes).tolist() == [k in model.evicted for k in probe]


def test_drop_without_remembering_is_not_reported_as_evicted() -> None:
    for keys in (["a", "b", "c"], ["key-aaaaaaaa", "key-bbbbbbbb", "key-cccccccc"]):
        idx = KeyIndex()
        idx.encode(pa.array(keys))
        assert idx.drop(np.array([0, 2], dtype=np.int64), remember=False).tolist() == [1]
        assert idx.keys() == [keys[1]] and idx.evicted == 0
        codes = idx.encode(pa.array(keys))
        assert codes.tolist() == [1, 0, 2] and not idx.was_evicted(codes).any()
        assert idx.drop(np.array([1], dtype=np.int64), remember=True).tolist() == [0, 2]
        assert idx.was_evicted(idx.encode(pa.array(keys))).tolist() == [True, False, False]
        assert idx.evicted == 1


def test_keys_marked_evicted_are_reported_on_every_path() -> None:
    ints = KeyIndex()
    ints.mark_evicted(pa.array([7, 9]))
    assert ints.was_evicted(ints.encode(pa.array([9, 8, 7]))).tolist() == [True, False, True]
    long = KeyIndex()
    long.mark_evicted(pa.array(["customer-0001"]))
    codes = long.encode(pa.array(["customer-0002", "customer-0001"]))
    assert codes.tolist() == [0, 1] and long.was_evicted(codes).tolist() == [False, True]
    mixed = KeyIndex()  # packed ints evicted, then string keys: both remembered
    mixed.mark_evicted(pa.array([1, 2]))
    mixed.mark_evicted(pa.array(["x"]))
    assert mixed.was_evicted(mixed.encode(pa.array([2, 3]))).tolist() == [True, False]
    assert mixed.keys() == [2, 3]


@pytest.mark.parametrize("pool", ["short strings", "long strings", "integers"])
def test_frozen_keys_stay_as_they_were_through_growth_and_eviction(pool: str) -> None:
    keys = POOLS[pool]
    idx = KeyIndex()
    idx.encode(pa.array(keys[:4]))
    every, some = idx.frozen_keys(), idx.frozen_keys(np.array([3, 1], dtype=np.int64))
    more: list[Any] = (
        list(range(10**9, 10**9 + 3000)) if pool == "integers" else [f"k{i}" for i in range(3000)]
    )
    idx.encode(pa.array(more))  # past the first 1024 codes: the arrays grow
    idx.advance()
    idx.encode(pa.array(more[:5]))
    survivors = idx.evict(keep=5)
    assert survivors is not None and survivors.tolist() == list(range(4, 9))
    assert idx.keys() == more[:5]
    assert every().to_pylist() == keys[:4]
    assert some().to_pylist() == [keys[3], keys[1]]
    assert KeyIndex().frozen_keys()().to_pylist() == []


def test_partitions_follow_their_keys_through_eviction() -> None:
    idx = KeyIndex()
    codes = idx.encode(pa.array(["a", "b", "c", "d"]))
    assert idx.partitions_of(codes).tolist() == [-1, -1, -1, -1]  # none tagged yet
    idx.tag(codes[:3], np.array([4, 5, 4], dtype=np.int64))
    assert idx.partitions_of(codes).tolist() == [4, 5, 4, -1]
    idx.advance()
    idx.encode(pa.array(["c"]))
    survivors = idx.evict(keep=1)
    assert survivors is not None and survivors.tolist() == [2]
    assert idx.partitions_of(np.array([0], dtype=np.int64)).tolist() == [4]
    assert idx.codes_in([4]).tolist() == [0] and idx.codes_in([5]).tolist() == []
    assert issubclass(KeyPartitionError, StateError)


def test_an_unsigned_key_and_a_negative_key_get_different_codes() -> None:
    idx = KeyIndex()
    assert idx.encode(pa.array([2**64 - 1], pa.uint64())).tolist() == [0]
    assert idx.encode(pa.array([-1], pa.int64())).tolist() == [1]
    assert idx.keys() == [2**64 - 1, -1]


DTYPES = [np.int64, np.float64, np.bool_, np.int32]


@settings(max_examples=60, deadline=None)
@given(
    initial=st.integers(1, 40),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("declare"), st.integers(0, 2), st.integers(0, 3), st.integers(-3, 3)),
            st.tuples(st.just("ensure"), st.integers(0, 200), st.just(0), st.just(0)),
            st.tuples(st.just("set"), st.integers(0, 2), st.integers(0, 199), st.integers(-9, 9)),
        ),
        max_size=30,
    ),
    size=st.integers(0, 200),
)
def test_keyed_state_columns_equal_a_model(
    initial: int, ops: list[tuple[str, int, int, int]], size: int
) -> None:
    state = KeyedState(initial)
    capacity = initial
    declared: dict[str, tuple[Any, int]] = {}  # name -> (dtype, default)
    values: dict[str, dict[int, int]] = {}
    for op, a, b, c in ops:
        name = "abc"[a % 3]
        if op == "declare":
            state.declare(name, DTYPES[b], c)
            if name not in declared:  # a second declare keeps the first
                declared[name] = (DTYPES[b], c)
                values[name] = {}
        elif op == "ensure":
            state.ensure(a)
            if a > capacity:
                capacity = max(a, 2 * capacity)
        elif name in declared and b < capacity:
            state.column(name)[b] = c
            values[name][b] = c
        assert state.names == sorted(declared)
        for n, (dtype, _) in declared.items():
            assert state.column(n).dtype == dtype and state.column(n).shape == (capacity,)
    size = min(size, capacity)
    snapshot = state.snapshot(size)

    def expected(n: str, rows: range) -> list[Any]:
        dtype, default = declared[n]
        out: list[Any] = np.array([values[n].get(i, default) for i in rows], dtype=dtype).tolist()
        return out

    assert sorted(snapshot) == sorted(declared)
    for n in declared:
        assert snapshot[n].tolist() == expected(n, range(size))
    state.ensure(size)
    rows = np.arange(size, dtype=np.int64)[::-1].copy()
    taken = state.take(rows)
    assert taken.names == state.names
    for n in declared:
        column = taken.column(n)
        assert column.shape == (max(1024, 2 * size),) and column.dtype == declared[n][0]
        assert column[:size].tolist() == expected(n, range(size - 1, -1, -1))
        assert column[size:].tolist() == expected(n, range(10**6, 10**6 + column.shape[0] - size))
    if snapshot:  # a snapshot is a copy: later writes do not reach it
        n = next(iter(snapshot))
        before = snapshot[n].tolist()
        state.column(n)[:size] = 1
        assert snapshot[n].tolist() == before


def test_keyed_state_row_dtype_and_undeclared_columns() -> None:
    state = KeyedState(4)
    state.declare("sum", np.float64, 0.5)
    state.declare("count", np.int32)
    assert state.row_dtype() == np.dtype([("count", np.int32), ("sum", np.float64)])
    assert state.column("sum").tolist() == [0.5] * 4
    with pytest.raises(KeyError, match=r"undeclared state 'mean'; declared: \['count', 'sum'\]"):
        state.column("mean")
    state.ensure(3)  # within the capacity: nothing grows
    assert state.column("count").shape == (4,)
    state.column("count")[3] = 7
    state.ensure(5)  # doubles
    assert state.column("count").tolist() == [0, 0, 0, 7, 0, 0, 0, 0]
    state.ensure(100)  # past double: exactly what was asked
    assert state.column("sum").shape == (100,) and state.column("sum")[99] == 0.5
