"""Sketch aggregates for windows: distinct counts (HyperLogLog), quantiles (KLL) and the most
frequent values (top-k), all mergeable (``aisp.transform.windows.aggregates`` has the interface).

``DistinctCount`` is a HyperLogLog kept as a row of ``2**precision`` one-byte registers per
window and updated for a whole batch with one ``np.maximum.at`` (values hashed vectorised:
numbers by their bits, strings over Arrow's buffers). ``Quantile`` and ``TopK`` keep one
Apache DataSketches sketch per window (KLL, frequent items): a batch updates each window's
sketch once, with all of that window's values (KLL takes a numpy array; top-k takes each
distinct value once with its count), so the Python work is per window, not per event.

>>> from aisp.transform.windows.aggregates import Groups
>>> g = Groups.of(np.array([0, 0, 0, 1]), None)
>>> d = DistinctCount("user")
>>> state = d.update(g, g.sorted(d.prepare(pa.array(["a", "b", "a", "c"]))), np.zeros(4, np.int64))
>>> d.result(state).round().tolist()
[2.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.transform.windows.aggregates import Aggregate, Groups, State

__all__ = ["DistinctCount", "Quantile", "TopK", "hash64"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: every input bit moves every output bit."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def hash64(column: pa.Array | pa.ChunkedArray) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per value, vectorised: integers and floats by their bits (``-0.0`` as
    ``0.0``), strings and binaries by a polynomial over their bytes; nulls hash alike.

    >>> h = hash64(pa.array(["ab", "ab", "ba", ""]))
    >>> bool(h[0] == h[1]), bool(h[0] != h[2]), bool(h[2] != h[3])
    (True, True, True)
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    if (
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or pa.types.is_large_binary(t)
    ):
        out = _hash_bytes(column)
    elif pa.types.is_floating(t):
        values = column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64) + 0.0  # -0.0 -> 0.0
        out = _mix(values.view(np.uint64) ^ np.uint64(0x5851F42D4C957F2D))
    elif pa.types.is_integer(t) or pa.types.is_boolean(t):
        values = column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = _mix(values.view(np.uint64))
    else:
        raise TypeError(f"cannot hash a {t} column: numbers, strings and binaries only")
    if column.null_count:
        out[~column.is_valid().to_numpy(zero_copy_only=False)] = np.uint64(0x9E3779B97F4A7C15)
    return out


def _hash_bytes(column: pa.Array) -> npt.NDArray[np.uint64]:
    large = pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type)
    n = len(column)
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32, count=column.offset + n + 1)
    offsets = offsets[column.offset :].astype(np.int64)
    lengths = np.diff(offsets)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = data[offsets[0] : offsets[-1]].astype(np.uint64)
    start = offsets[:-1] - offsets[0]
    pos = np.arange(data.shape[0], dtype=np.int64) - np.repeat(start, lengths)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(max(int(lengths.max()) if n else 0, 1), np.uint64(0x100000001B3)))
        terms = (data + np.uint64(1)) * powers[pos] if data.shape[0] else data
        sums = np.zeros(n, dtype=np.uint64)
        nonempty = lengths > 0
        if terms.shape[0]:
            sums[nonempty] = np.add.reduceat(terms, start[nonempty])
        return _mix(sums ^ lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))


@dataclass(frozen=True)
class DistinctCount(Aggregate):
    """The number of distinct values of ``column``, estimated by HyperLogLog with ``2**precision``
    registers (relative error about ``1.04 / sqrt(2**precision)``: 1.6% at 12; each open window
    holds ``2**precision`` bytes)."""

    column: str
    precision: int = 12

    def __post_init__(self) -> None:
        if not 4 <= self.precision <= 16:
            raise ValueError(f"DistinctCount precision must be 4..16, got {self.precision}")

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"registers": ("uint8", 0, 1 << self.precision)}  # type: ignore[dict-item]

    def prepare(self, column: pa.Array) -> npt.NDArray[Any]:
        return hash64(column)

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        p = self.precision
        h = values.astype(np.uint64, copy=False)
        bucket = (h >> np.uint64(64 - p)).astype(np.int64)
        rest = (h << np.uint64(p)) | np.uint64(1 << (p - 1))  # at most 64 - p + 1 leading zeros
        _, exponent = np.frexp(rest.astype(np.float64))
        rho = (64 - exponent + 1).astype(np.uint8)  # leading zeros + 1
        registers = np.zeros((len(groups), 1 << p), dtype=np.uint8)
        np.maximum.at(registers, (np.repeat(np.arange(len(groups)), groups.sizes), bucket), rho)
        return {"registers": registers}

    def merge(self, a: State, b: State) -> State:
        return {"registers": np.maximum(a["registers"], b["registers"])}

    def result(self, state: State) -> npt.NDArray[Any]:
        regs = state["registers"].astype(np.float64)
        m = regs.shape[1]
        alpha = {16: 0.673, 32: 0.697, 64: 0.709}.get(m, 0.7213 / (1 + 1.079 / m))
        raw = alpha * m * m / np.exp2(-regs).sum(axis=1)
        zeros = (regs == 0).sum(axis=1)
        with np.errstate(divide="ignore"):
            linear = m * np.log(m / np.maximum(zeros, 1))
        small = (raw <= 2.5 * m) & (zeros > 0)  # the small range: linear counting
        out: npt.NDArray[np.float64] = np.where(small, linear, raw)
        return out


def _merged(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Sketches merged pairwise (``a``'s merged in place; a missing one is the other)."""
    out = _objects(a.shape[0])
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            out[i] = y if x is None else x
        else:
            x.merge(y)
            out[i] = x
    return out


def _objects(n: int) -> npt.NDArray[np.object_]:
    return np.empty(n, dtype=object)


@dataclass(frozen=True)
class Quantile(Aggregate):
    """Quantiles ``q`` (one number, or several: a list per window) of ``column``, from a KLL
    sketch per window (Apache DataSketches; normalised rank error about 1.65% at ``k`` 200).
    The quantile of ``q`` is the smallest value with at least ``q`` of the values at or below
    it (numpy's ``inverted_cdf``): exact while a window holds fewer than ``k`` values."""

    column: str
    q: float | Sequence[float] = 0.5
    k: int = 200

    def __post_init__(self) -> None:
        qs = [self.q] if isinstance(self.q, int | float) else list(self.q)
        if not qs or not all(0 <= x <= 1 for x in qs):
            raise ValueError(f"Quantile q must be in [0, 1], got {self.q}")
        if not 8 <= self.k <= 65535:
            raise ValueError(f"Quantile k must be 8..65535, got {self.k}")

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"kll": ("object", None)}

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        from datasketches import kll_doubles_sketch

        x = values.astype(np.float64, copy=False)
        out = _objects(len(groups))
        for i, (s, n) in enumerate(zip(groups.starts.tolist(), groups.sizes.tolist(), strict=True)):
            sketch = kll_doubles_sketch(self.k)
            sketch.update(x[s : s + n])
            out[i] = sketch
        return {"kll": out}

    def merge(self, a: State, b: State) -> State:
        return {"kll": _merged(a["kll"], b["kll"])}

    def result(self, state: State) -> npt.NDArray[Any]:
        single = isinstance(self.q, int | float)
        qs = [float(self.q)] if isinstance(self.q, int | float) else [float(x) for x in self.q]
        values = [s.get_quantiles(qs, True) if s is not None else [np.nan] * len(qs) for s in state["kll"]]
        if single:
            return np.array([v[0] for v in values], dtype=np.float64)
        return np.array(values, dtype=np.float64).reshape(-1, len(qs))

    def dump(self, state: State) -> State:
        return {
            "kll": np.array([s.serialize() if s is not None else b"" for s in state["kll"]], dtype=object)
        }

    def load(self, state: State) -> State:
        from datasketches import kll_doubles_sketch

        sketches = [kll_doubles_sketch.deserialize(bytes(b)) if b else None for b in state["kll"]]
        out = _objects(len(sketches))
        out[:] = sketches
        return {"kll": out}


@dataclass(frozen=True)
class TopK(Aggregate):
    """The ``k`` most frequent values of ``column`` (strings; other values by their text) with
    their counts, most frequent first: a list of ``{"value", "count"}`` per window, from a
    frequent-items sketch (Apache DataSketches; exact while a window holds fewer than about
    ``0.75 * 2**lg_max_items`` distinct values, estimates with a bounded error beyond)."""

    column: str
    k: int = 10
    lg_max_items: int = 10

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"TopK k must be >= 1, got {self.k}")
        if not 3 <= self.lg_max_items <= 21:
            raise ValueError(f"TopK lg_max_items must be 3..21, got {self.lg_max_items}")

    def init(self) -> dict[str, tuple[str, Any]]:
        return {"items": ("object", None)}

    def prepare(self, column: pa.Array) -> npt.NDArray[Any]:
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            column = column.cast(pa.string())
        values: npt.NDArray[Any] = column.to_numpy(zero_copy_only=False)  # str, None for a null
        return values

    def update(self, groups: Groups, values: npt.NDArray[Any], times: npt.NDArray[np.int64]) -> State:
        from datasketches import frequent_strings_sketch

        out = _objects(len(groups))
        for g in range(len(groups)):
            out[g] = frequent_strings_sketch(self.lg_max_items)
        encoded = pa.array(values, type=pa.string()).dictionary_encode()  # each distinct value once
        codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        words = encoded.dictionary.to_pylist()
        group = np.repeat(np.arange(len(groups)), groups.sizes)
        valid = codes >= 0
        width = len(words) + 1
        pairs, counts = np.unique(group[valid] * width + codes[valid], return_counts=True)
        for pair, count in zip(pairs.tolist(), counts.tolist(), strict=True):
            g, code = divmod(pair, width)
            out[g].update(words[code], count)
        return {"items": out}

    def merge(self, a: State, b: State) -> State:
        return {"items": _merged(a["items"], b["items"])}

    def result(self, state: State) -> npt.NDArray[Any]:
        from datasketches import frequent_items_error_type

        out = _objects(state["items"].shape[0])
        for i, s in enumerate(state["items"]):
            rows = s.get_frequent_items(frequent_items_error_type.NO_FALSE_POSITIVES) if s is not None else []
            top = sorted(rows, key=lambda r: (-r[1], r[0]))[: self.k]
            out[i] = [{"value": item, "count": int(estimate)} for item, estimate, _, _ in top]
        return out

    def dump(self, state: State) -> State:
        return {
            "items": np.array([s.serialize() if s is not None else b"" for s in state["items"]], dtype=object)
        }

    def load(self, state: State) -> State:
        from datasketches import frequent_strings_sketch

        sketches = [frequent_strings_sketch.deserialize(bytes(b)) if b else None for b in state["items"]]
        out = _objects(len(sketches))
        out[:] = sketches
        return {"items": out}
