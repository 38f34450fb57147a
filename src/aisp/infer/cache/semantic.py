"""A semantic response cache: a row takes the answer of an earlier row whose embedding is close
enough to its own, not only of one with equal inputs (a question asked in other words).

``SemanticCache`` keeps, per stored answer, its row's embedding (``column``: unit vectors, as
``TextEncoder`` makes) and compares each looked-up row with all of them in one matrix product
per batch: the best match at or above ``threshold`` (cosine similarity) is a hit, and its score
goes on the row (``cache_score``). Answers expire after ``ttl_s``; the vectors and answers stay
under ``max_bytes`` together, the least recently used first out (an answer larger than that on
its own is not stored: ``too_large``). It has the lookup and store of
``ResponseCache``, so ``cached`` puts it around model steps the same way; there is no Bloom
filter (a similarity has no key to test), so every row of a non-empty cache is compared
(``lookups``).

Exact search over the stored vectors suits a cache of up to some 10^5 answers (a product of
``rows x entries x dim`` per batch); past that, a ``VectorIndex`` is the tool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.infer.cache.response import KEY, encode_answers, with_answers

__all__ = ["SemanticCache"]

SCORE = "cache_score"


class SemanticCache:
    """Answers of a model stage by embedding similarity (see the module docstring)."""

    def __init__(
        self,
        outputs: Sequence[str],
        *,
        column: str = "embedding",
        threshold: float = 0.95,
        max_bytes: int = 64 << 20,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not outputs:
            raise ConfigError("a semantic cache needs output columns")
        if max_bytes <= 0 or ttl_s <= 0 or not -1.0 <= threshold <= 1.0:
            got = f"{max_bytes}, {ttl_s}, {threshold}"
            raise ConfigError(f"max_bytes and ttl_s must be > 0 and threshold in [-1, 1], got {got}")
        self.outputs, self.column, self.threshold = list(outputs), column, threshold
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._vectors = np.empty((0, 0), dtype=np.float32)
        self._answers: list[bytes] = []
        self._expires = np.empty(0, dtype=np.float64)
        self._used = np.empty(0, dtype=np.int64)  # a counter at each entry's last use
        self._tick = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.hits = self.misses = self.lookups = self.evictions = 0
        self.too_large = 0
        """Answers not stored: each (with its vector) larger than ``max_bytes`` on its own."""

    def _embeddings(self, batch: Batch) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = np.array(batch.numpy(self.column), dtype=np.float32).reshape(
            batch.num_rows, -1
        )
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def lookup(self, batch: Batch) -> Batch:
        """``batch`` with the answers of its rows' best matches at or above the threshold,
        ``HIT`` marking them and ``cache_score`` their similarity (NaN: an empty cache)."""
        rows = batch.num_rows
        score = np.full(rows, np.nan, dtype=np.float32)
        found: dict[int, dict[str, Any]] = {}
        with self._lock:
            n = len(self._answers)
            if rows and n:
                sims = self._embeddings(batch) @ self._vectors[:n].T
                sims[:, self._expires[:n] <= self._clock()] = -np.inf
                best = sims.argmax(axis=1)
                score = sims[np.arange(rows), best].astype(np.float32)
                self._tick += 1
                for i in np.flatnonzero(score >= self.threshold).tolist():
                    found[i] = self._dec.decode(self._answers[int(best[i])])
                    self._used[best[i]] = self._tick
                self.lookups += rows
            self.hits += len(found)
            self.misses += rows - len(found)
        return with_answers(batch, found, self.outputs, {SCORE: score})

    def store(self, batch: Batch) -> Batch:
        """Keep the answers of ``batch`` (rows a model just answered) under their embeddings;
        ``batch`` marked not cached."""
        if batch.num_rows:
            vectors = self._embeddings(batch)
            blobs = encode_answers(self._enc, batch, self.outputs)
            fits = np.array([len(b) + vectors.shape[1] * 4 <= self.max_bytes for b in blobs], dtype=bool)
            with self._lock:
                self.too_large += int((~fits).sum())  # one alone would evict every other answer
                if fits.any():
                    self._add(vectors[fits], [b for b, ok in zip(blobs, fits.tolist(), strict=True) if ok])
        return batch.drop([KEY]).with_columns({"cached": np.zeros(batch.num_rows, dtype=bool)})

    def _add(self, vectors: npt.NDArray[np.float32], blobs: list[bytes]) -> None:
        n, dim = len(self._answers), vectors.shape[1]
        if n and self._vectors.shape[1] != dim:
            raise ConfigError(
                f"semantic cache: embeddings of {dim} dimensions, stored ones have {self._vectors.shape[1]}"
            )
        if n + len(blobs) > len(self._vectors):  # room to grow into, doubled
            grown = np.empty((max(64, 2 * (n + len(blobs))), dim), dtype=np.float32)
            if n:
                grown[:n] = self._vectors[:n]
            self._vectors = grown
            self._expires = np.resize(self._expires, len(grown))
            self._used = np.resize(self._used, len(grown))
        end = n + len(blobs)
        self._tick += 1
        self._vectors[n:end] = vectors
        self._expires[n:end] = self._clock() + self.ttl_s
        self._used[n:end] = self._tick
        self._answers += blobs
        self._bytes += sum(map(len, blobs)) + vectors.nbytes
        if self._bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used (expired ones first) until under the bound."""
        n = len(self._answers)
        sizes = np.fromiter(map(len, self._answers), dtype=np.int64, count=n) + self._vectors.shape[1] * 4
        order = np.lexsort((self._used[:n], self._expires[:n] > self._clock()))  # expired, then oldest
        over = self._bytes - self.max_bytes
        drop_n = int(np.searchsorted(np.cumsum(sizes[order]), over)) + 1
        keep = np.ones(n, dtype=bool)
        keep[order[:drop_n]] = False
        kept = np.flatnonzero(keep)
        m = len(kept)
        self._vectors[:m] = self._vectors[kept]
        self._expires[:m] = self._expires[kept]
        self._used[:m] = self._used[kept]
        self._answers = [self._answers[i] for i in kept.tolist()]
        self._bytes = int(sizes[kept].sum())
        self.evictions += n - m

    @property
    def bytes(self) -> int:
        """Bytes of stored answers and their vectors (the bound ``max_bytes`` applies to them)."""
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits, "misses": self.misses, "bloom_negatives": 0, "lookups": self.lookups,
                "evictions": self.evictions, "too_large": self.too_large, "entries": len(self._answers),
                "bytes": self._bytes,
            }  # fmt: skip
