"""Planted: queries that moved away from the index. The first 2,000 events are documents upserted
into a vector index (random directions in the first half of a 32-dimensional space: the corpus);
the rest are queries. Half of them ask about a document (its vector with a little noise); the
other half about a topic the corpus does not hold (directions in the other half of the space,
orthogonal to every document), as when a new product's questions reach a help desk whose
documents predate it. Answers stay fast; half of them quote passages with nothing to do with the
question, which ``aisp diagnose`` names as ``retrieval_confidence``.

    aisp run examples/diagnose/retrieval_confidence/pipeline.py --rate 5000 --metrics-port 9464
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from aisp import Batch, NullSink, Pipeline, WorkloadFSource
from aisp.observe.retrieval import RetrievalConfidence
from aisp.transform.text.vectors import VectorIndex

RATE = 5_000
CORPUS = 2_000
DIM = 32
OFF_TOPIC_SHARE = 0.5
_HALF = DIM // 2
_DOCS = np.random.default_rng(7).normal(size=(CORPUS, _HALF)).astype(np.float32)


def as_rows(batch: Batch) -> Batch:
    """Each event as an upsert (document ``id``) or a query (about document ``id mod CORPUS``,
    or off the corpus), deterministic by event id."""
    ids = batch.numpy("id").astype(np.int64)
    rng = np.random.default_rng(ids[:1] if len(ids) else 0)
    vectors = np.zeros((len(ids), DIM), dtype=np.float32)
    doc = ids < CORPUS
    off = ~doc & (rng.random(len(ids)) < OFF_TOPIC_SHARE)
    on = ~doc & ~off
    vectors[doc, :_HALF] = _DOCS[ids[doc]]
    vectors[on, :_HALF] = _DOCS[ids[on] % CORPUS] + 0.2 * rng.normal(size=(int(on.sum()), _HALF))
    vectors[off, _HALF:] = rng.normal(size=(int(off.sum()), _HALF))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ops = np.where(doc, "upsert", "query")
    return batch.with_columns({"op": pa.array(ops), "doc": pa.array(ids.astype(str)), "embedding": vectors})


def build(events: int = 10_000_000, alert: str = "log") -> Pipeline:
    """``alert``: where the confidence alert goes (a log line; a webhook, a Redis or NATS stream)."""
    p = Pipeline("retrieval_confidence", output_columns=["id", "hits", "scores"])
    rows = p.source("events", WorkloadFSource(events=int(events))).map_batch("embed", as_rows)
    index = VectorIndex(
        dim=DIM, k=5, id_column="doc",
        confidence=RetrievalConfidence(threshold=0.5, target_share=0.2, window_queries=500, alert=alert),
    )  # fmt: skip
    rows.vector_index("index", index).map_batch(
        "answer", lambda b: b.select(["id", "hits", "scores", "_id", "_ingest_ns"])
    ).sink("out", NullSink())
    return p
