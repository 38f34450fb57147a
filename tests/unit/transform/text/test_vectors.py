"""The vector index step: upserts, deletes and queries in order; exact below its threshold, an
HNSW graph (usearch or faiss) above it with high recall; a deleted or replaced vector never
comes back; its documents survive a checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.observe.retrieval import RetrievalConfidence
from aisp.transform.operators import OperatorContext
from aisp.transform.text.vectors import VectorIndex, VectorIndexOp

DIM = 8


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def rows(op: str, ids: list[Any], vectors: np.ndarray) -> Batch:
    return Batch.from_columns({"op": pa.array([op] * len(ids)), "id": pa.array([str(i) for i in ids]),
                               "embedding": vectors})  # fmt: skip


def index(dead: list[Any] | None = None, **settings: Any) -> VectorIndexOp:
    def dead_letter(batch: Batch, step: str, reason: str, fields: Any = None) -> None:
        if dead is not None:
            dead.append((batch.num_rows, reason))

    spec = VectorIndex(dim=settings.pop("dim", DIM), **settings)
    return spec.build(OperatorContext("index", dead_letter))  # type: ignore[return-value]


def answers(op: VectorIndexOp, queries: np.ndarray) -> list[list[str]]:
    ((port, out),) = op.process(rows("query", list(range(len(queries))), queries))
    return out.column("hits").to_pylist()  # type: ignore[no-any-return]


ops = st.lists(
    st.tuples(st.sampled_from(["upsert", "delete", "query"]), st.integers(0, 15), st.integers(0, 2**31)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([1000, 0]), st.sampled_from(["usearch", "faiss"]))
def test_queries_see_exactly_the_live_documents_in_order(
    script: list[tuple[str, int, int]], exact_below: int, backend: str
) -> None:
    op = index(k=5, exact_below=exact_below, backend=backend)
    live: dict[str, np.ndarray] = {}
    for kind, doc, seed in script:
        vec = unit(np.random.default_rng(seed), 1)
        if kind == "upsert":
            op.process(rows("upsert", [doc], vec))
            live[str(doc)] = vec[0]
        elif kind == "delete":
            op.process(rows("delete", [doc], vec))
            live.pop(str(doc), None)
        else:
            (got,) = answers(op, vec)
            assert set(got) <= set(live), "a deleted or replaced document came back"
            if exact_below:  # exact: the true top 5
                sims = {d: float(v @ vec[0]) for d, v in live.items()}
                assert (
                    got == sorted(sims, key=lambda d: (-sims[d], int(d)))[:5]
                    or len(got) == len(sims) == 0
                    or (sorted(sims[d] for d in got) == sorted(sorted(sims.values())[::-1][:5]))
                )
    assert op.size == len(live)


@pytest.mark.parametrize("backend", ["usearch", "faiss"])
def test_the_graph_finds_the_exact_top_10_almost_always(backend: str) -> None:
    rng = np.random.default_rng(3)
    centres = unit(rng, 40, 32)
    docs = centres[rng.integers(0, 40, 4000)] + 0.3 * rng.normal(size=(4000, 32)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = unit(rng, 200, 32)
    graph, exact = index(dim=32, exact_below=100, backend=backend), index(dim=32, exact_below=10**6)
    for op in (graph, exact):
        op.process(rows("upsert", list(range(4000)), docs))
    hits = [
        len(set(g) & set(e)) for g, e in zip(answers(graph, queries), answers(exact, queries), strict=True)
    ]
    assert sum(hits) / (10 * len(queries)) >= 0.95


def test_near_duplicates_arriving_in_batches_each_find_themselves_and_the_graph_is_the_same() -> None:
    """usearch inserts a batch's rows in order (``add_threads=1``): each document is linked to
    the near-duplicates before it in its batch, so a document's own vector finds it first, and
    the same stream gives the same answers however it was cut into batches. (Inserted by 16
    threads, 8 to 10 of these documents were out of their own vector's reach.)"""
    rng = np.random.default_rng(0)
    docs = np.repeat(unit(rng, 60, 64), 25, axis=0) + 0.02 * rng.normal(size=(1500, 64)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    order = rng.permutation(len(docs))
    found = []
    for size in (64, 100):
        op = index(dim=64, exact_below=0)
        for i in range(0, len(docs), size):
            op.process(rows("upsert", order[i : i + size].tolist(), docs[order[i : i + size]]))
        found.append(answers(op, docs))
    assert [hits[0] for hits in found[0]] == [str(i) for i in range(len(docs))]
    assert found[0] == found[1]


@pytest.mark.parametrize("exact_below", [10**6, 50])
def test_a_restored_index_answers_as_the_one_checkpointed(exact_below: int) -> None:
    rng = np.random.default_rng(5)
    op = index(exact_below=exact_below)
    op.process(rows("upsert", list(range(300)), unit(rng, 300)))
    op.process(rows("delete", list(range(0, 300, 3)), unit(rng, 100)))
    op.process(rows("upsert", list(range(1, 300, 3)), unit(rng, 100)))  # updates
    state = {k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in op.snapshot().items()}
    again = index(exact_below=exact_below)
    again.restore(state)
    queries = unit(rng, 50)
    assert again.size == op.size == 200
    got, want = answers(again, queries), answers(op, queries)
    if exact_below > 200:  # exact search: the same answers
        assert got == want
    else:  # a graph built anew (in one pass, its inserts threaded) differs in what it misses
        assert sum(len(set(g) & set(w)) for g, w in zip(got, want, strict=True)) >= 0.97 * 10 * len(want)
        assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 0.95 * len(want)


def test_rows_of_an_unknown_op_are_dead_letters_and_the_rest_goes_on() -> None:
    dead: list[Any] = []
    op = index(dead)
    rng = np.random.default_rng(1)
    batch = Batch.from_columns({"op": pa.array(["upsert", "drop", "query"]), "id": pa.array(["a", "b", "c"]),
                                "embedding": unit(rng, 3)})  # fmt: skip
    ((_, out),) = op.process(batch)
    assert out.column("hits").to_pylist() == [["a"]] and dead == [
        (1, "'op' must be one of ['upsert', 'delete', 'query']")
    ]


def test_settings_that_cannot_work_fail_where_declared() -> None:
    with pytest.raises(ConfigError, match="backend"):
        VectorIndex(dim=4, backend="annoy")
    with pytest.raises(ConfigError, match="dim and k"):
        VectorIndex(dim=0)
    with pytest.raises(ConfigError, match="add_threads"):
        VectorIndex(dim=4, add_threads=-1)


@pytest.mark.parametrize("exact_below", [4096, 0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_queries_moving_away_from_the_corpus_raise_one_alert_and_aligned_ones_never(
    exact_below: int, seed: int
) -> None:
    """A corpus in half of the space; queries near its documents, then (after a seeded number of
    batches of seeded sizes) a seeded share of them from the other half: no alert before the shift,
    one after it, within the windows it takes to fill with the new share."""
    rng = np.random.default_rng(seed)
    print("seed", seed)
    dim, docs = 16, int(rng.integers(50, 400))
    corpus = np.zeros((docs, dim), dtype=np.float32)
    corpus[:, : dim // 2] = unit(rng, docs, dim // 2)
    raised: list[dict[str, Any]] = []
    cfg = RetrievalConfidence(threshold=0.6, target_share=0.2, window_queries=int(rng.integers(50, 200)),
                              consecutive=int(rng.integers(1, 4)), alert=raised.append)  # fmt: skip
    op = index(dim=dim, exact_below=exact_below, confidence=cfg)
    op.process(rows("upsert", list(range(docs)), corpus))

    def queries(n: int, off_share: float) -> np.ndarray:
        q = corpus[rng.integers(0, docs, n)] + 0.05 * rng.normal(size=(n, dim)).astype(np.float32)
        off = rng.random(n) < off_share
        q[off] = 0.0
        q[off, dim // 2 :] = unit(rng, int(off.sum()), dim // 2)
        return q / np.linalg.norm(q, axis=1, keepdims=True)

    sent = 0
    for _ in range(int(rng.integers(5, 15))):
        n = int(rng.integers(1, 100))
        answers(op, queries(n, 0.0))
        sent += n
    assert raised == [], "aligned queries raised an alert"
    share = float(rng.uniform(0.4, 0.9))
    before = op.spec.counters.stats()["low"]
    shifted = 0
    while shifted < 6 * cfg.window_queries:
        n = int(rng.integers(1, 100))
        answers(op, queries(n, share))
        shifted += n
    assert len(raised) == 1, raised
    assert raised[0]["share"] > 0.2
    stats = op.spec.counters.stats()
    assert stats["queries"] == sent + shifted
    assert stats["index"]["documents"] == docs and stats["index"]["exact"] == float(exact_below > docs)
    assert stats["search_seconds"] > 0
    assert (stats["low"] - before) / shifted == pytest.approx(share, abs=0.15)


def test_an_alert_target_that_cannot_work_fails_where_declared() -> None:
    from aisp import Pipeline, WorkloadFSource
    from aisp.errors import GraphError

    stream = Pipeline("p").source("s", WorkloadFSource(events=1))
    with pytest.raises(GraphError, match="retrieval confidence alert target"):
        stream.vector_index(
            "index", VectorIndex(dim=4, confidence=RetrievalConfidence(alert="ftp://nowhere"))
        )
