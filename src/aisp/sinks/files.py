"""File and in-process sinks: JSON lines, counting/null, collecting (for tests and notebooks)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import msgspec

from aisp.batch import Batch
from aisp.errors import SinkError
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

__all__ = ["CollectSink", "JsonlFileSink", "NullSink"]


@dataclass(frozen=True, kw_only=True)
class JsonlFileSink(Sink):
    """Writes each row as one JSON object per line (``columns`` or all user columns)."""

    path: str
    columns: Sequence[str] | None = None
    buffer_bytes: int = 1 << 20
    encode_heavy: ClassVar[bool] = True

    def open(self) -> SinkPartition:
        return _JsonlWriter(self)

    def resume(self, position: Any) -> SinkPartition:
        """Truncate the file to ``position["bytes"]`` (what the checkpoint covered) and append."""
        return _JsonlWriter(self, int(position["bytes"]))

    def describe(self) -> str:
        return f"jsonl:{self.path}"


class _JsonlWriter(SinkPartition):
    def __init__(self, cfg: JsonlFileSink, resume_bytes: int | None = None) -> None:
        try:
            if resume_bytes is None:
                self._fh: BinaryIO = Path(cfg.path).open("wb", buffering=cfg.buffer_bytes)  # noqa: SIM115
            else:
                self._fh = Path(cfg.path).open("r+b", buffering=cfg.buffer_bytes)  # noqa: SIM115
                self._fh.truncate(resume_bytes)
                self._fh.seek(resume_bytes)
        except OSError as exc:
            raise SinkError(f"cannot open output {cfg.path!r}: {exc.strerror}") from exc
        self._encoder = RowEncoder(cfg.columns)

    def snapshot(self) -> Any:
        self._fh.flush()
        return {"bytes": self._fh.tell()}

    def sync(self) -> None:
        os.fsync(self._fh.fileno())

    def write(self, batch: Batch) -> None:
        if batch.num_rows:
            self._fh.write(self._encoder.encode(batch))

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


@dataclass(frozen=True)
class NullSink(Sink):
    """Counts rows and drops them (for benchmarks)."""

    def open(self) -> SinkPartition:
        return _Null()

    def describe(self) -> str:
        return "null"


class _Null(SinkPartition):
    def __init__(self) -> None:
        self.rows = 0

    def write(self, batch: Batch) -> None:
        self.rows += batch.num_rows


@dataclass(frozen=True)
class CollectSink(Sink):
    """Keeps every row written, as dicts, in ``rows`` (shared by all partitions it opens)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: Sequence[str] | None = None

    def open(self) -> SinkPartition:
        return _Collect(self)


class _Collect(SinkPartition):
    def __init__(self, cfg: CollectSink) -> None:
        self._cfg = cfg
        self._encoder = RowEncoder(cfg.columns)
        self._lock = threading.Lock()

    def write(self, batch: Batch) -> None:
        if not batch.num_rows:
            return
        rows = msgspec.json.decode(b"[" + self._encoder.encode(batch).rstrip().replace(b"\n", b",") + b"]")
        with self._lock:
            self._cfg.rows.extend(rows)
