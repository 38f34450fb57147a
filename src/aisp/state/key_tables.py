"""Primitives of key spaces: keys packed into uint64, a numpy hash table over them probed a
whole batch at a time, and a compact set of evicted keys (``aisp.state.keyed`` uses them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = ["HashTable", "SortedRuns", "key_hashes", "pack_keys", "unpack", "unpack_arrow"]


_MAX_PACKED_BYTES = 7  # strings up to 7 bytes pack, with their length, into one uint64


def pack_keys(keys: pa.Array) -> tuple[str, npt.NDArray[np.uint64]] | None:
    """Integer keys, or strings of at most 7 bytes, as distinct uint64 values (vectorised); the
    kind (``int``, ``uint`` for uint64 columns, ``str``) says how to read them back.

    Returns ``(kind, packed)`` or ``None`` when the column cannot be packed losslessly.
    """
    if pa.types.is_uint64(keys.type):  # its own kind: cast to int64, 2**64 - 1 would meet -1
        return "uint", keys.to_numpy(zero_copy_only=False).astype(np.uint64)
    if pa.types.is_integer(keys.type):
        return "int", keys.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    if not pa.types.is_string(keys.type):
        return None
    n = len(keys)
    _, offsets_buf, data_buf = keys.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=keys.offset + n + 1)[keys.offset :]
    lengths = np.diff(offsets)
    if n and int(lengths.max()) > _MAX_PACKED_BYTES:
        return None
    data = (
        np.frombuffer(data_buf, dtype=np.uint8)
        if data_buf is not None and data_buf.size
        else np.zeros(1, np.uint8)
    )
    cols = np.arange(8)
    idx = np.minimum(offsets[:-1, None] + cols[None, :], data.shape[0] - 1)
    matrix = np.where(cols[None, :] < lengths[:, None], data[idx], 0).astype(np.uint8)
    matrix[:, 7] = lengths  # the length byte keeps "a" and "a\0" apart
    return "str", np.ascontiguousarray(matrix).view(np.uint64).reshape(n)


def unpack_arrow(kind: str, packed: npt.NDArray[np.uint64]) -> pa.Array:
    """``_unpack`` straight to an Arrow array, vectorised (no Python object per key)."""
    if kind == "int":
        return pa.array(packed.view(np.int64))
    if kind == "uint":
        return pa.array(packed)
    raw = packed.view(np.uint8).reshape(-1, 8)
    lengths = raw[:, 7].astype(np.int32)
    offsets = np.zeros(raw.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    data = raw[:, :7][np.arange(7)[None, :] < lengths[:, None]]
    return pa.StringArray.from_buffers(raw.shape[0], pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))


def unpack(kind: str, packed: npt.NDArray[np.uint64]) -> list[Any]:
    if kind == "int":
        return packed.view(np.int64).tolist()  # type: ignore[no-any-return]
    if kind == "uint":
        return packed.tolist()  # type: ignore[no-any-return]
    raw = packed.view(np.uint8).reshape(-1, 8)
    return [bytes(row[: row[7]]).decode() for row in raw]


class HashTable:
    """Open addressing with double hashing over numpy arrays, probed for a whole batch at once.

    Two multiplicative hashes of the packed uint64 give each key its first slot and an odd probe
    step (no primary clustering); each probe round is a few vectorised gathers over the rows
    still unresolved. The load is kept <= 1/3, so almost every key resolves in one round.
    """

    _MULT = np.uint64(0x9E3779B97F4A7C15)
    _MULT2 = np.uint64(0xC2B2AE3D27D4EB4F)

    def __init__(self, bits: int = 12) -> None:
        self._bits = bits
        self._mask = (1 << bits) - 1
        self.keys = np.zeros(1 << bits, dtype=np.uint64)
        self.codes = np.full(1 << bits, -1, dtype=np.int64)
        self.size = 0

    def _probe(self, packed: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        shift = np.uint64(64 - self._bits)
        with np.errstate(over="ignore"):
            first = ((packed * self._MULT) >> shift).astype(np.int64)
            step = ((packed * self._MULT2) >> shift).astype(np.int64) | 1
        return first, step

    def find(self, packed: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Code of each key, or -1 where absent."""
        out = np.full(packed.shape[0], -1, dtype=np.int64)
        rows = np.arange(packed.shape[0])
        slots, steps = self._probe(packed)
        while rows.size:
            codes = self.codes[slots]
            occupied = codes >= 0
            found = occupied & (self.keys[slots] == packed[rows])
            out[rows[found]] = codes[found]
            probe = occupied & ~found
            rows, steps = rows[probe], steps[probe]
            slots = (slots[probe] + steps) & self._mask
        return out

    def insert(self, keys: npt.NDArray[np.uint64], codes: npt.NDArray[np.int64]) -> None:
        """Add distinct keys that are absent; grows (rehashes) to keep the load <= 1/3."""
        if 3 * (self.size + keys.shape[0]) > (1 << self._bits):
            live = self.codes >= 0
            old_keys, old_codes = self.keys[live], self.codes[live]
            bits = self._bits
            while 3 * (self.size + keys.shape[0]) > (1 << bits):
                bits += 1
            self.__init__(bits)  # type: ignore[misc]
            self.insert(old_keys, old_codes)
        rows = np.arange(keys.shape[0])
        slots, steps = self._probe(keys)
        while rows.size:
            free = self.codes[slots] < 0
            _, first = np.unique(slots[free], return_index=True)  # one winner per free slot
            win = np.flatnonzero(free)[first]
            self.keys[slots[win]] = keys[rows[win]]
            self.codes[slots[win]] = codes[rows[win]]
            left = np.ones(rows.shape[0], dtype=bool)
            left[win] = False
            rows, slots, steps = rows[left], slots[left], steps[left]
            taken = self.codes[slots] >= 0
            slots[taken] = (slots[taken] + steps[taken]) & self._mask
        self.size += keys.shape[0]


class SortedRuns:
    """A set of uint64 values as sorted runs of geometrically growing sizes (a log-structured
    merge): adding costs amortised O(log n) per value without resorting everything, a lookup is a
    binary search per run, and memory is 8 bytes a value.

    >>> r = SortedRuns()
    >>> r.add(np.array([5, 3], np.uint64)); r.add(np.array([9, 3], np.uint64))
    >>> r.contains(np.array([3, 4, 9], np.uint64)).tolist(), len(r)
    ([True, False, True], 3)
    """

    def __init__(self) -> None:
        self._runs: list[npt.NDArray[np.uint64]] = []  # the largest first

    def __len__(self) -> int:
        return sum(run.shape[0] for run in self._runs)

    def add(self, values: npt.NDArray[np.uint64]) -> None:
        run = np.unique(values)
        run = run[~self.contains(run)]  # the runs stay disjoint: len counts each value once
        while self._runs and self._runs[-1].shape[0] <= 2 * run.shape[0]:
            run = np.union1d(self._runs.pop(), run)
        if run.size:
            self._runs.append(run)

    def contains(self, values: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        out = np.zeros(values.shape[0], dtype=bool)
        for run in self._runs:
            pos = np.minimum(np.searchsorted(run, values), run.shape[0] - 1)
            out |= run[pos] == values
        return out

    def values(self) -> npt.NDArray[np.uint64]:
        return np.unique(np.concatenate(self._runs)) if self._runs else np.empty(0, np.uint64)


def key_hashes(keys: list[Any]) -> npt.NDArray[np.uint64]:
    """Python hashes of keys, as uint64 (a set of them may report a key that is not there, on a
    collision: harmless where it only costs a state store read)."""
    return np.array([hash(k) for k in keys], dtype=np.int64).view(np.uint64)
