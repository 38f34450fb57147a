"""In-memory keyed state laid out as columns.

Keys are turned into dense integer codes once per batch (``KeyIndex``), so state lives in numpy
arrays indexed by code and an operator reads or updates the state of a whole batch with one
fancy-indexing operation instead of a dict lookup per event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from aisp.errors import StateError
from aisp.state.key_tables import HashTable, SortedRuns, key_hashes, pack_keys, unpack, unpack_arrow

__all__ = ["KeyIndex", "KeyPartitionError", "KeyedState"]


class KeyPartitionError(StateError):
    """A key arrived from two input partitions while its state follows partitions."""


def _grown(arr: npt.NDArray[Any], size: int, fill: Any) -> npt.NDArray[Any]:
    """``arr`` in a new array of ``size`` entries, the rest ``fill``."""
    out = np.full(size, fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


class KeyIndex:
    """Maps key values to dense int64 codes, assigning new codes in first-seen order.

    Integer keys and short strings (user ids, tickers, codes) are packed into uint64 and looked
    up in a numpy hash table, a whole batch per probe: no per-row Python work (measured ~5x
    cheaper than a dict lookup per row on 100k distinct users). Other keys use the dict path.

    >>> idx = KeyIndex()
    >>> idx.encode(pa.array(["a", "b", "a"])).tolist()
    [0, 1, 0]
    >>> idx.encode(pa.array(["c", "a"])).tolist(), len(idx)
    ([2, 0], 3)

    A bounded hot layer (``evict``) forgets the keys seen least recently: the survivors get
    dense codes again, and a forgotten key that comes back gets a new code that
    ``was_evicted`` reports, so its state can be read back from the state store.

    >>> idx.advance()  # a checkpoint: "a", "b", "c" were all seen before it
    >>> idx.encode(pa.array(["c"])).tolist()
    [2]
    >>> idx.evict(keep=1).tolist()  # the survivors' old codes, in their new code order
    [2]
    >>> idx.keys(), idx.encode(pa.array(["a", "d"])).tolist()
    (['c'], [1, 2])
    >>> idx.was_evicted(np.array([0, 1, 2])).tolist()
    [False, True, False]
    """

    def __init__(self) -> None:
        self._kind: str | None = None
        self._table = HashTable()
        self._by_code = np.empty(1024, dtype=np.uint64)
        self._n = 0
        self._dict: dict[Any, int] | None = None
        self._dict_keys: list[Any] = []  # the dict path's keys in code order
        self.epoch = 0
        """Checkpoints so far (``advance``); each code remembers the epoch it was last seen in."""
        self._seen = np.zeros(1024, dtype=np.int64)
        self._part = np.full(1024, -1, dtype=np.int64)  # each key's input partition (``tag``)
        self.partition_of: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]] | None = None
        """Set when keyed state follows input partitions: engine ids -> partition (key-by tags)."""
        self._distinct = 0.0  # distinct keys / rows in the last dictionary-encoded batch
        self._batches = 0
        self._evicted = SortedRuns()  # packed keys evicted so far (the dict path: their hashes)
        self.evicted = 0
        """Keys evicted so far (a key evicted twice counts twice)."""

    def __len__(self) -> int:
        return self._n

    def encode(self, keys: pa.Array) -> npt.NDArray[np.int64]:
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        if keys.null_count:
            raise ValueError(f"key column has {keys.null_count} null value(s)")
        if self._repeats(keys):  # each distinct key once, then a gather per row
            encoded = pc.dictionary_encode(keys)  # the dictionary in order of first appearance
            self._distinct = len(encoded.dictionary) / len(keys)
            codes: npt.NDArray[np.int64] = self._encode(encoded.dictionary)[encoded.indices.to_numpy()]
            return codes
        return self._encode(keys)

    def _encode(self, keys: pa.Array) -> npt.NDArray[np.int64]:
        packed = pack_keys(keys) if self._dict is None else None
        if packed is not None and self._kind in (None, packed[0]):
            self._kind = packed[0]
            codes = self._encode_packed(packed[1])
        else:
            codes = self._encode_dict(keys)
        if self._n > self._seen.shape[0]:
            size = max(self._n, 2 * self._seen.shape[0])
            self._seen = _grown(self._seen, size, 0)
            self._part = _grown(self._part, size, -1)
        self._seen[codes] = self.epoch
        return codes

    def _repeats(self, keys: pa.Array) -> bool:
        """Whether string ``keys`` likely repeat within the batch, so that encoding each distinct
        key once pays (a few hundred users in thousands of rows: ~4x cheaper per row); judged by
        the last batch that was dictionary-encoded, tried again every 16 batches otherwise."""
        if len(keys) < 256 or not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)):
            return False
        self._batches += 1
        return self._distinct <= 0.25 or self._batches % 16 == 0

    # -- keys by input partition (state that moves with the partitions of a Kafka input) -----
    def tag(self, codes: npt.NDArray[np.int64], partitions: npt.NDArray[np.int64]) -> None:
        """Record the input partition of each key; a key arriving from two partitions is an
        error (state can only move with partitions when the input is partitioned by the key)."""
        known = self._part[codes]
        clash = np.flatnonzero((known >= 0) & (known != partitions))
        if clash.size:
            i = int(clash[0])
            self._clash(int(codes[i]), int(known[i]), int(partitions[i]))
        order = np.lexsort((partitions, codes))  # a key from two partitions within this batch
        c, p = codes[order], partitions[order]
        within = np.flatnonzero((c[1:] == c[:-1]) & (p[1:] != p[:-1]))
        if within.size:
            j = int(within[0])
            self._clash(int(c[j]), int(p[j]), int(p[j + 1]))
        self._part[codes] = partitions

    def _clash(self, code: int, first: int, second: int) -> None:
        key = self.keys_of(np.array([code], dtype=np.int64))[0]
        raise KeyPartitionError(
            f"key {key!r} arrives from input partitions {first} and {second}:"
            " keyed state follows partitions only when the input topic is partitioned by the key"
        )

    def partitions_of(self, codes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The input partition each of ``codes`` is tagged with (-1: none)."""
        return self._part[codes]

    def codes_in(self, partitions: Sequence[int]) -> npt.NDArray[np.int64]:
        """The codes of keys tagged with one of ``partitions``, ascending."""
        return np.flatnonzero(np.isin(self._part[: self._n], np.asarray(partitions, dtype=np.int64)))

    def _encode_packed(self, packed: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        codes = self._table.find(packed)
        miss = codes < 0
        if miss.any():
            codes[miss] = self._add(packed[miss])
        return codes

    def _add(self, new: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Assign codes to keys not seen before (in first-seen order); returns them per row."""
        uniq, first = np.unique(new, return_index=True)
        order = np.argsort(first, kind="stable")
        uniq_codes = np.empty(uniq.shape[0], dtype=np.int64)
        uniq_codes[order] = np.arange(self._n, self._n + uniq.shape[0])
        end = self._n + uniq.shape[0]
        if end > self._by_code.shape[0]:
            grown = np.empty(max(end, 2 * self._by_code.shape[0]), dtype=np.uint64)
            grown[: self._n] = self._by_code[: self._n]
            self._by_code = grown
        self._by_code[self._n : end] = uniq[order]
        self._n = end
        self._table.insert(uniq, uniq_codes)
        return uniq_codes[np.searchsorted(uniq, new)]

    def _encode_dict(self, keys: pa.Array) -> npt.NDArray[np.int64]:
        if self._dict is None:  # switch once: existing packed keys keep their codes
            self._dict_keys = self.keys()
            self._dict = dict(zip(self._dict_keys, range(self._n), strict=True))
            if self._kind and len(self._evicted):
                gone = self._evicted.values()
                self._evicted = SortedRuns()
                self._evicted.add(key_hashes(unpack(self._kind, gone)))
        table = self._dict
        values = keys.to_pylist()
        get = table.get
        codes = [get(v, -1) for v in values]
        if -1 in codes:
            for i in np.flatnonzero(np.asarray(codes) < 0).tolist():
                code = table.setdefault(values[i], len(table))
                if code == len(self._dict_keys):
                    self._dict_keys.append(values[i])
                codes[i] = code
            self._n = len(table)
        return np.array(codes, dtype=np.int64)

    # -- a bounded hot layer ------------------------------------------------------------------
    def advance(self) -> None:
        """Start a new epoch (at a checkpoint): what is seen from now on is recent."""
        self.epoch += 1

    def evict(self, keep: int) -> npt.NDArray[np.int64] | None:
        """Forget the keys seen least recently, and none seen since the last ``advance``, until
        at most ``keep`` remain (fewer are forgotten when more were seen since). Survivors are
        renumbered densely in their old order; returns their old codes (new code ``i`` was
        ``survivors[i]``), or None when nothing was forgotten. Only safe when no code is in use
        anywhere (a checkpoint's pause)."""
        n = self._n
        seen = self._seen[:n]
        cold = np.flatnonzero(seen < self.epoch)
        count = min(n - keep, cold.size)
        if count <= 0:
            return None
        victims = cold if count == cold.size else cold[np.argpartition(seen[cold], count - 1)[:count]]
        return self.drop(victims, remember=True)

    def drop(self, victims: npt.NDArray[np.int64], *, remember: bool) -> npt.NDArray[np.int64]:
        """Forget the keys of ``victims`` (codes); ``remember``: report them in ``was_evicted``
        (their state is in a store). Survivors are renumbered densely in their old order; returns
        their old codes. Only safe when no code is in use anywhere (a pause)."""
        n = self._n
        alive = np.ones(n, dtype=bool)
        alive[victims] = False
        survivors = np.flatnonzero(alive)
        m = survivors.shape[0]
        if self._dict is not None:
            if remember:
                self._evicted.add(key_hashes([self._dict_keys[i] for i in victims.tolist()]))
            self._dict_keys = [self._dict_keys[i] for i in survivors.tolist()]
            self._dict = dict(zip(self._dict_keys, range(m), strict=True))
        else:
            packed = self._by_code[:n]
            if remember:
                self._evicted.add(packed[victims])
            by_code = np.empty(max(1024, 2 * m), dtype=np.uint64)  # new arrays: views stay valid
            by_code[:m] = packed[survivors]
            self._by_code = by_code
            self._table = HashTable()
            self._table.insert(by_code[:m], np.arange(m, dtype=np.int64))
        self._seen = _grown(self._seen[survivors], max(1024, 2 * m), 0)
        self._part = _grown(self._part[survivors], max(1024, 2 * m), -1)
        self._n = m
        self.evicted += int(victims.shape[0]) if remember else 0
        return survivors

    def was_evicted(self, codes: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """For each code, whether its key was evicted before (or ``mark_evicted``): its state
        may be in the state store. Long keys are remembered by hash, so a collision may answer
        True for a key never evicted (a store read that finds nothing)."""
        if not len(self._evicted):
            return np.zeros(codes.shape[0], dtype=bool)
        if self._dict is not None:
            return self._evicted.contains(key_hashes(self.keys_of(codes)))
        return self._evicted.contains(self._by_code[codes])

    def mark_evicted(self, keys: pa.Array) -> None:
        """Treat ``keys`` as evicted (a restore that leaves the state in the store: each key's
        state is read back when the key is seen again)."""
        packed = pack_keys(keys) if self._dict is None else None
        if packed is not None and self._kind in (None, packed[0]):
            self._kind = packed[0]
            self._evicted.add(packed[1])
        else:
            if self._dict is None:
                self._encode_dict(pa.array([], keys.type))  # switch to the dict path
            self._evicted.add(key_hashes(keys.to_pylist()))

    def restore(self, keys: pa.Array) -> None:
        """Load ``keys`` (``keys()`` of a snapshot, in code order) into this empty index."""
        if self._n:
            raise ValueError(f"restore needs an empty key index; this one has {self._n} keys")
        codes = self.encode(keys)
        if not np.array_equal(codes, np.arange(len(keys))):
            raise ValueError("restored keys are not unique")

    def keys(self) -> list[Any]:
        """Key values in code order."""
        if self._dict is not None:
            return list(self._dict_keys)
        return unpack(self._kind, self._by_code[: self._n]) if self._kind else []

    def keys_of(self, codes: npt.NDArray[np.int64]) -> list[Any]:
        """The key values of ``codes``."""
        if self._dict is not None:
            every = self._dict_keys
            return [every[c] for c in codes.tolist()]
        return unpack(self._kind, self._by_code[codes]) if self._kind else []

    def frozen_keys(self, codes: npt.NDArray[np.int64] | None = None) -> Callable[[], pa.Array]:
        """The keys (of ``codes``, or all in code order) as of now, as an Arrow array made
        later: a code's key never changes once assigned and growth copies into a new array, so
        a view of the packed keys is a snapshot that costs nothing to take (a checkpoint takes
        it while the sources are paused, and converts after they resume)."""
        if self._dict is not None:
            chosen = list(self._dict_keys) if codes is None else self.keys_of(codes)
            return lambda: pa.array(chosen)
        if not self._kind:
            return lambda: pa.array([], pa.string())
        kind, packed = self._kind, self._by_code[: self._n]
        return lambda: unpack_arrow(kind, packed if codes is None else packed[codes])


class KeyedState:
    """Named numpy state columns indexed by key code, grown on demand.

    ``column(name)`` returns the current array (at least ``size`` long); writes through it update
    the state. Arrays grow geometrically so growth costs amortise to nothing.
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        self._columns: dict[str, npt.NDArray[Any]] = {}
        self._defaults: dict[str, Any] = {}
        self._capacity = initial_capacity

    def declare(self, name: str, dtype: npt.DTypeLike, default: Any = 0) -> None:
        if name not in self._columns:
            self._columns[name] = np.full(self._capacity, default, dtype=dtype)
            self._defaults[name] = default

    def ensure(self, size: int) -> None:
        """Make every column at least ``size`` long."""
        if size <= self._capacity:
            return
        new_cap = max(size, self._capacity * 2)
        for name, arr in self._columns.items():
            grown = np.full(new_cap, self._defaults[name], dtype=arr.dtype)
            grown[: arr.shape[0]] = arr
            self._columns[name] = grown
        self._capacity = new_cap

    def column(self, name: str) -> npt.NDArray[Any]:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"undeclared state {name!r}; declared: {sorted(self._columns)}") from None

    @property
    def names(self) -> list[str]:
        return sorted(self._columns)

    def snapshot(self, size: int) -> dict[str, npt.NDArray[Any]]:
        """Copies of the first ``size`` entries of every column."""
        return {name: arr[:size].copy() for name, arr in self._columns.items()}

    def take(self, rows: npt.NDArray[np.int64]) -> KeyedState:
        """A new state holding ``rows`` of this one, as entries ``0..len(rows)-1``."""
        out = KeyedState(max(1024, 2 * rows.shape[0]))
        for name, arr in self._columns.items():
            out.declare(name, arr.dtype, self._defaults[name])
            out._columns[name][: rows.shape[0]] = arr[rows]
        return out

    def row_dtype(self) -> np.dtype[Any]:
        """One row of every column, in ``names`` order (the state store's value layout)."""
        return np.dtype([(name, self._columns[name].dtype) for name in self.names])
