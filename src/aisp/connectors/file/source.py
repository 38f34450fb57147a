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
from aisp.ingest.plain import DecodeError, LineReader, PlainSchema, decode_chunk

__all__ = ["JsonlFileSource"]


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

    def spawned(self) -> Source | None:
        """``SpawnedJsonlSource`` when the schema is plain (``ingest/plain.PlainSchema``)."""
        from aisp.connectors.file.spawned import SpawnedJsonlSource

        schema = PlainSchema.describe(self.schema)
        if schema is None:
            return None
        return SpawnedJsonlSource(
            path=self.path,
            schema=schema,
            read_block_bytes=self.read_block_bytes,
            max_line_bytes=self.max_line_bytes,
        )

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
        self._reader = LineReader(self._fh, resume_from, cfg.read_block_bytes, cfg.max_line_bytes)
        self._decoder = decoder if decoder is not None else ColumnarDecoder(cfg.schema)

    def next_batch(self, max_rows: int) -> Batch | None:
        chunk = self._reader.take(max_rows)
        if chunk is None:
            return None
        now = time.monotonic_ns()
        columns, kept, records = decode_chunk(
            self._decode, chunk, self._ctx.step_id, self._cfg.max_line_bytes
        )
        if records:
            self._ctx.dead_letter(records)
        first, lines = chunk[0], chunk[1]
        line_idx = np.arange(len(lines), dtype=np.int64) if kept is None else kept
        ids = first + line_idx  # the line number is the event's engine id
        return Batch.from_columns(columns, ids=ids, ingest_ns=now)

    def _decode(self, lines: list[bytes]) -> tuple[dict[str, Any], Any, list[DecodeError]]:
        decoded = self._decoder.decode(lines)
        return decoded.columns, decoded.kept, decoded.errors

    def snapshot(self) -> Any:
        return self._reader.position

    def close(self) -> None:
        self._fh.close()
