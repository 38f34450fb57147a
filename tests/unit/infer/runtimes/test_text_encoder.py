"""The text encoder's pooling over length-sorted chunks: whatever the chunk sizes, each row gets
the mean of its own token vectors (the ones its mask keeps), in the batch's order, unit length."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp import PythonRuntime
from aisp.infer.cache.response import ResponseCache
from aisp.infer.runtimes.text_encoder import TextEncoder, token_keys

DIM = 3


def hidden(inputs: dict[str, Any]) -> dict[str, Any]:
    """A stand-in encoder: token j of row i is (id, id^2, 1) -- padding is seen as id 0."""
    ids = inputs["input_ids"].astype(np.float32)
    return {"last_hidden_state": np.stack([ids, ids**2, np.ones_like(ids)], axis=-1)}


MODEL = PythonRuntime(
    hidden, name="stand-in", input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"]
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=20), min_size=1, max_size=30),
    st.integers(1, 8),
    st.integers(1, 64),
)
def test_pooling_over_any_chunks_equals_each_rows_own_mean(
    rows: list[list[int]], chunk_rows: int, chunk_tokens: int
) -> None:
    width = max(len(r) for r in rows)
    ids = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.array([len(r) for r in rows])[:, None]).astype(np.int64)
    enc = TextEncoder(MODEL, chunk_rows=chunk_rows, chunk_tokens=chunk_tokens, normalize=False)
    got = enc.run({"input_ids": ids, "attention_mask": mask})["embedding"]
    want = np.array([[np.mean(r), np.mean(np.square(r)), 1.0] for r in rows], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    chunks = enc._chunks(np.sort(mask.sum(axis=1)))
    assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]] and chunks[-1][1] == len(rows)
    lengths = np.sort(mask.sum(axis=1))
    for start, end in chunks:
        assert end - start <= chunk_rows
        assert end - start == 1 or (end - start) * lengths[end - 1] <= chunk_tokens


def test_embeddings_are_unit_length_by_default() -> None:
    ids = np.array([[3, 4, 0], [1, 2, 5]], dtype=np.int64)
    got = TextEncoder(MODEL).run({"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64)})[
        "embedding"
    ]
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-6)


def pad(rows: list[list[int]], width: int) -> dict[str, Any]:
    ids = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.array([len(r) for r in rows])[:, None]).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), min_size=1, max_size=20),
    st.integers(0, 6),
)
def test_a_rows_key_ignores_its_padding_and_tells_texts_apart(rows: list[list[int]], extra: int) -> None:
    width = max(len(r) for r in rows)
    narrow, wide = pad(rows, width), pad(rows, width + extra)
    keys = token_keys(narrow, narrow["attention_mask"])
    assert (keys == token_keys(wide, wide["attention_mask"])).all()
    distinct = {tuple(r) for r in rows}
    assert len(set(keys.tolist())) == len(distinct)  # equal texts share a key, others do not


def test_an_encoder_with_a_cache_embeds_each_text_once_and_keeps_the_order() -> None:
    calls: list[int] = []

    def counted(inputs: dict[str, Any]) -> dict[str, Any]:
        calls.append(len(inputs["input_ids"]))
        return hidden(inputs)

    model = PythonRuntime(
        counted,
        name="counted",
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
    )
    cache = ResponseCache(["text"], ["embedding"])
    enc = TextEncoder(model, cache=cache)
    assert enc.output_names == ("embedding", "cached")
    first = enc.run(pad([[3, 4], [5]], 2))
    assert sum(calls) == 2 and not first["cached"].any()
    again = enc.run(pad([[7, 8, 9], [5], [3, 4]], 3))  # two known texts, padded wider, reordered
    assert sum(calls) == 3 and again["cached"].tolist() == [False, True, True]
    alone = TextEncoder(MODEL).run(pad([[7, 8, 9], [5], [3, 4]], 3))["embedding"]
    np.testing.assert_allclose(again["embedding"], alone, rtol=1e-6)
    assert cache.stats()["hits"] == 2
