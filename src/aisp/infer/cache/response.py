"""A response cache in front of a model stage: rows whose inputs were answered before take the
stored answer instead of a model call.

``ResponseCache`` keys each row by a hash of its ``inputs`` columns (exact match) and keeps the
``outputs`` columns of the answers under a memory bound (least recently used first out) and a
time to live: in this process (``LocalStore``), or in Redis (``redis=URL``, ``cache.redis``),
where the workers of a group share them. A Bloom filter of the stored keys stands in front: a
row whose key it has never seen costs no lookup in the store (``lookups`` counts the ones that
do). ``SemanticCache`` (``cache.semantic``) answers by embedding similarity instead. ``cached``
puts either around model steps of a pipeline:

    stream -> {step}.lookup -> {step}.route -> hit --------------------------------> {step}
                                             -> miss -> model steps -> {step}.store -^

Each row out has ``cached`` (true when its answer came from the cache). ``stats()`` gives hits,
misses, Bloom negatives, lookups, evictions, answers not stored for being larger than the whole
bound (``too_large``), entries and bytes.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError

__all__ = ["BloomFilter", "LocalStore", "ResponseCache", "cached", "encode_answers", "with_answers"]

HIT = "__cache_hit"
KEY = "__cache_key"  # a row's key, from its lookup to its store (not hashed twice)


def encode_answers(encoder: msgspec.msgpack.Encoder, batch: Batch, outputs: Sequence[str]) -> list[bytes]:
    """Each row's ``outputs`` values, msgpack-encoded: the answers a cache stores."""
    values = {name: batch.column(name).to_pylist() for name in outputs}
    return [encoder.encode({n: col[i] for n, col in values.items()}) for i in range(batch.num_rows)]


def with_answers(
    batch: Batch, found: dict[int, dict[str, Any]], outputs: Sequence[str], columns: dict[str, Any]
) -> Batch:
    """``batch`` with ``columns``, ``HIT`` marking the rows in ``found`` (by position) and the
    ``outputs`` columns filled from their answers (null elsewhere)."""
    hit = np.zeros(batch.num_rows, dtype=bool)
    hit[list(found)] = True
    columns[HIT] = hit
    if found:
        for name in outputs:
            columns[name] = pa.array([found[i][name] if i in found else None for i in range(batch.num_rows)])
    return batch.with_columns(columns)


class BloomFilter:
    """A Bloom filter of 64-bit key hashes: ``bits`` bits, ``hashes`` probes per key (double
    hashing), vectorised over arrays of keys."""

    def __init__(self, bits: int = 1 << 20, hashes: int = 4) -> None:
        if bits < 64 or hashes < 1:
            raise ConfigError(f"a Bloom filter needs >= 64 bits and >= 1 hash, got {bits}, {hashes}")
        self.bits, self.hashes = bits, hashes
        self.words = np.zeros((bits + 63) // 64, dtype=np.uint64)

    def positions(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        low, high = keys & np.uint64(0xFFFFFFFF), keys >> np.uint64(32)
        probes = np.arange(self.hashes, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return (low[:, None] + probes[None, :] * (high[:, None] | np.uint64(1))) % np.uint64(self.bits)

    def add(self, keys: npt.NDArray[np.uint64]) -> None:
        pos = self.positions(keys).ravel()
        np.bitwise_or.at(self.words, pos >> np.uint64(6), np.uint64(1) << (pos & np.uint64(63)))

    def __contains__(self, key: int) -> bool:
        return bool(self.may_contain(np.array([key], dtype=np.uint64))[0])

    def may_contain(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        pos = self.positions(keys)
        set_bits = (self.words[pos >> np.uint64(6)] >> (pos & np.uint64(63))) & np.uint64(1)
        return np.asarray(set_bits.all(axis=1), dtype=bool)

    def clear(self) -> None:
        self.words[:] = 0


class LocalStore:
    """Answers (bytes) by 64-bit key in this process: each kept ``ttl_s``, the least recently
    used out past ``max_bytes``; ``bloom`` holds the keys stored (built again when the keys
    evicted since it was last built outnumber those kept: it would mostly say "maybe" for
    nothing).

    Written here on an ``OrderedDict`` rather than taken from ``cachetools.TTLCache`` (which
    does the same with ``getsizeof=len``): that was several times slower per put and get in
    ``benchmarks/bench_library_choices.py cache`` (see BENCHMARKS.md), and a lookup is per row."""

    def __init__(self, max_bytes: int, ttl_s: float, bloom: BloomFilter, clock: Callable[[], float]) -> None:
        self.max_bytes, self.ttl_s, self._bloom, self._clock = max_bytes, ttl_s, bloom, clock
        self._entries: OrderedDict[int, tuple[float, bytes]] = OrderedDict()
        self._forgotten = 0
        self.bytes = 0

    def get(self, keys: list[int]) -> list[bytes | None]:
        now = self._clock()
        out: list[bytes | None] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry[0] <= now:
                out.append(None)
                continue
            self._entries.move_to_end(key)
            out.append(entry[1])
        return out

    def put(self, keys: list[int], blobs: list[bytes]) -> int:
        """Store (an answer larger than ``max_bytes`` is not: it would evict every other one and
        then itself); the number of answers evicted to stay under the bound."""
        expires = self._clock() + self.ttl_s
        for key, blob in zip(keys, blobs, strict=True):
            if len(blob) > self.max_bytes:
                continue
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= len(old[1])
            self._entries[key] = (expires, blob)
            self.bytes += len(blob)
        self._bloom.add(np.array(keys, dtype=np.uint64))
        evicted = 0
        while self.bytes > self.max_bytes and self._entries:
            _, (_, blob) = self._entries.popitem(last=False)
            self.bytes -= len(blob)
            evicted += 1
        self._forgotten += evicted
        if self._forgotten > len(self._entries):
            self._bloom.clear()
            self._bloom.add(np.fromiter(self._entries.keys(), dtype=np.uint64, count=len(self._entries)))
            self._forgotten = 0
        return evicted

    def __len__(self) -> int:
        return len(self._entries)

    def refresh(self) -> None:
        """Nothing to reload: the filter is this process's own."""

    def close(self) -> None:
        pass


class ResponseCache:
    """Answers of a model stage by a hash of their inputs (see the module docstring); ``redis``
    (``redis://HOST:PORT/DB``) keeps them in Redis under ``namespace``, shared by every worker
    that names the same."""

    def __init__(
        self,
        inputs: Sequence[str],
        outputs: Sequence[str],
        *,
        max_bytes: int = 64 << 20,
        ttl_s: float = 3600.0,
        bloom_bits: int = 1 << 22,
        redis: str | None = None,
        namespace: str = "aisp-cache",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not inputs or not outputs:
            raise ConfigError("a response cache needs input and output columns")
        if max_bytes <= 0 or ttl_s <= 0:
            raise ConfigError(f"max_bytes and ttl_s must be > 0, got {max_bytes}, {ttl_s}")
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.bloom = BloomFilter(bloom_bits)
        self._store: Any
        if redis is None:
            self._store = LocalStore(max_bytes, ttl_s, self.bloom, clock)
        else:
            from aisp.infer.cache.redis import RedisStore

            self._store = RedisStore(redis, namespace, max_bytes, ttl_s, self.bloom)
        self._lock = threading.Lock()
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.hits = self.misses = self.bloom_negatives = self.lookups = self.evictions = 0
        self.too_large = 0
        """Answers not stored: each larger than ``max_bytes`` on its own."""

    def keys(self, batch: Batch) -> npt.NDArray[np.uint64]:
        """Each row's key: a 64-bit hash of its input values."""
        columns = [batch.column(c).to_pylist() for c in self.inputs]
        digest = hashlib.blake2b
        out = np.empty(batch.num_rows, dtype=np.uint64)
        for i, row in enumerate(zip(*columns, strict=True)):
            out[i] = int.from_bytes(digest(self._enc.encode(row), digest_size=8).digest(), "little")
        return out

    def get(self, keys: npt.NDArray[np.uint64]) -> dict[int, bytes]:
        """The stored answers of ``keys`` that have one, by position (counted as hits)."""
        self._store.refresh()  # (Redis) the other workers' keys into the filter
        maybe = self.bloom.may_contain(keys) if len(keys) else np.zeros(0, dtype=bool)
        asked = np.flatnonzero(maybe).tolist()
        with self._lock:
            blobs = self._store.get([int(keys[i]) for i in asked]) if asked else []
            found = {i: b for i, b in zip(asked, blobs, strict=True) if b is not None}
            self.bloom_negatives += len(keys) - len(asked)
            self.lookups += len(asked)
            self.hits += len(found)
            self.misses += len(keys) - len(found)
        return found

    def put(self, keys: npt.NDArray[np.uint64], blobs: list[bytes]) -> None:
        """Store ``blobs`` under ``keys``; one larger than ``max_bytes`` is not stored (counted in
        ``too_large``): it would evict every other answer."""
        fits = [len(b) <= self.max_bytes for b in blobs]
        kept = [int(k) for k, ok in zip(keys.tolist(), fits, strict=True) if ok]
        with self._lock:
            self.too_large += len(blobs) - len(kept)
            if kept:
                self.evictions += self._store.put(kept, [b for b, ok in zip(blobs, fits, strict=True) if ok])

    def lookup(self, batch: Batch) -> Batch:
        """``batch`` with the stored answers of the rows that have one and ``HIT`` marking them."""
        keys = self.keys(batch)
        found = {i: self._dec.decode(b) for i, b in self.get(keys).items()}
        return with_answers(batch, found, self.outputs, {KEY: keys})

    def store(self, batch: Batch) -> Batch:
        """Keep the answers of ``batch`` (rows a model just answered; their keys from
        ``lookup`` when they have them); ``batch`` marked not cached."""
        keys = batch.numpy(KEY).astype(np.uint64) if KEY in batch else self.keys(batch)
        self.put(keys, encode_answers(self._enc, batch, self.outputs))
        return batch.drop([KEY]).with_columns({"cached": np.zeros(batch.num_rows, dtype=bool)})

    @property
    def bytes(self) -> int:
        """Bytes of stored answers (the bound ``max_bytes`` applies to them)."""
        return int(self._store.bytes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits, "misses": self.misses, "bloom_negatives": self.bloom_negatives,
                "lookups": self.lookups, "evictions": self.evictions, "too_large": self.too_large,
                "entries": len(self._store), "bytes": int(self._store.bytes),
            }  # fmt: skip

    def close(self) -> None:
        self._store.close()


def cached(stream: Any, step_id: str, cache: Any, model: Callable[[Any], Any]) -> Any:
    """``model`` (a function adding model steps after a stream, returning the last one) behind
    ``cache`` (a ``ResponseCache`` or a ``SemanticCache``; see the module docstring); the united
    stream, each row marked ``cached``."""

    def answered(batch: Batch) -> Batch:
        return batch.drop([HIT, KEY]).with_columns({"cached": np.ones(batch.num_rows, dtype=bool)})

    stream.pipeline.graph.caches[step_id] = cache  # its counters in /metrics
    looked = stream.map_batch(f"{step_id}.lookup", cache.lookup)
    routed = looked.route(
        f"{step_id}.route", ["hit", "miss"], predicates={"hit": lambda b: b.numpy(HIT)}, default="miss"
    )
    hits = routed["hit"].map_batch(f"{step_id}.hit", answered)
    fresh = model(routed["miss"].map_batch(f"{step_id}.miss", lambda b: b.drop([HIT])))
    stored = fresh.map_batch(f"{step_id}.store", cache.store)
    return stream.pipeline.union(step_id, hits, stored)
