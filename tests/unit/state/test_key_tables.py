"""Key-space primitives (``aisp.state.key_tables``): keys packed into uint64 and unpacked back
(as Python values and as Arrow), the batch-probed hash table and the sorted-runs set against
plain dict and set models, and the Python key hashes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.state.key_tables import HashTable, SortedRuns, key_hashes, pack_keys, unpack, unpack_arrow

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
SHORT = st.text(max_size=7).filter(lambda s: len(s.encode()) <= 7)  # packs: at most 7 UTF-8 bytes


def packed(keys: pa.Array) -> tuple[str, np.ndarray]:
    result = pack_keys(keys)
    assert result is not None
    return result


@settings(max_examples=60, deadline=None)
@given(st.lists(INT64, max_size=40))
def test_integer_keys_pack_injectively_and_unpack_to_themselves(keys: list[int]) -> None:
    kind, values = packed(pa.array(keys, pa.int64()))
    assert kind == "int" and values.dtype == np.uint64 and values.shape == (len(keys),)
    assert unpack(kind, values) == keys
    assert unpack_arrow(kind, values).to_pylist() == keys
    for i, a in enumerate(keys):  # equal packed values exactly for equal keys
        assert [int(v) == int(values[i]) for v in values] == [b == a for b in keys]


@settings(max_examples=60, deadline=None)
@given(st.lists(SHORT, max_size=40))
def test_short_string_keys_pack_injectively_and_unpack_to_themselves(keys: list[str]) -> None:
    kind, values = packed(pa.array(keys, pa.string()))
    assert kind == "str" and values.dtype == np.uint64 and values.shape == (len(keys),)
    assert unpack(kind, values) == keys
    arrow = unpack_arrow(kind, values)
    assert arrow.type == pa.string() and arrow.to_pylist() == keys
    for i, a in enumerate(keys):
        assert [int(v) == int(values[i]) for v in values] == [b == a for b in keys]


@settings(max_examples=40, deadline=None)
@given(st.lists(SHORT, min_size=1, max_size=30), st.data())
def test_a_sliced_string_array_packs_as_its_values(keys: list[str], data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(keys)))
    length = data.draw(st.integers(0, len(keys) - start))
    sliced = pa.array(keys, pa.string()).slice(start, length)
    kind, values = packed(sliced)
    assert kind == "str"
    expected = packed(pa.array(keys[start : start + length], pa.string()))[1]
    assert values.tolist() == expected.tolist()
    assert unpack(kind, values) == keys[start : start + length]


@settings(max_examples=30, deadline=None)
@given(st.lists(INT64, min_size=1, max_size=30), st.data())
def test_a_sliced_integer_array_packs_as_its_values(keys: list[int], data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(keys)))
    kind, values = packed(pa.array(keys, pa.int64()).slice(start))
    assert kind == "int" and unpack(kind, values) == keys[start:]


def test_the_length_byte_keeps_trailing_nul_bytes_and_empty_strings_apart() -> None:
    keys = ["", "\x00", "a", "a\x00", "a\x00\x00", "\x00a"]
    kind, values = packed(pa.array(keys))
    assert len(set(values.tolist())) == len(keys)
    assert unpack(kind, values) == keys
    assert values[0] == 0  # the empty string: no bytes, length 0
    assert values.view(np.uint8).reshape(-1, 8)[:, 7].tolist() == [0, 1, 1, 2, 3, 2]


def test_narrow_integer_types_pack_as_int64() -> None:
    for arrow_type in (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint32()):
        kind, values = packed(pa.array([0, 5, 100], arrow_type))
        assert kind == "int" and unpack(kind, values) == [0, 5, 100]


def test_empty_columns_pack_to_nothing() -> None:
    for keys in (pa.array([], pa.string()), pa.array([], pa.int64())):
        result = pack_keys(keys)
        assert result is not None and result[1].shape == (0,)
        assert unpack(result[0], result[1]) == []
        assert unpack_arrow(result[0], result[1]).to_pylist() == []
    kind, values = packed(pa.array(["", ""]))  # strings with no data bytes at all
    assert unpack(kind, values) == ["", ""] and values.tolist() == [0, 0]


def test_columns_that_cannot_pack_losslessly_are_refused() -> None:
    assert pack_keys(pa.array(["abcdefg"])) is not None  # 7 bytes: the most that packs
    assert pack_keys(pa.array(["a", "abcdefgh"])) is None  # 8 bytes
    assert pack_keys(pa.array(["éééé"])) is None  # 4 characters, 8 UTF-8 bytes
    kind, values = packed(pa.array(["ééé"]))  # 6 bytes
    assert unpack(kind, values) == ["ééé"]
    assert pack_keys(pa.array(["a"], pa.large_string())) is None
    assert pack_keys(pa.array([b"a"], pa.binary())) is None
    assert pack_keys(pa.array([1.5])) is None


def test_uint64_keys_above_the_int64_range_unpack_to_themselves() -> None:
    kind, values = packed(pa.array([2**64 - 1, 2**63], pa.uint64()))
    assert unpack(kind, values) == [2**64 - 1, 2**63]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(UINT64, max_size=600, unique=True), max_size=5),
    st.lists(UINT64, max_size=50),
)
def test_hash_table_finds_what_was_inserted_like_a_dict(batches: list[list[int]], probes: list[int]) -> None:
    table = HashTable(bits=4)  # small: inserting grows (rehashes) it
    model: dict[int, int] = {}
    for batch in batches:
        new = [k for k in batch if k not in model]  # insert takes distinct absent keys
        codes = list(range(len(model), len(model) + len(new)))
        table.insert(np.array(new, dtype=np.uint64), np.array(codes, dtype=np.int64))
        model.update(zip(new, codes, strict=True))
        assert table.size == len(model)
        assert 3 * table.size <= table.codes.shape[0]  # the load stays at most 1/3
        everything = list(model)
        found = table.find(np.array(everything, dtype=np.uint64))
        assert found.tolist() == [model[k] for k in everything]
    asked = table.find(np.array(probes, dtype=np.uint64))
    assert asked.dtype == np.int64 and asked.tolist() == [model.get(k, -1) for k in probes]


def test_hash_table_holds_zero_and_the_largest_key() -> None:
    table = HashTable()
    assert table.find(np.array([0, 7], dtype=np.uint64)).tolist() == [-1, -1]  # empty slots hold key 0
    table.insert(np.array([0, 2**64 - 1], dtype=np.uint64), np.array([5, 9], dtype=np.int64))
    assert table.find(np.array([2**64 - 1, 1, 0], dtype=np.uint64)).tolist() == [9, -1, 5]
    assert table.find(np.array([], dtype=np.uint64)).tolist() == []


def test_hash_table_grows_to_the_smallest_size_that_keeps_the_load_at_a_third() -> None:
    table = HashTable(bits=4)  # 16 slots: room for 5 keys
    table.insert(np.arange(5, dtype=np.uint64), np.arange(5, dtype=np.int64))
    assert table.codes.shape[0] == 16
    table.insert(np.array([5], dtype=np.uint64), np.array([5], dtype=np.int64))
    assert table.codes.shape[0] == 32
    table.insert(np.arange(6, 100, dtype=np.uint64), np.arange(6, 100, dtype=np.int64))
    assert table.codes.shape[0] == 512 and table.size == 100  # 3 * 100 > 256
    assert table.find(np.arange(101, dtype=np.uint64)).tolist() == [*range(100), -1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 60), max_size=20), max_size=12),
    st.lists(st.integers(0, 70), max_size=30),
)
def test_sorted_runs_hold_a_set_of_values(adds: list[list[int]], probes: list[int]) -> None:
    runs = SortedRuns()
    model: set[int] = set()
    for values in adds:
        runs.add(np.array(values, dtype=np.uint64))
        model.update(values)
        assert runs.values().tolist() == sorted(model)
        assert bool(len(runs)) == bool(model)
    hits = runs.contains(np.array(probes, dtype=np.uint64))
    assert hits.dtype == np.bool_ and hits.tolist() == [p in model for p in probes]


def test_sorted_runs_merge_runs_of_similar_size() -> None:
    runs = SortedRuns()
    runs.add(np.array([5, 3], dtype=np.uint64))
    runs.add(np.array([9, 3], dtype=np.uint64))  # as large as the last run: merged into one
    assert len(runs) == 3 and runs.values().tolist() == [3, 5, 9]
    assert runs.contains(np.array([3, 4, 9, 2**64 - 1], dtype=np.uint64)).tolist() == [
        True,
        False,
        True,
        False,
    ]
    empty = SortedRuns()
    empty.add(np.array([], dtype=np.uint64))
    assert len(empty) == 0 and empty.values().tolist() == []
    assert empty.contains(np.array([0], dtype=np.uint64)).tolist() == [False]


def test_sorted_runs_count_each_value_once() -> None:
    runs = SortedRuns()
    runs.add(np.arange(10, dtype=np.uint64))
    runs.add(np.array([3], dtype=np.uint64))  # a run of one beside one of ten: not merged
    assert runs.values().tolist() == list(range(10))
    assert len(runs) == 10


def test_key_hashes_are_the_python_hashes_as_uint64() -> None:
    keys: list[object] = ["a", "customer-0001", 7, -1, (1, "x")]
    hashes = key_hashes(keys)
    assert hashes.dtype == np.uint64
    assert hashes.tolist() == [hash(k) % 2**64 for k in keys]
    assert key_hashes([]).tolist() == []
