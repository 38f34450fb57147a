"""Decode JSON lines straight into typed columns, one C call per chunk on the fast path.

The schema is a ``msgspec.Struct``: msgspec validates types, required fields and constraints
(``Annotated[list[float], Meta(min_length=16, max_length=16)]``) while decoding, so a valid chunk
costs one ``decode`` call and the columns are then built with one numpy/Arrow conversion per
field. A chunk with any invalid line falls back to line-by-line decoding, which pins the error on
its line; only that chunk pays the slower path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from aisp.batch import matrix_column

__all__ = ["ColumnarDecoder", "DecodeError", "Decoded"]

Converter = Callable[[Sequence[Any]], pa.Array]


@dataclass(frozen=True)
class DecodeError:
    """One line that did not decode: its index within the chunk and why."""

    index: int
    reason: str


@dataclass(frozen=True)
class Decoded:
    """Columns of the valid rows, the chunk indices they came from, and the errors."""

    columns: dict[str, pa.Array]
    kept: np.ndarray | None  # None: every line was valid
    errors: list[DecodeError]


def _converter(t: msgspec.inspect.Type) -> Converter:
    """Column builder for one field type.

    Floats need no finiteness check: msgspec rejects NaN/Infinity literals (not JSON) and
    numbers beyond the float64 range ("Number out of range"), and columns stay float64.
    """
    if isinstance(t, msgspec.inspect.IntType):
        return lambda v: pa.array(np.array(v, dtype=np.int64))
    if isinstance(t, msgspec.inspect.FloatType):
        return lambda v: pa.array(np.array(v, dtype=np.float64))
    if isinstance(t, msgspec.inspect.BoolType):
        return lambda v: pa.array(np.array(v, dtype=np.bool_))
    if isinstance(t, msgspec.inspect.StrType):
        return lambda v: pa.array(v, type=pa.string())
    if (
        isinstance(t, msgspec.inspect.ListType)
        and isinstance(t.item_type, msgspec.inspect.FloatType | msgspec.inspect.IntType)
        and t.min_length is not None
        and t.min_length == t.max_length
    ):
        width = t.min_length
        dtype = np.float64 if isinstance(t.item_type, msgspec.inspect.FloatType) else np.int64

        def fixed(v: Sequence[Any]) -> pa.Array:
            flat = np.fromiter(chain.from_iterable(v), dtype=dtype, count=len(v) * width)
            return matrix_column(flat.reshape(len(v), width))

        return fixed
    return lambda v: pa.array(v)


class ColumnarDecoder:
    """Decodes chunks of JSON lines into the columns of ``schema`` (a ``msgspec.Struct``).

    >>> class Ev(msgspec.Struct):
    ...     id: int
    ...     x: float
    >>> d = ColumnarDecoder(Ev).decode([b'{"id": 1, "x": 2.5}', b'oops', b'{"id": 3, "x": 1}'])
    >>> d.columns["id"].to_pylist(), d.kept.tolist(), d.errors[0].index
    ([1, 3], [0, 2], 1)
    """

    def __init__(self, schema: type[msgspec.Struct]) -> None:
        info = msgspec.inspect.type_info(schema)
        assert isinstance(info, msgspec.inspect.StructType)
        self.schema = schema
        self.fields = [f.name for f in info.fields]
        self._converters = [_converter(f.type) for f in info.fields]
        self._many = msgspec.json.Decoder(list[schema])  # type: ignore[valid-type]
        self._one = msgspec.json.Decoder(schema)
        self._getter = attrgetter(*self.fields)

    def decode(self, lines: Sequence[bytes]) -> Decoded:
        try:
            items = self._many.decode(b"[" + b",".join(lines) + b"]")
            kept = None
            errors: list[DecodeError] = []
        except (msgspec.DecodeError, msgspec.ValidationError):
            items, kept, errors = self._decode_each(lines)
        return Decoded(self._columns(items), kept, errors)

    def _decode_each(self, lines: Sequence[bytes]) -> tuple[list[Any], np.ndarray, list[DecodeError]]:
        items: list[Any] = []
        kept: list[int] = []
        errors: list[DecodeError] = []
        for i, line in enumerate(lines):
            if not line.strip():
                errors.append(DecodeError(i, "empty line"))
                continue
            try:
                items.append(self._one.decode(line))
                kept.append(i)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                errors.append(DecodeError(i, str(exc)))
        return items, np.asarray(kept, dtype=np.int64), errors

    def _columns(self, items: list[Any]) -> dict[str, pa.Array]:
        if not items:
            values: list[Sequence[Any]] = [[] for _ in self.fields]
        elif len(self.fields) == 1:
            values = [[self._getter(x) for x in items]]
        else:
            values = list(zip(*map(self._getter, items), strict=True))
        return {
            name: conv(vals) for name, conv, vals in zip(self.fields, self._converters, values, strict=True)
        }
