"""Generator sources: deterministic synthetic events, produced as columns (no JSON on the way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch, matrix_column
from aisp.ingest.base import Source, SourceContext, SourcePartition, Split, SplitReader, Splits

__all__ = ["WorkloadFSource"]

BASE_TS_MS = 1_700_000_000_000


@dataclass(frozen=True, kw_only=True)
class WorkloadFSource(Source):
    """Reference workload F (DESIGN.md section 4): ``events`` events from ``seed``.

    Columns: ``id`` int64, ``user`` string (``u<N>``, ``users`` distinct), ``amount`` float64
    (lognormal, cents), ``ts`` int64 epoch ms, ``f`` 16 float64 features. The same seed gives
    the same events whatever the batch sizes asked for.
    """

    events: int = 1_000_000
    seed: int = 0
    users: int = 100_000
    zipf: float = 0.0
    """Above 1: users drawn from a Zipf law of this exponent (user 0 the most frequent), for
    hot keys and a long tail; else uniformly (the reference workload)."""

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _WorkloadFPartition(self, int(resume_from or 0))

    def describe(self) -> str:
        return f"workload-f(events={self.events}, seed={self.seed})"

    def column_names(self) -> list[str]:
        return ["id", "user", "amount", "ts", "f"]

    def splits(self, resume_from: Any, rows: int) -> Splits:
        """Ranges of ``rows`` events (each the same events whoever reads it)."""
        return _Ranges(int(resume_from or 0), self.events, max(1, rows))

    def split_reader(self, ctx: SourceContext) -> SplitReader:
        names = _user_names(self.users)

        def read(spec: dict[str, Any]) -> list[Batch]:
            part = _WorkloadFPartition(self, int(spec["start"]), end=int(spec["end"]), names=names)
            batches = []
            while (batch := part.next_batch(_WorkloadFPartition._BLOCK)) is not None:
                batches.append(batch)
            return batches

        return read


def _user_names(users: int) -> pa.Array:
    return pa.array([f"u{i}" for i in range(users)], type=pa.string())


class _Ranges(Splits):
    def __init__(self, start: int, total: int, rows: int) -> None:
        self._next, self._total, self._rows = start, total, rows

    def next(self) -> Split | None:
        if self._next >= self._total:
            return None
        end = min(self._total, self._next + self._rows)
        split = Split({"start": self._next, "end": end}, end - self._next)
        self._next = end
        return split

    @property
    def position(self) -> Any:
        return self._next


class _WorkloadFPartition(SourcePartition):
    _BLOCK = 4096  # events are drawn in fixed blocks so output does not depend on batch sizes

    def __init__(
        self, cfg: WorkloadFSource, start: int, end: int | None = None, names: pa.Array | None = None
    ) -> None:
        self._cfg = cfg
        self._next = start
        self._end = cfg.events if end is None else min(end, cfg.events)
        self._names = names if names is not None else _user_names(cfg.users)
        self._block_no = -1
        self._block: dict[str, np.ndarray] = {}

    def _load_block(self, block_no: int) -> None:
        rng = np.random.default_rng([self._cfg.seed, block_no])
        n = self._BLOCK
        users = self._cfg.users
        self._block = {
            "user": (rng.zipf(self._cfg.zipf, n) - 1) % users
            if self._cfg.zipf > 1
            else rng.integers(0, users, n),
            "amount": np.round(rng.lognormal(3.0, 1.0, n), 2),
            "f": np.round(rng.normal(size=(n, 16)), 6),
        }
        self._block_no = block_no

    def next_batch(self, max_rows: int) -> Batch | None:
        total = self._end
        if self._next >= total:
            return None
        block_no, offset = divmod(self._next, self._BLOCK)
        if block_no != self._block_no:
            self._load_block(block_no)
        n = min(max_rows, total - self._next, self._BLOCK - offset)
        ids = np.arange(self._next, self._next + n, dtype=np.int64)
        blk = self._block
        cols = {
            "id": ids,
            "user": self._names.take(pa.array(blk["user"][offset : offset + n])),
            "amount": blk["amount"][offset : offset + n],
            "ts": BASE_TS_MS + ids,
            "f": matrix_column(blk["f"][offset : offset + n]),
        }
        self._next += n
        return Batch.from_columns(cols, ids=ids)

    def snapshot(self) -> Any:
        return self._next
