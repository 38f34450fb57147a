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
from aisp.ingest.base import Source, SourceContext, SourcePartition, SplitReader, Splits
from aisp.ingest.decode import ColumnarDecoder

__all__ = ["JsonlFileSource"]


_BOM = b"\xef\xbb\xbf"
_RAW_PREFIX = 1024  # bytes of an over-long line kept for its dead letter


@dataclass(frozen=True, kw_only=True)
class JsonlFileSource(Source):
    """Reads ``path`` (one JSON object per line) into batches typed by ``schema``.

    The file is read in ``read_block_bytes`` blocks, never whole; memory stays bounded by the
    block size, ``max_line_bytes`` and the engine's queues. Positions are
    ``{"offset": bytes, "line": n}``; one that also holds ``"end"`` reads only the bytes
    before that offset (a block of the file, for one of several workers: ``splits``). Every
    line is an event: a line that is not a valid
    object of the schema (blank and whitespace-only lines included, and a line longer than
    ``max_line_bytes``, which is skipped without being held in memory) is dead-lettered with its
    line number and the reason. A UTF-8 byte order mark at the start of the file is skipped.
    """

    path: str
    schema: type[msgspec.Struct]
    read_block_bytes: int = 1 << 20
    max_line_bytes: int = 16 << 20
    decode_heavy: ClassVar[bool] = True

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _JsonlPartition(self, ctx, resume_from)

    def column_names(self) -> list[str]:
        return ColumnarDecoder(self.schema).fields

    def splits(self, resume_from: Any, rows: int) -> Splits:
        """Blocks of whole lines (``blocks.FileBlocks``), about ``rows`` lines each."""
        from aisp.connectors.file.blocks import FileSplits

        return FileSplits(self.path, resume_from, rows)

    def split_reader(self, ctx: SourceContext) -> SplitReader:
        """Reads a block: the lines in bytes ``[offset, end)``, numbered from ``line + 1``."""
        decoder = ColumnarDecoder(self.schema)

        def read(spec: dict[str, Any]) -> list[Batch]:
            part = _JsonlPartition(self, ctx, spec, decoder)
            try:
                batches = []
                while (batch := part.next_batch(1 << 30)) is not None:
                    batches.append(batch)
                return batches
            finally:
                part.close()

        return read

    def describe(self) -> str:
        return f"jsonl:{self.path}"


class _TooLong(bytes):
    """The first bytes of a line longer than ``max_line_bytes``; ``length`` is its full length."""

    length: int


class _JsonlPartition(SourcePartition):
    def __init__(
        self,
        cfg: JsonlFileSource,
        ctx: SourceContext,
        resume_from: Any,
        decoder: ColumnarDecoder | None = None,
    ) -> None:
        self._cfg, self._ctx = cfg, ctx
        try:
            self._fh: BinaryIO = Path(cfg.path).open("rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise SourceError(f"cannot open input {cfg.path!r}: {exc.strerror}") from exc
        self._offset, self._line = 0, 0
        self._end: int | None = None
        if resume_from:
            self._end = resume_from.get("end")
            self._offset, self._line = int(resume_from["offset"]), int(resume_from["line"])
            self._fh.seek(self._offset)
        elif self._fh.read(len(_BOM)) == _BOM:
            self._offset = len(_BOM)
        else:
            self._fh.seek(0)
        self._lines: list[bytes] = []
        self._next_line = 0
        self._tail: list[bytes] = []  # the unfinished last line, in pieces
        self._tail_bytes = 0
        self._too_long = 0  # buffered ``_TooLong`` lines
        self._eof = False
        self._decoder = decoder if decoder is not None else ColumnarDecoder(cfg.schema)

    def _fill(self, want: int) -> None:
        """Read blocks until ``want`` lines are buffered or the file ends."""
        while len(self._lines) - self._next_line < want and not self._eof:
            size = self._cfg.read_block_bytes
            if self._end is not None:
                size = min(size, self._end - self._fh.tell())
            block = self._fh.read(size) if size > 0 else b""
            rest = self._lines[self._next_line :]
            self._next_line = 0
            if not block:
                self._eof = True
                self._lines = [*rest, self._end_tail(b"")] if self._tail_bytes else rest
                break
            parts = block.split(b"\n")
            last = parts.pop()
            if parts:
                parts[0] = self._end_tail(parts[0])
                if len(block) > self._cfg.max_line_bytes:
                    parts[1:] = [self._checked(p) for p in parts[1:]]
            self._add_tail(last)
            self._lines = rest + parts if rest else parts

    def _add_tail(self, piece: bytes) -> None:
        if not piece:
            return
        if self._tail_bytes <= self._cfg.max_line_bytes:
            self._tail.append(piece)
            if self._tail_bytes + len(piece) > self._cfg.max_line_bytes:  # keep a prefix only
                self._tail = [b"".join(self._tail)[:_RAW_PREFIX]]
        self._tail_bytes += len(piece)

    def _end_tail(self, piece: bytes) -> bytes:
        """The line the tail plus ``piece`` complete."""
        if not self._tail_bytes:
            return self._checked(piece)
        self._add_tail(piece)
        line = self._checked(b"".join(self._tail), self._tail_bytes)
        self._tail, self._tail_bytes = [], 0
        return line

    def _checked(self, line: bytes, length: int | None = None) -> bytes:
        length = len(line) if length is None else length
        if length <= self._cfg.max_line_bytes:
            return line
        marker = _TooLong(line[:_RAW_PREFIX])
        marker.length = length
        self._too_long += 1
        return marker

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
        too_long = self._take_too_long(lines) if self._too_long else {}
        self._offset += sum(map(len, lines)) + take + sum(too_long.values())
        now = time.monotonic_ns()
        decoded = self._decoder.decode(
            [b"" if i in too_long else x for i, x in enumerate(lines)] if too_long else lines
        )
        if decoded.errors:
            limit = self._cfg.max_line_bytes
            self._ctx.dead_letter(
                [
                    {
                        "line": first + e.index,
                        "step": self._ctx.step_id,
                        "reason": e.reason
                        if e.index not in too_long
                        else f"line of {len(lines[e.index]) + too_long[e.index]} bytes is longer than"
                        f" max_line_bytes ({limit}); skipped",
                        "raw": lines[e.index].decode("utf-8", "replace"),
                    }
                    for e in decoded.errors
                ]
            )
        line_idx = np.arange(take, dtype=np.int64) if decoded.kept is None else decoded.kept
        ids = first + line_idx  # the line number is the event's engine id
        return Batch.from_columns(decoded.columns, ids=ids, ingest_ns=now)

    def _take_too_long(self, lines: list[bytes]) -> dict[int, int]:
        """{index: bytes not held} of the over-long lines among ``lines``."""
        found = {i: x.length - len(x) for i, x in enumerate(lines) if type(x) is _TooLong}
        self._too_long -= len(found)
        return found

    def snapshot(self) -> Any:
        return {"offset": self._offset, "line": self._line}

    def close(self) -> None:
        self._fh.close()
