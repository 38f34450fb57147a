"""The sink contract.

A ``Sink`` is a config-only factory; ``Sink.open()`` returns a ``SinkPartition`` that owns the
live writer. ``write(batch)`` is called from one thread at a time with batches in arrival order;
``flush()`` makes everything written so far durable (called at drain and before checkpoints);
``close()`` flushes and releases the writer. For checkpoints, ``snapshot()`` returns the durable
position and ``Sink.resume(position)`` reopens there (the file sink truncates what came after).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import META_COLUMNS, Batch
from aisp.errors import SinkError

if TYPE_CHECKING:
    from aisp.ingest.base import SourcePartition

__all__ = ["RowEncoder", "Sink", "SinkPartition", "user_columns"]


def user_columns(batch: Batch) -> list[str]:
    return [c for c in batch.column_names if c not in META_COLUMNS]


class RowEncoder:
    """Encodes batches as JSON lines: one msgspec struct per row, one encode call per batch."""

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        self._columns = list(columns) if columns is not None else None
        self._struct: Any = None
        self._struct_names: tuple[str, ...] = ()
        self._encoder = msgspec.json.Encoder()

    def encode(self, batch: Batch) -> bytes:
        names = tuple(self._columns if self._columns is not None else user_columns(batch))
        if names != self._struct_names:
            self._struct = msgspec.defstruct("Row", list(names))
            self._struct_names = names
        cols = [_pylist(batch.column(n)) for n in names]
        return self._encoder.encode_lines(list(map(self._struct, *cols)))


def _pylist(col: pa.Array) -> list[Any]:
    t = col.type
    if (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)) and col.null_count == 0:
        return col.to_numpy(zero_copy_only=False).tolist()  # type: ignore[no-any-return]
    if isinstance(col, pa.FixedSizeListArray) and col.null_count == 0:
        width = col.type.list_size
        return col.flatten().to_numpy(zero_copy_only=False).reshape(-1, width).tolist()  # type: ignore[no-any-return]
    return col.to_pylist()  # type: ignore[no-any-return]


WrittenFn = Callable[[npt.NDArray[np.int64], int], None]


class SinkPartition(abc.ABC):
    """The live writer of a sink.

    A partition with ``reports_written`` calls ``on_written(ingest_ns, written_ns)`` itself when
    rows are really written (e.g. by another process); for the others the engine reports a batch
    as written when ``write`` returns.
    """

    reports_written: ClassVar[bool] = False
    on_written: WrittenFn | None = None

    @abc.abstractmethod
    def write(self, batch: Batch) -> None: ...

    def snapshot(self) -> Any:
        """Flush, and return the position after everything written (JSON-able), for a
        checkpoint; ``Sink.resume(position)`` reopens there. None: the sink cannot resume."""
        self.flush()
        return None

    def write_encoded(self, data: bytes | memoryview, rows: int) -> None:
        """Write ``rows`` rows already encoded by the sink's ``line_encoder()`` (JSON lines from
        a worker process)."""
        raise SinkError(f"{type(self).__name__} does not take encoded lines")

    def bind_sources(self, sources: Mapping[str, SourcePartition]) -> None:  # noqa: B027 - optional hook
        """The pipeline's live sources, by step, once they are open: for a sink that commits
        source positions together with its own writes (Kafka transactions)."""

    def take_state_writes(self, states: Any) -> bool:
        """Whether this sink writes the keyed state of ``states`` (a ``PartitionStateStore``)
        in its own transactions, so that it commits with the outputs and the input offsets
        (a transactional Kafka output and changelog topics on its cluster); its ``snapshot``
        then leaves the commit to ``sync``."""
        return False

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Make everything up to the last ``snapshot()`` durable (may run while ``write`` goes
        on in another thread); the checkpoint's manifest is written after it returns."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make what was written durable."""

    def close(self) -> None:
        self.flush()


class Sink(abc.ABC):
    """Config-only factory of ``SinkPartition``s.

    ``encode_heavy`` sinks (JSON encoding) are run in a child process by the executor.
    """

    encode_heavy: ClassVar[bool] = False

    @abc.abstractmethod
    def open(self) -> SinkPartition: ...

    def line_encoder(self) -> RowEncoder | None:
        """For a sink that writes each row as the JSON line of a ``RowEncoder``: that encoder, so
        worker processes encode and the writer's ``write_encoded`` only writes. None: the writer
        takes batches."""
        return None

    def resume(self, position: Any) -> SinkPartition:
        """Reopen at ``position`` (from ``SinkPartition.snapshot()``), undoing or skipping what was
        written after it, so a restored pipeline's replay writes each output once."""
        raise SinkError(f"sink {self.describe()} cannot resume from a checkpoint")

    def describe(self) -> str:
        return type(self).__name__
