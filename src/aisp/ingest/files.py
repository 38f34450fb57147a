"""A source of whole files: each file under a directory (or each path given) is one event, its
bytes in a binary column (images, audio clips, documents), its path in another.

>>> import tempfile
>>> from aisp import CollectSink, Pipeline
>>> d = Path(tempfile.mkdtemp())
>>> for i in range(3):
...     _ = (d / f"{i}.bin").write_bytes(bytes([i]) * (i + 1))
>>> p, out = Pipeline("f"), CollectSink(columns=["path", "data"])
>>> p.source("files", FilesSource(d, pattern="*.bin")).sink("out", out)
>>> _ = p.run()
>>> [(Path(r["path"]).name, r["data"]) for r in out.rows]  # bytes leave as base64, as JSON carries them
[('0.bin', 'AA=='), ('1.bin', 'AQE='), ('2.bin', 'AgIC')]

The files are listed once, when the source opens, in sorted order; an event's id is its place in
that list and so is the position a checkpoint keeps, so a restart reads on from the next file.
A file larger than ``max_file_bytes``, or one that cannot be read, is a dead letter with the
reason; the other files go on. A batch holds at most ``batch_rows`` files and about
``batch_bytes`` bytes, so memory stays bounded however large the directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition

__all__ = ["FilesSource"]


@dataclass(frozen=True, kw_only=False)
class FilesSource(Source):
    """The files matching ``pattern`` under ``root`` (recursively with ``**``), or the files
    ``root`` lists, one event each: ``column`` holds the bytes and ``path_column`` the path."""

    root: str | Path | Sequence[str | Path]
    pattern: str = "*"
    column: str = "data"
    path_column: str = "path"
    batch_rows: int = 64
    batch_bytes: int = 16 << 20
    max_file_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.batch_rows < 1 or self.batch_bytes < 1 or self.max_file_bytes < 1:
            raise ConfigError("batch_rows, batch_bytes and max_file_bytes must be >= 1")

    def paths(self) -> list[Path]:
        """The files this source reads, in order."""
        if isinstance(self.root, str | Path):
            root = Path(self.root)
            if not root.is_dir():
                raise ConfigError(f"no directory at {root}")
            return sorted(p for p in root.glob(self.pattern) if p.is_file())
        return [Path(p) for p in self.root]

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _FilesPartition(self, ctx, self.paths(), int(resume_from or 0))

    def column_names(self) -> list[str] | None:
        return [self.path_column, self.column]

    def describe(self) -> str:
        return f"FilesSource({self.root}, {self.pattern!r})"


class _FilesPartition(SourcePartition):
    def __init__(self, cfg: FilesSource, ctx: SourceContext, paths: list[Path], position: int) -> None:
        self._cfg, self._ctx, self._paths, self._next = cfg, ctx, paths, position

    def next_batch(self, max_rows: int) -> Batch | None:
        cfg = self._cfg
        if self._next >= len(self._paths):
            return None
        names: list[str] = []
        blobs: list[bytes] = []
        ids: list[int] = []
        size, bad = 0, list[DeadLetterRecord]()
        while self._next < len(self._paths) and len(blobs) < min(max_rows, cfg.batch_rows):
            if blobs and size >= cfg.batch_bytes:
                break
            i, path = self._next, self._paths[self._next]
            self._next += 1
            try:
                with path.open("rb") as f:
                    data = f.read(cfg.max_file_bytes + 1)
            except OSError as exc:
                bad.append({"id": i, "path": str(path), "reason": f"cannot read {path}: {exc.strerror}"})
                continue
            if len(data) > cfg.max_file_bytes:
                reason = f"file too large: over {cfg.max_file_bytes} bytes"
                bad.append({"id": i, "path": str(path), "reason": reason})
                continue
            names.append(str(path))
            blobs.append(data)
            ids.append(i)
            size += len(data)
        if bad:
            self._ctx.dead_letter([{**r, "step": self._ctx.step_id} for r in bad])
        return Batch.from_columns(
            {cfg.path_column: pa.array(names, pa.string()), cfg.column: pa.array(blobs, pa.binary())},
            ids=np.asarray(ids, dtype=np.int64),
        )

    def snapshot(self) -> Any:
        return self._next
