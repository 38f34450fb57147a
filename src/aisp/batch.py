"""``Batch``: the columnar micro-batch that moves between operators.

A thin immutable wrapper over a ``pyarrow.RecordBatch``. Besides user columns every batch carries
metadata columns whose names start with ``_``:

* ``_id``          int64, an id unique within a run (the source's sequence number);
* ``_ingest_ns``   int64, ``time.monotonic_ns()`` when the row entered the engine;
* ``_key``         optional, the row's key code (int64) once ``key_by`` ran;
* ``_tier``        optional int8 priority level (higher is served first);
* ``_deadline_ns`` optional int64 monotonic deadline (0 means none);
* ``_event_time``  optional int64 event time, ms since the epoch (a source with event time);
* ``_watermark``   optional int64 watermark before the row, ms (``aisp.transform.windows.event_time``).

Numeric columns convert to numpy without a copy; operators work on whole columns, never per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.ma  # noqa: F401 - pyarrow imports it lazily on its first numpy conversion (~60 ms)
import numpy.typing as npt
import pyarrow as pa

from aisp.errors import ConfigError

__all__ = [
    "DEADLINE_NS",
    "EVENT_TIME",
    "ID",
    "INGEST_NS",
    "KEY",
    "META_COLUMNS",
    "PARTIAL",
    "PARTITION_WATERMARK",
    "SOURCE",
    "TIER",
    "WATERMARK",
    "Batch",
    "matrix_column",
    "padded",
]

ID = "_id"
INGEST_NS = "_ingest_ns"
KEY = "_key"
TIER = "_tier"
DEADLINE_NS = "_deadline_ns"
EVENT_TIME = "_event_time"
WATERMARK = "_watermark"
PARTITION_WATERMARK = "_partition_watermark"
"""The watermark of the row's own input partition, when state follows partitions."""
PARTIAL = "_partial"
"""Set on rows that carry a piece of an event's result (an LLM's tokens as they come), which
go out to the event's client before the result and close no branch of it."""
SOURCE = "_source"
"""On a row a step made with an id of its own (a video frame, a caption, its sound): the id of
the event it comes from, which a served request's answers follow (``aisp.serve.pipelines.results``)."""
META_COLUMNS = (
    ID, INGEST_NS, KEY, TIER, DEADLINE_NS, EVENT_TIME, WATERMARK, PARTITION_WATERMARK, PARTIAL, SOURCE,
)  # fmt: skip

ColumnLike: TypeAlias = pa.Array | pa.ChunkedArray | npt.NDArray[Any] | Sequence[Any]


def matrix_column(matrix: npt.NDArray[Any]) -> pa.FixedSizeListArray:
    """Wrap a 2-D numpy array as an Arrow fixed-size-list column without copying.

    >>> col = matrix_column(np.zeros((3, 4), dtype=np.float32))
    >>> col.type
    FixedSizeListType(fixed_size_list<item: float>[4])
    """
    if matrix.ndim != 2:
        raise ConfigError(f"matrix_column needs a 2-D array, got {matrix.ndim}-D")
    flat = np.ascontiguousarray(matrix).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), matrix.shape[1])


def padded(column: pa.Array | pa.ChunkedArray, fill: int | float = 0) -> npt.NDArray[Any]:
    """A list column of rows of different lengths (token ids, say) as a 2-D array as wide as its
    longest row, the rest of each row ``fill``: vectorised, one scatter of the flat values.

    >>> padded(pa.array([[1, 2, 3], [4], []])).tolist()
    [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    """
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    values = col.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(col), width), fill, dtype=values.dtype)
    rows = np.repeat(np.arange(len(col)), lengths)
    out[rows, np.arange(values.shape[0]) - np.repeat(offsets[:-1] - offsets[0], lengths)] = values
    return out


def _to_arrow(values: ColumnLike) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    if isinstance(values, pa.Array):
        return values
    if isinstance(values, np.ndarray) and values.ndim == 2:
        return matrix_column(values)
    return pa.array(values)


class Batch:
    """An immutable columnar micro-batch.

    >>> b = Batch.from_columns({"x": np.arange(3)}, ingest_ns=5)
    >>> b.num_rows, b.column_names
    (3, ['x', '_id', '_ingest_ns'])
    >>> b.numpy("x").tolist()
    [0, 1, 2]
    """

    __slots__ = ("_ids", "_rb", "traced", "traceparents")

    def __init__(self, record_batch: pa.RecordBatch) -> None:
        self._rb = record_batch
        self._ids: npt.NDArray[np.int64] | None = None
        self.traced: npt.NDArray[np.int64] | None = None
        """Ids of the sampled (traced) events among the rows, when the executor traces: set
        at ingest and carried to the batches an operator derives, so that other batches cost
        a stage nothing."""
        self.traceparents: dict[int, str] | None = None
        """W3C ``traceparent`` values by event id: read by a broker source from its messages'
        headers (the producer's trace), or set by the executor for a sink (the event's own
        trace) to write to its outgoing messages. Not carried to derived batches."""

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, ColumnLike],
        *,
        ids: npt.NDArray[np.int64] | None = None,
        ingest_ns: int | npt.NDArray[np.int64] | None = None,
    ) -> Batch:
        """Build a batch from user columns, adding ``_id`` and ``_ingest_ns`` when absent."""
        arrays = {name: _to_arrow(values) for name, values in columns.items()}
        n = len(next(iter(arrays.values()))) if arrays else 0
        if ID not in arrays:
            arrays[ID] = pa.array(np.arange(n, dtype=np.int64) if ids is None else ids)
        if INGEST_NS not in arrays:
            if ingest_ns is None:
                import time

                ingest_ns = time.monotonic_ns()
            arr = np.full(n, ingest_ns, dtype=np.int64) if isinstance(ingest_ns, int) else ingest_ns
            arrays[INGEST_NS] = pa.array(arr)
        return cls(pa.RecordBatch.from_arrays(list(arrays.values()), names=list(arrays)))

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Concatenate batches with the same schema into one (copies the data once)."""
        if len(batches) == 1:
            return batches[0]
        if not batches:
            raise ConfigError("Batch.concat needs at least one batch, got 0")
        table = pa.Table.from_batches([b._rb for b in batches])
        return cls(table.combine_chunks().to_batches(max_chunksize=table.num_rows)[0])

    # -- access -------------------------------------------------------------------------------
    @property
    def record_batch(self) -> pa.RecordBatch:
        return self._rb

    @property
    def num_rows(self) -> int:
        return int(self._rb.num_rows)

    def __len__(self) -> int:
        return self.num_rows

    @property
    def column_names(self) -> list[str]:
        return list(self._rb.schema.names)

    @property
    def schema(self) -> pa.Schema:
        return self._rb.schema

    def __contains__(self, name: object) -> bool:
        return name in self._rb.schema.names

    def column(self, name: str) -> pa.Array:
        """The Arrow column ``name``; ``KeyError`` naming the known columns if absent."""
        idx = self._rb.schema.get_field_index(name)
        if idx < 0:
            raise KeyError(f"no column {name!r}; columns are {self.column_names}")
        return self._rb.column(idx)

    def numpy(self, name: str) -> npt.NDArray[Any]:
        """Column ``name`` as numpy: zero-copy for numeric columns without nulls.

        A fixed-size-list column comes back as a 2-D ``(rows, width)`` array, also without a copy;
        so does, copied, a list column whose rows all have the same length (as a per-row map
        makes of its lists):

        >>> Batch.from_columns({"v": pa.array([[1.0, 2.0], [3.0, 4.0]])}).numpy("v").shape
        (2, 2)
        """
        col = self.column(name)
        if isinstance(col, pa.ListArray | pa.LargeListArray) and col.null_count == 0 and len(col):
            lengths = np.diff(col.offsets.to_numpy())
            if (lengths == lengths[0]).all():
                rows: npt.NDArray[Any] = col.flatten().to_numpy(zero_copy_only=False)
                return rows.reshape(len(col), int(lengths[0]))
        if isinstance(col, pa.FixedSizeListArray) and col.null_count == 0:
            width = col.type.list_size
            values: npt.NDArray[Any] = col.values.to_numpy(zero_copy_only=False)
            start = col.offset * width
            return values[start : start + len(col) * width].reshape(len(col), width)
        if isinstance(col, pa.FixedSizeListArray):
            flat: npt.NDArray[Any] = col.flatten().to_numpy(zero_copy_only=False)
            return flat.reshape(len(col), col.type.list_size)
        arr: npt.NDArray[Any] = col.to_numpy(zero_copy_only=False)
        return arr

    def pylist(self, name: str) -> list[Any]:
        return self.column(name).to_pylist()  # type: ignore[no-any-return]

    @property
    def ids(self) -> npt.NDArray[np.int64]:
        """The event ids (read-only; converted once per batch: several observers ask)."""
        if self._ids is None:
            ids = self.numpy(ID)
            ids.flags.writeable = False
            self._ids = ids
        return self._ids

    @property
    def ingest_ns(self) -> npt.NDArray[np.int64]:
        return self.numpy(INGEST_NS)

    def meta(self, name: str, default: int = 0) -> npt.NDArray[np.int64]:
        """Metadata column ``name`` (e.g. ``_tier``); a constant array of ``default`` when absent."""
        if name in self:
            return self.numpy(name)
        return np.full(self.num_rows, default, dtype=np.int64)

    def rows(self) -> Iterator[dict[str, Any]]:
        """Iterate rows as dicts: the slow per-row path, for fallbacks and dead letters."""
        return iter(self._rb.to_pylist())

    # -- derivation (all return new batches) ---------------------------------------------------
    def with_columns(self, columns: Mapping[str, ColumnLike]) -> Batch:
        """A batch with ``columns`` added or replaced."""
        rb = self._rb
        for name, values in columns.items():
            arr = _to_arrow(values)
            idx = rb.schema.get_field_index(name)
            rb = rb.set_column(idx, name, arr) if idx >= 0 else rb.append_column(name, arr)
        return self._same_rows(Batch(rb), ID not in columns)

    def _same_rows(self, out: Batch, ids_kept: bool) -> Batch:
        """``out`` has this batch's rows in order: it reuses the converted ids and carries
        the traced ones."""
        if ids_kept:
            out._ids, out.traced = self._ids, self.traced
        return out

    def drop(self, names: Iterable[str]) -> Batch:
        keep = [n for n in self.column_names if n not in set(names)]
        return self.select(keep)

    def select(self, names: Sequence[str]) -> Batch:
        return self._same_rows(Batch(self._rb.select(list(names))), ID in names)

    def slice(self, offset: int, length: int | None = None) -> Batch:
        """Zero-copy slice of ``length`` rows from ``offset``."""
        return Batch(self._rb.slice(offset, length))

    def filter(self, mask: npt.NDArray[np.bool_] | pa.BooleanArray) -> Batch:
        """Rows where ``mask`` is true."""
        return Batch(self._rb.filter(pa.array(mask) if isinstance(mask, np.ndarray) else mask))

    def take(self, indices: npt.NDArray[np.integer[Any]] | Sequence[int]) -> Batch:
        return Batch(self._rb.take(pa.array(indices, pa.int64())))

    def __repr__(self) -> str:
        return f"Batch(rows={self.num_rows}, columns={self.column_names})"
