"""Generator sources: deterministic synthetic events, produced as columns (no JSON on the way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch, matrix_column
from aisp.ingest.base import Source, SourceContext, SourcePartition

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


class _WorkloadFPartition(SourcePartition):
    _BLOCK = 4096  # events are drawn in fixed blocks so output does not depend on batch sizes

    def __init__(self, cfg: WorkloadFSource, start: int) -> None:
        self._cfg = cfg
        self._next = start
        self._names = pa.array([f"u{i}" for i in range(cfg.users)], type=pa.string())
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
        total = self._cfg.events
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
