"""Cutting a JSON-lines file into blocks of whole lines, for several workers.

``FileBlocks`` reads the file to count lines and find the line ends, without holding it, so
each block carries its byte range and the number of the line before it (dead letters keep
their line numbers, and ids stay line numbers).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from aisp.errors import SourceError
from aisp.ingest.base import Split, Splits

__all__ = ["Block", "FileBlocks", "FileSplits"]

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Block:
    """Lines ``line + 1 ..`` of a file, in bytes ``[offset, end)``; ``lines`` of them."""

    offset: int
    end: int
    line: int
    lines: int


class FileBlocks:
    """Cuts ``path`` into blocks of whole lines, from a position (``offset``, ``line``).

    A block ends at the first line end at or after ``offset + block_bytes`` (or at the end of
    the file); a last line without a newline is a line. A UTF-8 byte order mark at the start of
    the file is skipped. Reads are sequential, in pieces of at most ``read_bytes``.
    """

    def __init__(
        self,
        path: str,
        *,
        offset: int = 0,
        line: int = 0,
        block_bytes: int = 1 << 18,
        read_bytes: int = 1 << 20,
    ) -> None:
        try:
            self._fh: BinaryIO = Path(path).open("rb", buffering=0)  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise SourceError(f"cannot open input {path!r}: {exc.strerror}") from exc
        self._fh.seek(0, io.SEEK_END)
        self.size = self._fh.tell()
        if offset == 0:
            self._fh.seek(0)
            offset = len(_BOM) if self._fh.read(len(_BOM)) == _BOM else 0
        self.offset, self.line = offset, line
        self.block_bytes, self._read_bytes = max(1, block_bytes), read_bytes

    def next(self) -> Block | None:
        """The next block, or None at the end of the file."""
        start = self.offset
        if start >= self.size:
            return None
        target = min(start + self.block_bytes, self.size)
        self._fh.seek(start)
        newlines, pos, last = 0, start, b""
        while pos < target:
            piece = self._fh.read(min(self._read_bytes, target - pos))
            if not piece:
                break
            newlines += piece.count(b"\n")
            pos += len(piece)
            last = piece[-1:]
        end = pos
        if last != b"\n":  # go on to the end of the line
            while True:
                piece = self._fh.read(4096)
                if not piece:
                    break
                i = piece.find(b"\n")
                if i >= 0:
                    end += i + 1
                    newlines += 1
                    last = b"\n"
                    break
                end += len(piece)
        lines = newlines + (1 if end >= self.size and last != b"\n" and end > start else 0)
        block = Block(start, end, self.line, lines)
        self.offset, self.line = end, self.line + lines
        return block

    def close(self) -> None:
        self._fh.close()


class FileSplits(Splits):
    """``FileBlocks`` as a source's splits (``JsonlFileSource.splits``): about ``rows`` lines
    each, by the length of the first lines."""

    def __init__(self, path: str, resume_from: Any, rows: int) -> None:
        offset, line = (int(resume_from["offset"]), int(resume_from["line"])) if resume_from else (0, 0)
        try:
            with Path(path).open("rb") as fh:
                fh.seek(offset)
                head = fh.read(1 << 16)
        except OSError as exc:
            raise SourceError(f"cannot open input {path!r}: {exc.strerror}") from exc
        per_line = len(head) / max(1, head.count(b"\n")) if head else 100.0
        self._blocks = FileBlocks(path, offset=offset, line=line, block_bytes=max(4096, int(per_line * rows)))

    def next(self) -> Split | None:
        block = self._blocks.next()
        if block is None:
            return None
        return Split({"offset": block.offset, "end": block.end, "line": block.line}, block.lines)

    @property
    def position(self) -> Any:
        return {"offset": self._blocks.offset, "line": self._blocks.line}

    def close(self) -> None:
        self._blocks.close()
