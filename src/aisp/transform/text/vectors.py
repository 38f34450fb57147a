"""A vector index fed and queried by the stream: documents upserted and deleted by id, queries
answered with the top k documents by similarity.

Each row of the step's input says what it is in ``op``: ``upsert`` (its ``id`` and ``vector``
enter the index, replacing that id's earlier vector), ``delete`` (its ``id`` leaves) or
``query`` (its ``vector`` is searched). Rows are applied in order, so a query sees every upsert
and delete before it; the step emits the query rows, each with ``hits`` (the ids, best first)
and ``scores`` (inner products: cosine similarity for unit vectors, as ``TextEncoder`` makes).
Order matters, so the steps before it must keep it: a model step with several instances
(``BatcherConfig.instances``) hands batches on as their calls end unless it is
``BatcherConfig(ordered=True)``.
Upserts and deletes are consumed. Replaying them is idempotent: an id has one vector, the last
one written.

The index: while it holds at most ``exact_below`` documents, an exact search (one matrix
product); past that an HNSW graph (``backend``: ``usearch``, the default, or ``faiss``). A
document's vector is stored under a label of its own, new at each upsert; an update or a delete
retires the old label at once (removed from usearch's graph; faiss's HNSW cannot remove, so its
results are filtered and the graph is rebuilt once retired labels outnumber live ones), so a
deleted or replaced vector never comes back from a search. The live documents' ids and vectors
are the step's checkpointed state: a restart rebuilds the graph from them, with nothing to
embed again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.observe.retrieval import ConfidenceWindow, RetrievalConfidence, RetrievalCounters
from aisp.state.keyed import KeyIndex
from aisp.transform.operators import Emit, Operator, OperatorContext

__all__ = ["VectorIndex"]

_OPS = ("upsert", "delete", "query")


@dataclass(frozen=True, kw_only=True)
class VectorIndex:
    """The vector index step's settings (see the module docstring)."""

    dim: int
    k: int = 10
    id_column: str = "id"
    vector_column: str = "embedding"
    op_column: str = "op"
    hits_column: str = "hits"
    scores_column: str = "scores"
    backend: str = "usearch"
    exact_below: int = 2048
    connectivity: int = 16
    expansion_search: int = 64
    add_threads: int = 1
    """Threads that insert a batch into usearch's graph. 1: in row order, each document linked
    to the ones before it in its batch, so the same stream makes the same graph on every machine
    and every replay; more insert faster, but a batch's documents then miss each other, and
    near-duplicates (one text in several documents) can fall out of reach of a search (0: one per
    core). faiss inserts with its own OpenMP threads."""
    payload_column: str | None = None
    """A column kept with each document (its text, say): queries get the hits' values in
    ``payloads_column``, best first (what a RAG prompt quotes). Checkpointed with the vectors."""
    payloads_column: str = "passages"
    confidence: RetrievalConfidence | None = None
    """Alert when the queries stop matching the index: the share of queries whose best score is
    under a threshold, over sliding windows (``aisp.observe.retrieval``)."""
    counters: RetrievalCounters = field(default_factory=RetrievalCounters, compare=False, repr=False)
    """Every query's scores, for ``/metrics`` (``aisp_retrieval_*``) and ``aisp diagnose``."""

    def __post_init__(self) -> None:
        if self.dim < 1 or self.k < 1:
            raise ConfigError(f"dim and k must be >= 1, got dim={self.dim}, k={self.k}")
        if self.backend not in ("usearch", "faiss"):
            raise ConfigError(f"backend must be 'usearch' or 'faiss', got {self.backend!r}")
        if self.add_threads < 0:
            raise ConfigError(f"add_threads must be >= 0 (0: one per core), got {self.add_threads}")

    def build(self, ctx: OperatorContext) -> Operator:
        return VectorIndexOp(self, ctx)


class _Usearch:
    def __init__(self, spec: VectorIndex) -> None:
        from usearch.index import Index

        self.index = Index(
            ndim=spec.dim, metric="ip", dtype="f32", connectivity=spec.connectivity,
            expansion_search=spec.expansion_search,
        )  # fmt: skip
        self.removes = True
        self.threads = spec.add_threads

    def add(self, labels: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None:
        self.index.add(labels.astype(np.uint64), vectors, threads=self.threads)

    def remove(self, labels: npt.NDArray[np.int64]) -> None:
        self.index.remove(labels.astype(np.uint64))

    def search(self, queries: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        found = self.index.search(queries, k)
        keys = np.asarray(found.keys, dtype=np.int64).reshape(len(queries), -1)
        scores = 1.0 - np.asarray(found.distances, dtype=np.float32).reshape(len(queries), -1)
        counts = np.asarray(getattr(found, "counts", [keys.shape[1]])).reshape(-1)
        keys[np.arange(keys.shape[1])[None, :] >= counts[:, None]] = -1
        return keys, scores


class _Faiss:
    def __init__(self, spec: VectorIndex) -> None:
        import faiss

        graph = faiss.IndexHNSWFlat(spec.dim, spec.connectivity * 2, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efSearch = spec.expansion_search
        self.index = faiss.IndexIDMap2(graph)
        self.removes = False

    def add(self, labels: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None:
        self.index.add_with_ids(vectors, labels)

    def remove(self, labels: npt.NDArray[np.int64]) -> None:  # HNSW cannot: results are filtered
        pass

    def search(self, queries: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        scores, keys = self.index.search(queries, k)
        return keys.astype(np.int64), scores.astype(np.float32)


class VectorIndexOp:
    """The running index (see the module docstring)."""

    def __init__(self, spec: VectorIndex, ctx: OperatorContext) -> None:
        self.spec, self._ctx = spec, ctx
        self._docs = KeyIndex()  # document id -> code
        self._label_of = np.full(1024, -1, dtype=np.int64)  # code -> live label (-1: none)
        self._vectors = np.zeros((1024, spec.dim), dtype=np.float32)  # by label
        self._code_of = np.full(1024, -1, dtype=np.int64)  # label -> code (-1: retired)
        self._payload = np.full(1024, None, dtype=object)  # code -> the document's payload
        self._labels = 0
        self._retired = 0
        self._graph: _Usearch | _Faiss | None = None
        self._lock = threading.Lock()
        self.confidence: ConfidenceWindow | None = None
        if spec.confidence is not None:  # a broker stream's target connects now: unreachable fails the start
            alert = ctx.alerts(spec.confidence.alert, "retrieval confidence")
            self.confidence = ConfidenceWindow(ctx.step_id, spec.confidence, spec.counters, alert)

    @property
    def size(self) -> int:
        """Documents in the index."""
        return self._labels - self._retired

    # -- the stream ---------------------------------------------------------------------------
    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        ops = batch.column(spec.op_column).to_numpy(zero_copy_only=False).astype(str)
        unknown = ~np.isin(ops, _OPS)
        if unknown.any():
            bad = np.flatnonzero(unknown)
            self._ctx.dead_letter(
                batch.take(bad), self._ctx.step_id, f"{spec.op_column!r} must be one of {list(_OPS)}"
            )
        answered: list[Batch] = []
        starts = np.flatnonzero(np.r_[True, ops[1:] != ops[:-1]])  # runs of one op, in order
        for start, end in zip(starts, np.r_[starts[1:], len(ops)], strict=True):
            rows = np.arange(start, end)[~unknown[start:end]]
            if not rows.size:
                continue
            part = batch.take(rows)
            if ops[start] == "upsert":
                self._upsert(part)
            elif ops[start] == "delete":
                self._delete(part)
            else:
                answered.append(self._query(part))
        if not answered:
            return []
        return [(DEFAULT_PORT, answered[0] if len(answered) == 1 else Batch.concat(answered))]

    def flush(self) -> Emit:
        return []

    def _vectors_of(self, part: Batch) -> npt.NDArray[np.float32]:
        vectors = np.asarray(part.numpy(self.spec.vector_column), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.spec.dim:
            raise ValueError(
                f"{self.spec.vector_column!r} has shape {vectors.shape}, not (rows, {self.spec.dim})"
            )
        return np.ascontiguousarray(vectors)

    def _codes(self, part: Batch) -> npt.NDArray[np.int64]:
        col = part.column(self.spec.id_column)
        codes = self._docs.encode(col if pa.types.is_string(col.type) else col.cast(pa.string()))
        if codes.size and codes.max() >= self._label_of.shape[0]:
            grown = np.full(max(int(codes.max()) + 1, 2 * self._label_of.shape[0]), -1, dtype=np.int64)
            grown[: self._label_of.shape[0]] = self._label_of
            self._label_of = grown
            payload = np.full(grown.shape[0], None, dtype=object)
            payload[: self._payload.shape[0]] = self._payload
            self._payload = payload
        return codes

    def _upsert(self, part: Batch) -> None:
        vectors, codes = self._vectors_of(part), self._codes(part)
        # an id written twice in one run: its last row wins
        last = np.unique(codes[::-1], return_index=True)[1]
        keep = np.sort(len(codes) - 1 - last)
        codes, vectors = codes[keep], vectors[keep]
        if self.spec.payload_column is not None:
            self._payload[codes] = np.asarray(part.pylist(self.spec.payload_column), dtype=object)[keep]
        with self._lock:
            self._retire(codes)
            labels = np.arange(self._labels, self._labels + len(codes), dtype=np.int64)
            self._grow(self._labels + len(codes))
            self._vectors[labels] = vectors
            self._code_of[labels] = codes
            self._label_of[codes] = labels
            self._labels += len(codes)
            if self._graph is not None:
                self._graph.add(labels, vectors)
            elif self.size > self.spec.exact_below:
                self._rebuild()

    def _delete(self, part: Batch) -> None:
        codes = self._codes(part)
        with self._lock:
            self._retire(np.unique(codes))

    def _retire(self, codes: npt.NDArray[np.int64]) -> None:
        old = self._label_of[codes]
        old = old[old >= 0]
        if not old.size:
            return
        self._label_of[codes] = -1
        self._code_of[old] = -1
        self._retired += int(old.size)
        if self._graph is not None:
            self._graph.remove(old)
        if self._retired > max(self.size, 1024):  # compact the labels (and rebuild the graph)
            self._rebuild()

    def _grow(self, labels: int) -> None:
        if labels <= self._vectors.shape[0]:
            return
        size = max(labels, 2 * self._vectors.shape[0])
        vectors = np.zeros((size, self.spec.dim), dtype=np.float32)
        vectors[: self._labels] = self._vectors[: self._labels]
        code_of = np.full(size, -1, dtype=np.int64)
        code_of[: self._labels] = self._code_of[: self._labels]
        self._vectors, self._code_of = vectors, code_of

    def _rebuild(self) -> None:
        """The HNSW graph of the live documents (also compacts the labels)."""
        live = np.flatnonzero(self._code_of[: self._labels] >= 0)
        codes, vectors = self._code_of[live], self._vectors[live].copy()
        self._labels = self._retired = 0
        self._label_of[:] = -1
        self._code_of[:] = -1
        labels = np.arange(len(codes), dtype=np.int64)
        self._vectors[labels] = vectors
        self._code_of[labels] = codes
        self._label_of[codes] = labels
        self._labels = len(codes)
        self._graph = None
        if self._labels > self.spec.exact_below:
            self._graph = _Usearch(self.spec) if self.spec.backend == "usearch" else _Faiss(self.spec)
            self._graph.add(labels, vectors)

    def _query(self, part: Batch) -> Batch:
        queries = self._vectors_of(part)
        k = self.spec.k
        with self._lock:
            started = time.perf_counter_ns()
            if self._graph is None:
                labels, scores = self._exact(queries, k)
            else:
                fetch = k if self._graph.removes else k + min(self._retired, 4 * k)
                labels, scores = self._graph.search(queries, min(fetch, self._labels))
                if labels.shape[1] < k:  # fewer documents than k
                    pad = ((0, 0), (0, k - labels.shape[1]))
                    labels, scores = np.pad(labels, pad, constant_values=-1), np.pad(scores, pad)
            spec = self.spec
            self.spec.counters.searched(
                time.perf_counter_ns() - started,
                {"documents": self.size, "exact": float(self._graph is None), "exact_below": spec.exact_below,
                 "expansion_search": spec.expansion_search, "dim": spec.dim},
            )  # fmt: skip
            codes = np.where(labels >= 0, self._code_of[np.maximum(labels, 0)], -1)
            keep = codes >= 0  # retired labels (faiss) and empty slots
            order = np.argsort(~keep, axis=1, kind="stable")[:, :k]
            codes = np.take_along_axis(codes, order, axis=1)
            scores = np.take_along_axis(scores, order, axis=1)
            counts = np.take_along_axis(keep, order, axis=1).sum(axis=1)
            found = codes[np.arange(k)[None, :] < counts[:, None]]
            ids = self._docs.keys_of(found) if found.size else []
            payloads = self._payload[found].tolist()
        offsets = pa.array(np.concatenate(([0], np.cumsum(counts))).astype(np.int32))
        flat_scores = scores[np.arange(k)[None, :] < counts[:, None]]
        self._watch(np.where(counts > 0, scores[:, 0], np.nan), flat_scores)
        cols = {
            self.spec.hits_column: pa.ListArray.from_arrays(offsets, pa.array(ids, pa.string())),
            self.spec.scores_column: pa.ListArray.from_arrays(offsets, pa.array(flat_scores, pa.float32())),
        }
        if self.spec.payload_column is not None:
            cols[self.spec.payloads_column] = pa.ListArray.from_arrays(offsets, pa.array(payloads))
        return part.with_columns(cols)

    def _watch(self, best: npt.NDArray[Any], scores: npt.NDArray[Any]) -> None:
        """Counts the queries' scores; with ``confidence``, their verdicts join its window (a
        query with no hit at all found nothing close either)."""
        low = 0
        if self.confidence is not None:
            verdicts = ~(best >= self.confidence.config.threshold)  # NaN (no hit): low
            low = int(verdicts.sum())
            self.confidence.observe(verdicts)
        self.spec.counters.add(best.astype(np.float64), scores.astype(np.float64), low)

    def _exact(self, queries: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        live = np.flatnonzero(self._code_of[: self._labels] >= 0)
        rows = len(queries)
        if not live.size:
            return np.full((rows, k), -1, dtype=np.int64), np.zeros((rows, k), dtype=np.float32)
        sims = queries @ self._vectors[live].T
        top = min(k, live.size)
        best = np.argpartition(-sims, top - 1, axis=1)[:, :top]
        order = np.argsort(-np.take_along_axis(sims, best, axis=1), axis=1, kind="stable")
        best = np.take_along_axis(best, order, axis=1)
        labels = np.full((rows, k), -1, dtype=np.int64)
        scores = np.zeros((rows, k), dtype=np.float32)
        labels[:, :top] = live[best]
        scores[:, :top] = np.take_along_axis(sims, best, axis=1)
        return labels, scores

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        """The live documents: their ids and vectors (as bytes), in label order."""
        with self._lock:
            live = np.flatnonzero(self._code_of[: self._labels] >= 0)
            ids = np.array(self._docs.keys_of(self._code_of[live]), dtype=object)
            vectors = np.array([v.tobytes() for v in self._vectors[live]], dtype=object)
            out = {"__id": ids, "__vector": vectors}
            if self.spec.payload_column is not None:
                out["__payload"] = self._payload[self._code_of[live]]
        return out

    def restore(self, columns: Any) -> None:
        ids = [str(i) for i in columns["__id"]]
        if not ids:
            return
        vectors = np.frombuffer(b"".join(columns["__vector"]), dtype=np.float32).reshape(
            len(ids), self.spec.dim
        )
        cols: dict[str, Any] = {
            self.spec.id_column: pa.array(ids, pa.string()),
            self.spec.vector_column: vectors,
        }
        if self.spec.payload_column is not None:
            cols[self.spec.payload_column] = pa.array(list(columns["__payload"]))
        part = Batch.from_columns(cols)
        self._upsert(part)  # past ``exact_below``, the graph is built once, at the end
