"""The vector index step with its two HNSW backends, usearch and faiss, side by side (and exact
search for reference): upserts/s, queries/s, recall@10 against exact search, and the cost of
updates and deletes, on the same vectors in the same run, the backends alternating, median of
``--rounds``.

The vectors: ``--docs`` 384-dimensional unit vectors in ``--clusters`` clusters of a
48-dimensional subspace, with a little noise in all 384 (a sentence encoder's embeddings cluster
by topic and vary along far fewer directions than they have; uniform random vectors, the hardest
case for HNSW, are unlike them), upserted in batches of ``--batch`` rows as a stream would bring
them; then
``--queries`` queries (perturbed documents) in batches; then 5% of the documents updated and 5%
deleted, and the queries again (no result may name a deleted document or a replaced vector).

    python benchmarks/bench_vector_index.py [--docs 50000 --queries 2000 --batch 256 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch
from aisp.transform.operators import OperatorContext
from aisp.transform.text.vectors import VectorIndex, VectorIndexOp

DIM = 384
LATENT = 48  # sentence embeddings vary along far fewer directions than they have


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def data(docs: int, queries: int, clusters: int, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(DIM, LATENT)))[0].T  # LATENT orthonormal rows in DIM
    centres = rng.normal(size=(clusters, LATENT))
    latent = centres[rng.integers(0, clusters, docs)] + rng.normal(scale=0.5, size=(docs, LATENT))
    vectors = unit(latent @ basis + rng.normal(scale=0.01, size=(docs, DIM)))
    picked = latent[rng.integers(0, docs, queries)] + rng.normal(scale=0.3, size=(queries, LATENT))
    asked = unit(picked @ basis + rng.normal(scale=0.01, size=(queries, DIM)))
    changed = rng.choice(docs, size=docs // 10, replace=False)
    return {
        "vectors": vectors,
        "queries": asked,
        "updated": changed[: docs // 20],
        "deleted": changed[docs // 20 :],
    }


def rows(op: str, ids: np.ndarray, vectors: np.ndarray | None = None) -> Batch:
    cols: dict[str, Any] = {"op": pa.array([op] * len(ids)), "id": pa.array(ids.astype(str))}
    if vectors is not None:
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), DIM)
    return Batch.from_columns(cols)


def search(op: VectorIndexOp, queries: np.ndarray, batch: int) -> tuple[list[list[str]], float]:
    hits: list[list[str]] = []
    t0 = time.perf_counter()
    for i in range(0, len(queries), batch):
        ((_, out),) = op.process(
            rows("query", np.arange(i, i + len(queries[i : i + batch])), queries[i : i + batch])
        )
        hits += out.column("hits").to_pylist()
    return hits, time.perf_counter() - t0


def run(backend: str, d: dict[str, np.ndarray], batch: int) -> dict[str, Any]:
    exact = backend == "exact"
    spec = VectorIndex(
        dim=DIM, k=10, exact_below=10**9 if exact else 0, backend="usearch" if exact else backend
    )
    op: VectorIndexOp = spec.build(OperatorContext("index", lambda *a, **k: None))  # type: ignore[assignment]
    vectors, ids = d["vectors"], np.arange(len(d["vectors"]))
    t0 = time.perf_counter()
    for i in range(0, len(ids), batch):
        op.process(rows("upsert", ids[i : i + batch], vectors[i : i + batch]))
    upsert_s = time.perf_counter() - t0
    before, query_s = search(op, d["queries"], batch)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    new = unit(vectors[d["updated"]] + rng.normal(scale=0.6, size=(len(d["updated"]), DIM)))
    for i in range(0, len(d["updated"]), batch):
        op.process(rows("upsert", d["updated"][i : i + batch], new[i : i + batch]))
    for i in range(0, len(d["deleted"]), batch):
        op.process(rows("delete", d["deleted"][i : i + batch]))
    change_s = time.perf_counter() - t0
    after, query_after_s = search(op, d["queries"], batch)
    deleted = set(d["deleted"].astype(str).tolist())
    stale = sum(len(deleted & set(h)) for h in after)
    n = len(d["queries"])
    return {
        "upserts_per_s": len(ids) / upsert_s, "queries_per_s": n / query_s,
        "queries_per_s_after_changes": n / query_after_s, "changes_per_s": len(d["updated"]) * 2 / change_s,
        "stale_hits": stale, "before": before, "after": after,
    }  # fmt: skip


def recall(got: list[list[str]], truth: list[list[str]]) -> float:
    return sum(len(set(g) & set(t)) for g, t in zip(got, truth, strict=True)) / sum(len(t) for t in truth)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--clusters", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    d = data(args.docs, args.queries, args.clusters)
    truth = run("exact", d, args.batch)
    results: dict[str, list[dict[str, Any]]] = {"usearch": [], "faiss": []}
    for _ in range(args.rounds):
        for backend in results:  # alternating
            results[backend].append(run(backend, d, args.batch))
    out: dict[str, Any] = {
        "docs": args.docs,
        "queries": args.queries,
        "clusters": args.clusters,
        "batch": args.batch,
    }
    out["exact"] = {k: round(v, 1) for k, v in truth.items() if k.endswith("per_s")}
    for backend, runs in results.items():
        med = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0] if k.endswith("per_s")}
        med["recall_at_10"] = round(statistics.median(recall(r["before"], truth["before"]) for r in runs), 4)
        med["recall_at_10_after_changes"] = round(
            statistics.median(recall(r["after"], truth["after"]) for r in runs), 4
        )
        med["stale_hits"] = max(r["stale_hits"] for r in runs)
        out[backend] = med
    out["faiss_over_usearch"] = {
        k: round(out["faiss"][k] / out["usearch"][k], 2) for k in out["usearch"] if k.endswith("per_s")
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
