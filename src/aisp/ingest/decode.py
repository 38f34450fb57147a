"""Decode JSON lines straight into typed columns, with one result per line whatever the input.

The schema is a ``msgspec.Struct``: msgspec validates types, required fields and constraints
(``Annotated[list[float], Meta(min_length=16, max_length=16)]``) while decoding. Each field has
an Arrow type derived from its declared type (``_arrow_type``), so a column's type never depends
on the values in a chunk.

The fast path decodes every line with one C call each (``map``; as fast as joining the chunk
into one JSON array, and unlike that it cannot be misled by a line holding two values, half a
value or none) and builds each column with one numpy/Arrow conversion. Whatever it cannot take
falls back per line with the same result for the good lines:

* a line that does not decode (malformed JSON, a missing or mistyped field, two values on one
  line, a blank or whitespace-only line, a value nested deeper than the interpreter's recursion
  limit of about 1,000 levels) is an error pinned on its index with the reason;
* a row whose values decode but do not convert to the columns (an ``int`` beyond int64) is an
  error on its index too, found by converting the chunk's rows one at a time.

``decode`` never raises on input: rows plus errors always account for every line.
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
from aisp.ingest.plain import DecodeError, decode_rows, short

__all__ = ["ColumnarDecoder", "DecodeError", "Decoded", "RawMessage"]

Converter = Callable[[Sequence[Any]], pa.Array]

# what building a column from values msgspec accepted can still raise (an int past int64, ...)
_CONVERT_ERRORS = (pa.ArrowException, OverflowError, ValueError, TypeError, UnicodeError, RecursionError)


@dataclass(frozen=True)
class Decoded:
    """Columns of the valid rows, the chunk indices they came from, and the errors."""

    columns: dict[str, pa.Array]
    kept: np.ndarray | None  # None: every line was valid
    errors: list[DecodeError]


_SCALARS: dict[type, pa.DataType] = {
    msgspec.inspect.IntType: pa.int64(),
    msgspec.inspect.FloatType: pa.float64(),
    msgspec.inspect.BoolType: pa.bool_(),
    msgspec.inspect.StrType: pa.string(),
    msgspec.inspect.BytesType: pa.binary(),  # base64 in JSON (an image, an audio chunk)
}


def _arrow_type(t: msgspec.inspect.Type) -> pa.DataType | None:
    """The Arrow type of a declared field type; None for types with no Arrow equivalent (``Any``,
    unions of different kinds, ...), whose values become JSON text."""
    for kind, arrow in _SCALARS.items():
        if isinstance(t, kind):
            return arrow
    if isinstance(t, msgspec.inspect.ListType | msgspec.inspect.VarTupleType | msgspec.inspect.SetType):
        item = _arrow_type(t.item_type)
        return None if item is None else pa.list_(item)
    if isinstance(t, msgspec.inspect.UnionType):
        others = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        return _arrow_type(others[0]) if len(others) == 1 else None
    if isinstance(t, msgspec.inspect.StructType):
        fields = [(f.name, _arrow_type(f.type)) for f in t.fields]
        if any(a is None for _, a in fields):
            return None
        return pa.struct(fields)
    if isinstance(t, msgspec.inspect.DictType) and isinstance(t.key_type, msgspec.inspect.StrType):
        value = _arrow_type(t.value_type)
        return None if value is None else pa.map_(pa.string(), value)
    return None


def _converter(t: msgspec.inspect.Type) -> Converter:
    """Column builder for one field type.

    Floats need no finiteness check: msgspec rejects NaN/Infinity literals (not JSON) and
    numbers beyond the float64 range ("Number out of range"), and columns stay float64.
    """
    if isinstance(t, msgspec.inspect.IntType):
        return lambda v: pa.array(np.array(v, dtype=np.int64))  # OverflowError past int64
    if isinstance(t, msgspec.inspect.FloatType):
        return lambda v: pa.array(np.array(v, dtype=np.float64))
    if isinstance(t, msgspec.inspect.BoolType):
        return lambda v: pa.array(np.array(v, dtype=np.bool_))
    if isinstance(t, msgspec.inspect.StrType):
        return lambda v: pa.array(v, type=pa.string())
    if isinstance(t, msgspec.inspect.BytesType):  # msgspec decoded the base64 already
        return lambda v: pa.array(v, type=pa.binary())
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
    arrow = _arrow_type(t)
    if arrow is None:
        encode = msgspec.json.encode
        return lambda v: pa.array([encode(x).decode() for x in v], type=pa.string())
    return lambda v: pa.array(msgspec.to_builtins(list(v)), type=arrow)


class RawMessage(msgspec.Struct):
    """The schema of broker messages that are not JSON: each message's bytes as they came (a JPEG,
    an audio chunk), in the binary column ``data``. ``ColumnarDecoder(RawMessage)`` takes every
    message as a row, empty ones included (an image or audio step dead-letters those).

    >>> ColumnarDecoder(RawMessage).decode([b"\\xff\\xd8", b""]).columns["data"].to_pylist()
    [b'\\xff\\xd8', b'']
    """

    data: bytes


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
        self._one = msgspec.json.Decoder(schema)
        self._getter = attrgetter(*self.fields)
        self._getters = [attrgetter(name) for name in self.fields]

    def decode(self, lines: Sequence[bytes]) -> Decoded:
        """Rows of the lines that are valid, errors for the others (see the module docstring)."""
        if self.schema is RawMessage:
            return Decoded({"data": pa.array(lines, type=pa.binary())}, None, [])
        columns, kept, errors = decode_rows(
            self._one, lines, self._columns, self._convert_error, _CONVERT_ERRORS
        )
        return Decoded(columns, None if kept is None else np.asarray(kept, dtype=np.int64), errors)

    def _convert_error(self, item: Any) -> str | None:
        values = self._getter(item) if len(self.fields) > 1 else (self._getter(item),)
        for name, conv, value in zip(self.fields, self._converters, values, strict=True):
            try:
                conv([value])
            except OverflowError:
                return f"field `{name}`: a number is out of range for its column ({short(value)})"
            except _CONVERT_ERRORS as exc:
                return f"field `{name}`: value does not fit its column ({type(exc).__name__}: {exc})"
        return None

    def _columns(self, items: list[Any]) -> dict[str, pa.Array]:
        # one C-level pass per field: half the cost of a tuple per row transposed with zip
        return {
            name: conv(list(map(get, items)))
            for name, conv, get in zip(self.fields, self._converters, self._getters, strict=True)
        }
