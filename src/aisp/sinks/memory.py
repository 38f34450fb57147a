"""In-process sinks: counting/null (benchmarks, served pipelines) and collecting (tests, notebooks)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aisp.batch import Batch
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

__all__ = ["CollectSink", "NullSink"]


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
