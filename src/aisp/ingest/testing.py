"""A source of rows given in code, for tests, examples and doctests (as Bytewax's
``TestingSource``): it resumes from a checkpoint like any other source.

>>> from aisp import CollectSink, Pipeline
>>> p, out = Pipeline("t"), CollectSink(columns=["x"])
>>> p.source("src", TestingSource([{"x": 1}, {"x": 2}, {"x": 3}], batch_rows=2)).sink("out", out)
>>> _ = p.run()
>>> [r["x"] for r in out.rows]
[1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.ingest.base import Source, SourceContext, SourcePartition

__all__ = ["TestingSource"]


@dataclass(frozen=True)
class TestingSource(Source):
    """``rows`` (dicts with the same keys) in batches of at most ``batch_rows``; event ids are
    the rows' positions. Its position for checkpoints is the index of the next row."""

    __test__ = False  # not a pytest test class

    rows: Sequence[Mapping[str, Any]]
    batch_rows: int = 2048

    def __post_init__(self) -> None:
        if self.batch_rows < 1:
            raise ConfigError(f"batch_rows must be >= 1, got {self.batch_rows}")

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _TestingPartition(self, int(resume_from or 0))

    def column_names(self) -> list[str] | None:
        return list(self.rows[0]) if self.rows else None


class _TestingPartition(SourcePartition):
    def __init__(self, cfg: TestingSource, position: int) -> None:
        self._cfg, self._next = cfg, position

    def next_batch(self, max_rows: int) -> Batch | None:
        rows = self._cfg.rows
        if self._next >= len(rows):
            return None
        end = min(len(rows), self._next + min(max_rows, self._cfg.batch_rows))
        table = pa.RecordBatch.from_pylist([dict(r) for r in rows[self._next : end]])
        ids = np.arange(self._next, end, dtype=np.int64)
        self._next = end
        return Batch.from_columns({n: table.column(n) for n in table.schema.names}, ids=ids)

    def snapshot(self) -> Any:
        return self._next
