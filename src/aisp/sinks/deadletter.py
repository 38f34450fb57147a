"""The dead-letter sink: every event the pipeline could not process, with the step and the cause.

Records are JSON lines ``{"step", "reason", ...}`` plus ``line`` and ``raw`` (the original line)
for input that did not parse, or ``row`` (the event's columns) for rows an operator, the batcher
or a model rejected. Writes are serialised by a lock: dead letters are rare and may come from any
stage's thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec

from aisp.batch import ID, Batch
from aisp.sinks.base import user_columns

__all__ = ["DeadLetterSink", "DeadLetterWriter"]


@dataclass(frozen=True, kw_only=True)
class DeadLetterSink:
    """Where dead letters go: a JSONL file (``path``), a broker stream (``stream``: a sink whose
    writer has ``write_lines(keys, lines)``, e.g. ``RedisStreamSink`` or ``JetStreamSink``), or
    nowhere (only counted).

    On a broker each record carries an idempotency key (its step and the id, line, stream id or
    offset of the event), so a restored pipeline's replay does not dead-letter an event twice.
    """

    path: str | None = None
    stream: Any = None
    keep_last: int = 1000

    def open(self, resume_bytes: int | None = None) -> DeadLetterWriter:
        """The writer; ``resume_bytes`` (from a checkpoint) truncates the file there and appends."""
        return DeadLetterWriter(self, resume_bytes)


class DeadLetterWriter:
    """Thread-safe writer; ``count`` and ``by_reason`` feed the run summary."""

    def __init__(self, cfg: DeadLetterSink, resume_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._fh: IO[bytes] | None = None
        if cfg.path and resume_bytes is None:
            self._fh = Path(cfg.path).open("wb")  # noqa: SIM115 - closed in close()
        elif cfg.path and resume_bytes is not None:
            self._fh = Path(cfg.path).open("r+b")  # noqa: SIM115
            self._fh.truncate(resume_bytes)
            self._fh.seek(resume_bytes)
        self._out = cfg.stream.open() if cfg.stream is not None else None
        self._encoder = msgspec.json.Encoder()
        self.count = 0
        self.by_step: dict[str, int] = {}
        self.recent: list[dict[str, Any]] = []
        self._keep = cfg.keep_last

    def records(self, records: Iterable[dict[str, Any]]) -> None:
        recs = list(records)
        if not recs:
            return
        data = self._encoder.encode_lines(recs) if self._fh is not None or self._out is not None else b""
        with self._lock:
            self.count += len(recs)
            for r in recs:
                step = str(r.get("step"))
                self.by_step[step] = self.by_step.get(step, 0) + 1
            self.recent = (self.recent + recs)[-self._keep :]
            if self._fh is not None:
                self._fh.write(data)
            if self._out is not None:
                self._out.write_lines([_key(r) for r in recs], data.split(b"\n")[: len(recs)])

    def rows(
        self, batch: Batch, step: str, reason: str, fields: Mapping[str, Sequence[Any]] | None = None
    ) -> None:
        """Dead-letter every row of ``batch`` with ``step`` and ``reason``; ``fields`` adds a
        field to each record (one value per row)."""
        if not batch.num_rows:
            return
        cols = user_columns(batch)
        rows = batch.select(cols).record_batch.to_pylist()
        ids = batch.numpy(ID).tolist() if ID in batch else [None] * batch.num_rows
        records = [
            {"id": i, "step": step, "reason": reason, "row": r} for i, r in zip(ids, rows, strict=True)
        ]
        for name, values in (fields or {}).items():
            for record, value in zip(records, values, strict=True):
                record[name] = value
        self.records(records)

    def flush(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()

    def snapshot(self) -> int | None:
        """Flush; the file's length (for a checkpoint), or None without a file."""
        with self._lock:
            if self._fh is None:
                return None
            self._fh.flush()
            return self._fh.tell()

    def sync(self) -> None:
        """fsync what the last ``snapshot`` covered (and anything after it)."""
        fh = self._fh
        if fh is not None:
            os.fsync(fh.fileno())

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
            if self._out is not None:
                self._out.close()
                self._out = None


_KEY_FIELDS = ("id", "line", "stream_id", "stream_seq", "partition", "offset")


def _key(record: dict[str, Any]) -> str:
    """A dead letter's idempotency key: its step and what identifies its event.

    >>> _key({"step": "events", "line": 7, "reason": "x"})
    'dl:events:7'
    """
    return ":".join(["dl", str(record.get("step")), *(str(record[k]) for k in _KEY_FIELDS if k in record)])
