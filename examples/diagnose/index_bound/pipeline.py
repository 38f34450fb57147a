"""Planted: a vector index searched exactly long past where a graph should take over. The first
five events each bring a bulk load of 10,000 documents (128-dimensional vectors); the rest are
queries about them. The index is told to search exactly up to a billion documents
(``exact_below``), so every query is a matrix product over all 50,000 of them, about a
millisecond each, and at 500 queries a second the step cannot keep up. ``aisp diagnose`` names
``index_bound`` and says to lower ``exact_below`` (an HNSW graph answers in microseconds).

    aisp run examples/diagnose/index_bound/pipeline.py --rate 500 --metrics-port 9464
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from aisp import Batch, NullSink, Pipeline, WorkloadFSource
from aisp.transform.text.vectors import VectorIndex

RATE = 500
BULK_EVENTS = 5
DOCS_PER_EVENT = 10_000
DIM = 128


def _docs(first: int, n: int) -> np.ndarray:
    v = np.random.default_rng(first).normal(size=(n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def as_rows(batch: Batch) -> Batch:
    """A bulk-load event: its documents' upserts; any other: a query near a loaded document."""
    ids = batch.numpy("id").astype(np.int64)
    ops: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    vectors: list[np.ndarray] = []
    for i in ids[ids < BULK_EVENTS]:
        ops.append(np.full(DOCS_PER_EVENT, "upsert"))
        keys.append(np.arange(i * DOCS_PER_EVENT, (i + 1) * DOCS_PER_EVENT).astype(str))
        vectors.append(_docs(int(i), DOCS_PER_EVENT))
    asked = ids[ids >= BULK_EVENTS]
    if asked.size:
        rng = np.random.default_rng(int(asked[0]))
        q = rng.normal(size=(asked.size, DIM)).astype(np.float32)
        ops.append(np.full(asked.size, "query"))
        keys.append(asked.astype(str))
        vectors.append(q / np.linalg.norm(q, axis=1, keepdims=True))
    if not ops:
        return batch.select([])
    return Batch.from_columns(
        {
            "op": pa.array(np.concatenate(ops)),
            "doc": pa.array(np.concatenate(keys)),
            "embedding": np.vstack(vectors),
        }
    )


def build(events: int = 10_000_000) -> Pipeline:
    p = Pipeline("index_bound", output_columns=["doc", "hits"])
    rows = p.source("events", WorkloadFSource(events=int(events))).map_batch("embed", as_rows)
    index = VectorIndex(dim=DIM, k=10, id_column="doc", exact_below=10**9)
    rows.vector_index("index", index).map_batch(
        "answer", lambda b: b.select(["doc", "hits", "_id", "_ingest_ns"])
    ).sink("out", NullSink())
    return p
