from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.state.keyed import KeyedState, KeyIndex
from aisp.transform.operators import KeyBy, OperatorContext
from aisp.transform.stateful import RunningStats, occurrence_rank


def ctx() -> OperatorContext:
    return OperatorContext("t", lambda b, s, r: None)


def test_key_index_assigns_first_seen_codes() -> None:
    idx = KeyIndex()
    assert idx.encode(pa.array(["b", "a", "b"])).tolist() == [0, 1, 0]
    assert idx.encode(pa.array(["c", "b"])).tolist() == [2, 0]
    assert idx.keys() == ["b", "a", "c"]


def test_keyed_state_grows_and_keeps_values() -> None:
    s = KeyedState(initial_capacity=2)
    s.declare("n", "int64", 0)
    s.column("n")[1] = 5
    s.ensure(10)
    assert s.column("n").shape[0] >= 10 and s.column("n")[1] == 5 and s.column("n")[9] == 0


@given(st.lists(st.integers(0, 5), max_size=40))
def test_occurrence_rank_matches_loop(codes: list[int]) -> None:
    seen: dict[int, int] = {}
    expected = []
    for c in codes:
        expected.append(seen.get(c, 0))
        seen[c] = seen.get(c, 0) + 1
    assert occurrence_rank(np.array(codes, dtype=np.int64)).tolist() == expected


@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from("abcde"), st.floats(-1e6, 1e6, allow_nan=False)), max_size=20),
        max_size=6,
    )
)
def test_running_stats_equal_sequential_reference(batches: list[list[tuple[str, float]]]) -> None:
    c = ctx()
    key_op = KeyBy("user", "k").build(c)
    stats_op = RunningStats("amount", "k", count="n", sum="s", mean="m").build(c)
    count: dict[str, int] = {}
    total: dict[str, float] = {}
    for rows in batches:
        if not rows:
            continue
        b = Batch.from_columns({"user": [u for u, _ in rows], "amount": np.array([a for _, a in rows])})
        ((_, keyed),) = key_op.process(b)
        ((_, out),) = stats_op.process(keyed)
        for (u, a), n, s, m in zip(rows, out.numpy("n"), out.numpy("s"), out.numpy("m"), strict=True):
            count[u] = count.get(u, 0) + 1
            total[u] = total.get(u, 0.0) + a
            assert n == count[u]
            assert s == total[u]  # bit-exact: same order of float additions
            assert m == total[u] / count[u]


key_values = st.one_of(
    st.text(max_size=3),  # packs (UTF-8 up to 7 bytes... mostly)
    st.text(min_size=8, max_size=12),  # too long: dict path
)


@given(st.lists(st.lists(key_values, max_size=30), max_size=8))
def test_key_index_matches_a_dict_reference(batches: list[list[str]]) -> None:
    idx = KeyIndex()
    ref: dict[str, int] = {}
    for batch in batches:
        codes = idx.encode(pa.array(batch, type=pa.string())).tolist()
        assert codes == [ref.setdefault(k, len(ref)) for k in batch]
        assert len(idx) == len(ref)
    assert idx.keys() == list(ref)


@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30), max_size=8))
def test_integer_keys_are_packed_exactly(batches: list[list[int]]) -> None:
    idx = KeyIndex()
    ref: dict[int, int] = {}
    for batch in batches:
        codes = idx.encode(pa.array(batch, type=pa.int64())).tolist()
        assert codes == [ref.setdefault(k, len(ref)) for k in batch]
    assert idx.keys() == list(ref)


def test_sliced_string_columns_pack_correctly() -> None:
    arr = pa.array(["zz", "a", "bb", "a", "ccc"]).slice(1, 3)
    idx = KeyIndex()
    assert idx.encode(arr).tolist() == [0, 1, 0]
    assert idx.keys() == ["a", "bb"]


@given(
    st.lists(key_values, min_size=1, max_size=40, unique=True),
    st.lists(st.lists(st.integers(0, 10**6), min_size=256, max_size=600), max_size=5),
    st.integers(0, 3),
)
def test_repeating_keys_encode_each_distinct_key_once(
    pool: list[str], batches: list[list[int]], cut: int
) -> None:
    """Batches of a few keys in many rows take the dictionary path (and a sliced column too):
    the codes are still those of first appearance."""
    idx = KeyIndex()
    ref: dict[str, int] = {}
    for picks in batches:
        keys = [pool[i % len(pool)] for i in picks]
        arr = pa.array(["x"] * cut + keys, type=pa.string()).slice(cut)
        assert idx.encode(arr).tolist() == [ref.setdefault(k, len(ref)) for k in keys]
    assert idx.keys() == list(ref)
