"""JSON-lines file source: chunked reads, columnar decoding, dead letters with line numbers."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import msgspec
import numpy as np

from aisp.batch import Batch
from aisp.errors import SourceError
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.ingest.decode import ColumnarDecoder

__all__ = ["JsonlFileSource"]


@dataclass(frozen=True, kw_only=True)
class JsonlFileSource(Source):
    """Reads ``path`` (one JSON object per line) into batches typed by ``schema``.

    The file is read in ``read_block_bytes`` blocks, never whole; memory stays bounded by the
    block size plus the engine's queues. Positions are ``{"offset": bytes, "line": n}``.
    """

    path: str
    schema: type[msgspec.Struct]
    read_block_bytes: int = 1 << 20
    decode_heavy: ClassVar[bool] = True

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _JsonlPartition(self, ctx, resume_from)

    def describe(self) -> str:
        return f"jsonl:{self.path}"


class _JsonlPartition(SourcePartition):
    def __init__(self, cfg: JsonlFileSource, ctx: SourceContext, resume_from: Any) -> None:
        self._cfg, self._ctx = cfg, ctx
        try:
            self._fh: BinaryIO = Path(cfg.path).open("rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise SourceError(f"cannot open input {cfg.path!r}: {exc.strerror}") from exc
        self._offset, self._line = 0, 0
        if resume_from:
            self._offset, self._line = int(resume_from["offset"]), int(resume_from["line"])
            self._fh.seek(self._offset)
        self._lines: list[bytes] = []
        self._next_line = 0
        self._tail = b""
        self._eof = False
        self._decoder = ColumnarDecoder(cfg.schema)
        self._next_id = self._line

    def _fill(self, want: int) -> None:
        """Read blocks until ``want`` lines are buffered or the file ends."""
        while len(self._lines) - self._next_line < want and not self._eof:
            block = self._fh.read(self._cfg.read_block_bytes)
            rest = self._lines[self._next_line :]
            self._next_line = 0
            if not block:
                self._eof = True
                self._lines = [*rest, self._tail] if self._tail else rest
                self._tail = b""
                break
            parts = (self._tail + block).split(b"\n")
            self._tail = parts.pop()
            self._lines = rest + parts if rest else parts

    def next_batch(self, max_rows: int) -> Batch | None:
        self._fill(max_rows)
        start = self._next_line
        take = min(max_rows, len(self._lines) - start)
        if take <= 0:
            return None
        lines = self._lines[start : start + take]
        self._next_line = start + take
        first = self._line + 1
        self._line += take
        self._offset += sum(map(len, lines)) + take
        now = time.monotonic_ns()
        decoded = self._decoder.decode(lines)
        if decoded.errors:
            self._ctx.dead_letter(
                [
                    {
                        "line": first + e.index,
                        "step": self._ctx.step_id,
                        "reason": e.reason,
                        "raw": lines[e.index].decode("utf-8", "replace"),
                    }
                    for e in decoded.errors
                ]
            )
        line_idx = np.arange(take, dtype=np.int64) if decoded.kept is None else decoded.kept
        ids = first + line_idx  # the line number is the event's engine id
        return Batch.from_columns(decoded.columns, ids=ids, ingest_ns=now)

    def snapshot(self) -> Any:
        return {"offset": self._offset, "line": self._line}

    def close(self) -> None:
        self._fh.close()
