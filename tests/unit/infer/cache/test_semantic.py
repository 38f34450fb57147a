"""The semantic cache: a question in other words takes the stored answer (real MiniLM
embeddings), an unrelated one does not; answers expire; vectors and answers stay under the bound
with the least recently used out first."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch, padded
from aisp.errors import ConfigError
from aisp.infer.cache.response import HIT
from aisp.infer.cache.semantic import SCORE, SemanticCache
from aisp.infer.runtimes.text_encoder import TextEncoder, packaged_minilm
from aisp.transform.text.tokenize import TextTokenizer


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def rows(vectors: np.ndarray, answers: list[str] | None = None) -> Batch:
    cols: dict[str, object] = {
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), vectors.shape[1])
    }
    if answers is not None:
        cols["answer"] = pa.array(answers)
    return Batch.from_columns(cols)


@pytest.fixture(scope="module")
def embed() -> object:
    model, tokenizer_json = packaged_minilm()
    tokenizer = TextTokenizer(tokenizer_json, column="text")
    encoder = TextEncoder(model)

    def run(texts: list[str]) -> np.ndarray:
        tokens = tokenizer(Batch.from_columns({"text": pa.array(texts)}))
        return encoder.run({n: padded(tokens.column(n)) for n in encoder.input_names})["embedding"]

    return run


def test_a_question_in_other_words_takes_the_stored_answer(embed: object) -> None:
    cache = SemanticCache(["answer"], threshold=0.85)
    asked = embed(["How do I sort a list in Python?", "What is the capital of France?"])  # type: ignore[operator]
    assert not cache.lookup(rows(asked)).numpy(HIT).any()
    cache.store(rows(asked, ["use sorted()", "Paris"]))
    again = embed(
        ["how can I sort a Python list", "Which city is the capital of France?", "How do bees make honey?"]
    )  # type: ignore[operator]
    got = cache.lookup(rows(again))
    assert got.numpy(HIT).tolist() == [True, True, False]
    assert got.column("answer").to_pylist() == ["use sorted()", "Paris", None]
    scores = got.numpy(SCORE)
    assert (scores[:2] >= 0.85).all() and scores[2] < 0.85
    assert cache.stats()["hits"] == 2 and cache.stats()["misses"] == 3


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(2, 16))
def test_vectors_and_answers_stay_under_the_bound_and_recent_ones_stay(batches: int, dim: int) -> None:
    rng = np.random.default_rng(batches * 31 + dim)
    bound = 3000
    cache = SemanticCache(["answer"], max_bytes=bound, threshold=0.999)
    last = None
    for _ in range(batches):
        vectors = rng.normal(size=(5, dim)).astype(np.float32)
        cache.store(rows(vectors, [f"a{i}" for i in range(5)]))
        assert cache.bytes <= bound
        last = vectors
    assert last is not None
    assert cache.lookup(rows(last[-1:])).numpy(HIT).tolist() == [True]  # the newest is kept


def test_answers_expire() -> None:
    clock = Clock()
    cache = SemanticCache(["answer"], ttl_s=5, clock=clock)
    v = np.eye(4, dtype=np.float32)[:1]
    cache.store(rows(v, ["x"]))
    assert cache.lookup(rows(v)).numpy(HIT).tolist() == [True]
    clock.now = 6
    assert cache.lookup(rows(v)).numpy(HIT).tolist() == [False]


def test_a_semantic_cache_that_cannot_work_fails_where_declared() -> None:
    with pytest.raises(ConfigError):
        SemanticCache([])
    with pytest.raises(ConfigError):
        SemanticCache(["a"], threshold=1.5)
    cache = SemanticCache(["answer"])
    cache.store(rows(np.ones((1, 4), dtype=np.float32), ["x"]))
    with pytest.raises(ConfigError):
        cache.store(rows(np.ones((1, 3), dtype=np.float32), ["y"]))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 16), st.lists(st.integers(0, 4000), min_size=1, max_size=30))
def test_an_answer_larger_than_the_bound_is_not_stored_and_evicts_nothing(dim: int, sizes: list[int]) -> None:
    rng = np.random.default_rng(dim * 7 + len(sizes))
    bound = 2000
    cache = SemanticCache(["answer"], max_bytes=bound, threshold=0.999)
    for size in sizes:
        before = cache.stats()
        vector = rng.normal(size=(1, dim)).astype(np.float32)
        cache.store(rows(vector, ["x" * size]))
        after = cache.stats()
        assert cache.bytes <= bound
        if len(msgspec.msgpack.encode({"answer": "x" * size})) + dim * 4 > bound:  # too large alone
            assert after["too_large"] == before["too_large"] + 1
            assert (after["entries"], after["evictions"]) == (before["entries"], before["evictions"])
        else:
            assert cache.lookup(rows(vector)).numpy(HIT).tolist() == [True]
