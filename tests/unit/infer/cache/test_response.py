"""The response cache: a stored answer comes back equal; a key the Bloom filter never saw costs
no store lookup; answers expire after their TTL; the stored bytes stay under the bound."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.infer.cache.response import HIT, BloomFilter, ResponseCache


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_a_bloom_filter_never_forgets_a_key(keys: list[int]) -> None:
    bloom = BloomFilter(bits=4096, hashes=3)
    arr = np.array(keys, dtype=np.uint64)
    bloom.add(arr)
    assert bloom.may_contain(arr).all()


def test_a_bloom_filter_turns_most_unseen_keys_away() -> None:
    rng = np.random.default_rng(0)
    bloom = BloomFilter(bits=1 << 16, hashes=4)
    bloom.add(rng.integers(0, 2**63, 2000, dtype=np.uint64))
    assert bloom.may_contain(rng.integers(0, 2**63, 10_000, dtype=np.uint64)).mean() < 0.01


def texts(values: list[str], answers: list[float] | None = None) -> Batch:
    cols: dict[str, object] = {"text": pa.array(values)}
    if answers is not None:
        cols["score"] = np.array(answers)
    return Batch.from_columns(cols)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_input_gets_the_stored_answer_and_an_unseen_one_costs_no_lookup() -> None:
    cache = ResponseCache(["text"], ["score"])
    first = cache.lookup(texts(["a", "b"]))
    assert not first.numpy(HIT).any() and cache.lookups == 0 and cache.bloom_negatives == 2
    cache.store(texts(["a", "b"], [0.25, 0.5]))
    again = cache.lookup(texts(["b", "c", "a"]))
    assert again.numpy(HIT).tolist() == [True, False, True]
    assert again.column("score").to_pylist() == [0.5, None, 0.25]
    assert cache.lookups == 2 and cache.stats()["hits"] == 2  # "c": turned away by the filter


def test_answers_expire_and_the_store_stays_under_its_bound() -> None:
    clock = Clock()
    cache = ResponseCache(["text"], ["score"], ttl_s=10, max_bytes=2000, clock=clock)
    cache.store(texts(["x"], [1.0]))
    clock.now = 11
    assert not cache.lookup(texts(["x"])).numpy(HIT).any()  # expired
    for i in range(0, 5000, 100):
        cache.store(texts([f"t{j}" for j in range(i, i + 100)], [float(j) for j in range(i, i + 100)]))
        assert cache.bytes <= 2000
    assert cache.evictions > 0
    recent = cache.lookup(texts(["t4999", "t0"]))
    assert recent.numpy(HIT).tolist() == [True, False]  # the least recently used went first


def test_a_cache_that_cannot_work_fails_where_declared() -> None:
    with pytest.raises(ConfigError):
        ResponseCache([], ["score"])
    with pytest.raises(ConfigError):
        ResponseCache(["text"], ["score"], max_bytes=0)


def words(values: list[str], answers: list[str]) -> Batch:
    return Batch.from_columns({"text": pa.array(values), "answer": pa.array(answers)})


@settings(max_examples=60, deadline=None)
@given(
    st.integers(64, 2000),
    st.lists(st.integers(0, 3000), min_size=1, max_size=40),
)
def test_an_answer_larger_than_the_bound_is_not_stored_and_evicts_nothing(
    max_bytes: int, sizes: list[int]
) -> None:
    cache = ResponseCache(["text"], ["answer"], max_bytes=max_bytes)
    for i, size in enumerate(sizes):
        before = cache.stats()
        cache.store(words([f"q{i}"], ["x" * size]))
        after = cache.stats()
        assert cache.bytes <= max_bytes
        if len(msgspec.msgpack.encode({"answer": "x" * size})) > max_bytes:  # too large on its own
            assert after["entries"] == before["entries"] and after["evictions"] == before["evictions"]
            assert after["too_large"] == before["too_large"] + 1
            assert not cache.lookup(words([f"q{i}"], [""])).numpy(HIT).any()
            continue
        assert cache.lookup(words([f"q{i}"], [""])).numpy(HIT).all()  # what fits is stored


def test_one_huge_answer_leaves_the_stored_ones_in_place() -> None:
    cache = ResponseCache(["text"], ["answer"], max_bytes=10_000)
    cache.store(words([f"q{i}" for i in range(100)], ["an answer"] * 100))
    stored = cache.stats()["entries"]
    cache.store(words(["huge"], ["y" * 20_000]))
    assert cache.stats()["entries"] == stored == 100 and cache.stats()["too_large"] == 1
    assert cache.stats()["evictions"] == 0
