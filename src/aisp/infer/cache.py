"""A response cache in front of a model stage: rows whose inputs were answered before take the
stored answer instead of a model call.

``ResponseCache`` keys each row by a hash of its ``inputs`` columns (exact match) and keeps the
``outputs`` columns of the answers in memory, under a memory bound (least recently used first
out) and a time to live. A Bloom filter of the stored keys stands in front: a row whose key it
has never seen costs no lookup in the store (``lookups`` counts the ones that do). ``cached``
puts the cache around model steps of a pipeline:

    stream -> {step}.lookup -> {step}.route -> hit --------------------------------> {step}
                                             -> miss -> model steps -> {step}.store -^

Each row out has ``cached`` (true when its answer came from the cache). ``stats()`` gives hits,
misses, Bloom negatives, lookups, evictions, entries and bytes.
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

__all__ = ["BloomFilter", "ResponseCache", "cached"]

HIT = "__cache_hit"
KEY = "__cache_key"  # a row's key, from its lookup to its store (not hashed twice)


class BloomFilter:
    """A Bloom filter of 64-bit key hashes: ``bits`` bits, ``hashes`` probes per key (double
    hashing), vectorised over arrays of keys."""

    def __init__(self, bits: int = 1 << 20, hashes: int = 4) -> None:
        if bits < 64 or hashes < 1:
            raise ConfigError(f"a Bloom filter needs >= 64 bits and >= 1 hash, got {bits}, {hashes}")
        self.bits, self.hashes = bits, hashes
        self._words = np.zeros((bits + 63) // 64, dtype=np.uint64)

    def _positions(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        low, high = keys & np.uint64(0xFFFFFFFF), keys >> np.uint64(32)
        probes = np.arange(self.hashes, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return (low[:, None] + probes[None, :] * (high[:, None] | np.uint64(1))) % np.uint64(self.bits)

    def add(self, keys: npt.NDArray[np.uint64]) -> None:
        pos = self._positions(keys).ravel()
        np.bitwise_or.at(self._words, pos >> np.uint64(6), np.uint64(1) << (pos & np.uint64(63)))

    def __contains__(self, key: int) -> bool:
        return bool(self.may_contain(np.array([key], dtype=np.uint64))[0])

    def may_contain(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        pos = self._positions(keys)
        set_bits = (self._words[pos >> np.uint64(6)] >> (pos & np.uint64(63))) & np.uint64(1)
        return np.asarray(set_bits.all(axis=1), dtype=bool)

    def clear(self) -> None:
        self._words[:] = 0


class ResponseCache:
    """Answers of a model stage by a hash of their inputs (see the module docstring)."""

    def __init__(
        self,
        inputs: Sequence[str],
        outputs: Sequence[str],
        *,
        max_bytes: int = 64 << 20,
        ttl_s: float = 3600.0,
        bloom_bits: int = 1 << 22,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not inputs or not outputs:
            raise ConfigError("a response cache needs input and output columns")
        if max_bytes <= 0 or ttl_s <= 0:
            raise ConfigError(f"max_bytes and ttl_s must be > 0, got {max_bytes}, {ttl_s}")
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self.bloom = BloomFilter(bloom_bits)
        self._entries: OrderedDict[int, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._forgotten = 0  # keys evicted since the filter was last built
        self._lock = threading.Lock()
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.hits = self.misses = self.bloom_negatives = self.lookups = self.evictions = 0

    def keys(self, batch: Batch) -> npt.NDArray[np.uint64]:
        """Each row's key: a 64-bit hash of its input values."""
        columns = [batch.column(c).to_pylist() for c in self.inputs]
        digest = hashlib.blake2b
        out = np.empty(batch.num_rows, dtype=np.uint64)
        for i, row in enumerate(zip(*columns, strict=True)):
            out[i] = int.from_bytes(digest(self._enc.encode(row), digest_size=8).digest(), "little")
        return out

    def lookup(self, batch: Batch) -> Batch:
        """``batch`` with the stored answers of the rows that have one and ``HIT`` marking them."""
        keys = self.keys(batch)
        maybe = self.bloom.may_contain(keys) if len(keys) else np.zeros(0, dtype=bool)
        found: dict[int, dict[str, Any]] = {}
        now = self._clock()
        with self._lock:
            self.bloom_negatives += int((~maybe).sum())
            for i in np.flatnonzero(maybe).tolist():
                self.lookups += 1
                entry = self._entries.get(int(keys[i]))
                if entry is None or entry[0] <= now:
                    continue
                self._entries.move_to_end(int(keys[i]))
                found[i] = self._dec.decode(entry[1])
            self.hits += len(found)
            self.misses += batch.num_rows - len(found)
        hit = np.zeros(batch.num_rows, dtype=bool)
        hit[list(found)] = True
        columns: dict[str, Any] = {HIT: hit, KEY: keys}
        if found:
            for name in self.outputs:
                columns[name] = pa.array(
                    [found[i][name] if i in found else None for i in range(batch.num_rows)]
                )
        return batch.with_columns(columns)

    def store(self, batch: Batch) -> Batch:
        """Keep the answers of ``batch`` (rows a model just answered; their keys from
        ``lookup`` when they have them); ``batch`` marked not cached."""
        keys = batch.numpy(KEY).astype(np.uint64) if KEY in batch else self.keys(batch)
        values = {name: batch.column(name).to_pylist() for name in self.outputs}
        expires = self._clock() + self.ttl_s
        with self._lock:
            for i, key in enumerate(keys.tolist()):
                blob = self._enc.encode({name: col[i] for name, col in values.items()})
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= len(old[1])
                self._entries[key] = (expires, blob)
                self._bytes += len(blob)
            self.bloom.add(keys)
            self._evict()
        return batch.drop([KEY]).with_columns({"cached": np.zeros(batch.num_rows, dtype=bool)})

    def _evict(self) -> None:
        evicted = 0
        while self._bytes > self.max_bytes and self._entries:
            _, (_, blob) = self._entries.popitem(last=False)
            self._bytes -= len(blob)
            evicted += 1
        self.evictions += evicted
        self._forgotten += evicted
        if self._forgotten > len(self._entries):  # the filter mostly says "maybe" for nothing
            self.bloom.clear()
            self.bloom.add(np.fromiter(self._entries.keys(), dtype=np.uint64, count=len(self._entries)))
            self._forgotten = 0

    @property
    def bytes(self) -> int:
        """Bytes of stored answers (the bound ``max_bytes`` applies to them)."""
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits, "misses": self.misses, "bloom_negatives": self.bloom_negatives,
                "lookups": self.lookups, "evictions": self.evictions, "entries": len(self._entries),
                "bytes": self._bytes,
            }  # fmt: skip


def cached(stream: Any, step_id: str, cache: ResponseCache, model: Callable[[Any], Any]) -> Any:
    """``model`` (a function adding model steps after a stream, returning the last one) behind
    ``cache`` (see the module docstring); the united stream, each row marked ``cached``."""

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
