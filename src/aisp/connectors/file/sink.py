"""The JSON-lines file sink: one JSON object per row and line, resumable at a checkpoint's byte offset."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from aisp.batch import Batch
from aisp.errors import SinkError
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

__all__ = ["JsonlFileSink"]


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

    def line_encoder(self) -> RowEncoder:
        return RowEncoder(self.columns)

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

    def write_encoded(self, data: bytes | memoryview, rows: int) -> None:
        self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
