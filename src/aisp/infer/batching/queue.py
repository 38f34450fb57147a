"""The batching policy: per-tier queues, flush rules, expiry and shedding, over an injected clock.

``BatchQueue.push`` queues rows, ``pop_ready`` forms the next model batch when a flush rule
holds, ``expire`` removes rows past their timeout or deadline, ``shed`` makes room for higher
tiers by dropping the lowest. Every call takes ``now_ns``; nothing sleeps, so tests need no
real time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from aisp.batch import DEADLINE_NS, TIER, Batch
from aisp.infer.batching.config import _MS, BatcherConfig
from aisp.infer.runtimes.base import CostModel

__all__ = ["BatchQueue", "BatcherStats"]


class _Piece:
    """Queued rows from one pushed batch (or its tier): one enqueue time, optional deadlines."""

    __slots__ = ("batch", "deadlines", "enqueue_ns", "min_deadline", "timeout_at")

    def __init__(
        self,
        batch: Batch,
        enqueue_ns: int,
        deadlines: npt.NDArray[np.int64] | None,
        timeout_at: int | None = None,
    ) -> None:
        self.batch = batch
        self.enqueue_ns = enqueue_ns
        self.timeout_at = timeout_at
        self.deadlines = deadlines
        set_ = None if deadlines is None else deadlines[deadlines != 0]
        self.min_deadline = int(set_.min()) if set_ is not None and set_.size else None
        if self.min_deadline is None:
            self.deadlines = None  # no row has a deadline

    def rest(self, offset: int) -> _Piece:
        """The piece without its first ``offset`` rows."""
        deadlines = None if self.deadlines is None else self.deadlines[offset:]
        return _Piece(self.batch.slice(offset), self.enqueue_ns, deadlines, self.timeout_at)

    def head(self, rows: int) -> _Piece:
        """The piece's first ``rows`` rows."""
        deadlines = None if self.deadlines is None else self.deadlines[:rows]
        return _Piece(self.batch.slice(0, rows), self.enqueue_ns, deadlines, self.timeout_at)


class BatchQueue:
    """The batching policy over a clock the caller supplies; no threads, no sleeping.

    Rows are queued per tier (``_tier`` column, 0 when absent), higher tiers served first, FIFO
    within a tier. A formed batch never exceeds ``max_batch_size``; queued pieces are split with
    ``Batch.slice`` and joined with ``Batch.concat``. Pieces whose schema differs from the first
    piece taken (field metadata included: a served model's per-row tensor shapes) wait for the
    next batch.

    >>> q = BatchQueue(BatcherConfig(max_batch_size=2))
    >>> q.push(Batch.from_columns({"x": [1, 2, 3]}), now_ns=0)
    >>> q.pop_ready(now_ns=0, idle=False).num_rows, q.queued_rows
    (2, 1)
    """

    def __init__(self, config: BatcherConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self._base = config  # what retune() starts from, so it never loses a preferred size
        self.cost = cost or CostModel()
        self.queued_rows = 0
        self.last_wait_ns = 0
        """How long the oldest row of the last formed batch waited in the queue."""
        self._tiers: dict[int, deque[_Piece]] = {}
        self._order: list[int] = []
        self._min_deadline: int | None = None
        self._deadline_stale = False
        self._delay_ns = int(config.max_queue_delay_ms * _MS)
        self._margin_ns = int(config.safety_margin_ms * _MS)
        self._any_timeout = config.timeout_ms is not None or bool(config.tier_timeout_ms)

    def retune(self, *, max_batch_size: int, max_queue_delay_ms: float, eager: bool) -> None:
        """Change the flush limits in place (adaptive batching); queued rows stay queued."""
        base = self._base
        self.config = replace(
            base,
            max_batch_size=max_batch_size,
            preferred_batch_sizes=tuple(s for s in base.preferred_batch_sizes if s <= max_batch_size),
            max_queue_delay_ms=max_queue_delay_ms,
            eager=eager,
        )
        self._delay_ns = int(max_queue_delay_ms * _MS)

    # -- input ------------------------------------------------------------------------------
    def push(self, batch: Batch, now_ns: int) -> None:
        """Queue ``batch``'s rows as enqueued at ``now_ns``, split by ``_tier`` when mixed."""
        if batch.num_rows == 0:
            return
        if TIER not in batch:
            self._append(self.config.default_tier, batch, now_ns)
            return
        tiers = batch.numpy(TIER)
        if (tiers == tiers[0]).all():
            self._append(int(tiers[0]), batch, now_ns)
            return
        for tier in np.unique(tiers)[::-1]:
            self._append(int(tier), batch.filter(tiers == tier), now_ns)

    def _append(self, tier: int, batch: Batch, now_ns: int) -> None:
        deadlines = batch.numpy(DEADLINE_NS).astype(np.int64, copy=False) if DEADLINE_NS in batch else None
        timeout_ms = self.config.timeout_for(tier)
        timeout_at = None if timeout_ms is None else now_ns + int(timeout_ms * _MS)
        piece = _Piece(batch, now_ns, deadlines, timeout_at)
        if tier not in self._tiers:
            self._tiers[tier] = deque()
            self._order = sorted(self._tiers, reverse=True)
        self._tiers[tier].append(piece)
        self.queued_rows += batch.num_rows
        if piece.min_deadline is not None:  # a lower bound stays one when rows leave
            md = self._min_deadline
            self._min_deadline = piece.min_deadline if md is None else min(md, piece.min_deadline)

    # -- policy -----------------------------------------------------------------------------
    def target_size(self, share: int = 1) -> int:
        """Rows the next batch takes: the largest preferred size that fits, else up to max;
        ``share``: the model instances free to take what is queued, which it is split among."""
        n = min(-(-self.queued_rows // max(share, 1)), self.config.max_batch_size)
        for size in reversed(self.config.preferred_batch_sizes):
            if size <= n:
                return size
        return n

    def ready(self, now_ns: int, idle: bool) -> bool:
        """Whether a flush rule holds at ``now_ns`` (``idle``: a model instance is free)."""
        cfg = self.config
        if self.queued_rows == 0:
            return False
        if (cfg.eager and idle) or self.queued_rows >= cfg.max_batch_size:
            return True
        if cfg.preferred_batch_sizes and self.queued_rows >= cfg.preferred_batch_sizes[0]:
            return True
        return now_ns >= min(self._oldest_ns() + self._delay_ns, self._budget_flush_ns(now_ns))

    def pop_ready(self, now_ns: int, idle: bool, share: int = 1) -> Batch | None:
        """The next model batch if a flush rule holds at ``now_ns``, else ``None``; ``share``
        as in ``target_size``."""
        return self.form_batch(now_ns, share) if self.ready(now_ns, idle) else None

    def next_wakeup_ns(self, now_ns: int) -> int | None:
        """When a time rule (delay, latency budget, timeout, deadline) next fires; None if empty."""
        if self.queued_rows == 0:
            return None
        oldest = self._oldest_ns()
        wake = min(oldest + self._delay_ns, self._budget_flush_ns(now_ns))
        first_timeout = self._first_timeout()
        if first_timeout is not None:
            wake = min(wake, first_timeout)
        md = self._deadline(now_ns + 1)
        return wake if md is None else min(wake, md)

    def _oldest_ns(self) -> int:
        return min(d[0].enqueue_ns for d in self._tiers.values() if d)

    def _first_timeout(self) -> int | None:
        """Earliest queue timeout: FIFO per tier with one timeout per tier, so a front piece's."""
        if not self._any_timeout:
            return None
        ends = [d[0].timeout_at for d in self._tiers.values() if d and d[0].timeout_at is not None]
        return min(ends) if ends else None

    def _budget_flush_ns(self, now_ns: int) -> int:
        """Latest time the most urgent row can be dispatched and still meet its deadline."""
        spare = self.cost.expected_ns(self.target_size()) + self._margin_ns
        urgent = self._deadline(now_ns + spare + 1)
        by_timeout = self._first_timeout()
        if by_timeout is not None:
            urgent = by_timeout if urgent is None else min(urgent, by_timeout)
        return 2**63 - 1 if urgent is None else urgent - spare

    def _deadline(self, exact_below: int) -> int | None:
        """A lower bound on the earliest ``_deadline_ns`` queued; exact when under ``exact_below``.

        Removing rows only marks the bound stale; the O(pieces) rescan runs when it could matter.
        """
        md = self._min_deadline
        if self._deadline_stale and md is not None and md < exact_below:
            mins = [p.min_deadline for d in self._tiers.values() for p in d if p.min_deadline is not None]
            self._min_deadline = min(mins) if mins else None
            self._deadline_stale = False
        return self._min_deadline

    # -- output -----------------------------------------------------------------------------
    def form_batch(self, now_ns: int, share: int = 1) -> Batch | None:
        """Take the next batch now, whatever the flush rules say (used to drain on close)."""
        need = self.target_size(share)
        if need == 0:
            return None
        taken: list[Batch] = []
        schema = None
        oldest = now_ns
        for tier in self._order:
            queue = self._tiers[tier]
            while queue and need:
                piece = queue[0]
                if schema is None:
                    schema = piece.batch.schema
                elif piece.batch.schema is not schema and not piece.batch.schema.equals(
                    schema, check_metadata=True
                ):
                    need = 0
                    break
                oldest = min(oldest, piece.enqueue_ns)
                rows = piece.batch.num_rows
                self._deadline_stale |= piece.min_deadline is not None
                if rows <= need:
                    queue.popleft()
                    taken.append(piece.batch)
                    need -= rows
                else:
                    taken.append(piece.batch.slice(0, need))
                    queue[0] = piece.rest(need)
                    need = 0
            if not need:
                break
        self.queued_rows -= sum(b.num_rows for b in taken)
        self.last_wait_ns = now_ns - oldest
        return Batch.concat(taken)

    def expire(self, now_ns: int) -> list[tuple[Batch, str]]:
        """Remove and return rows past ``timeout_ms`` since enqueue or past ``_deadline_ns``."""
        out: list[tuple[Batch, str]] = []
        if self.queued_rows == 0:
            return out
        md = self._deadline(now_ns + 1)
        scan_all = md is not None and md <= now_ns
        for tier, queue in self._tiers.items():
            if scan_all:
                kept = (self._expire_piece(p, now_ns, out) for p in queue)
                self._tiers[tier] = deque(p for p in kept if p is not None)
            elif self._any_timeout:  # FIFO: only the front pieces can have timed out
                while queue and self._expire_piece(queue[0], now_ns, out) is None:
                    queue.popleft()
        return out

    def _expire_piece(self, piece: _Piece, now_ns: int, out: list[tuple[Batch, str]]) -> _Piece | None:
        """Move ``piece``'s expired rows to ``out``; return what is left of it, if anything."""
        timed_out = piece.timeout_at is not None and piece.timeout_at <= now_ns
        if piece.min_deadline is not None and piece.min_deadline <= now_ns:
            assert piece.deadlines is not None
            self._deadline_stale = True
            late = (piece.deadlines != 0) & (piece.deadlines <= now_ns)
            whole = bool(late.all())
            out.append((piece.batch if whole else piece.batch.filter(late), "deadline exceeded"))
            self.queued_rows -= piece.batch.num_rows if whole else int(late.sum())
            if whole:
                return None
            piece = _Piece(
                piece.batch.filter(~late), piece.enqueue_ns, piece.deadlines[~late], piece.timeout_at
            )
        if not timed_out:
            return piece
        self._deadline_stale |= piece.min_deadline is not None
        waited_ms = (piece.timeout_at - piece.enqueue_ns) / _MS if piece.timeout_at is not None else 0.0
        out.append((piece.batch, f"timeout after {waited_ms:g} ms in batcher queue"))
        self.queued_rows -= piece.batch.num_rows
        return None

    # -- overload ---------------------------------------------------------------------------
    def shed(self, incoming: Batch, capacity_rows: int) -> tuple[Batch | None, list[Batch]]:
        """Make room for ``incoming`` within ``capacity_rows`` by dropping the lowest tiers.

        Incoming rows are admitted highest tier first; for each tier, queued rows of strictly
        lower tiers are dropped (lowest tier first, newest first) before any row of that tier is
        refused. Returns the admitted part of ``incoming`` (to ``push``) and the dropped batches.
        So a row is only ever shed while no row of a lower tier is queued or admitted.
        """
        tiers = incoming.meta(TIER, self.config.default_tier)
        free = capacity_rows - self.queued_rows
        dropped: list[Batch] = []
        keep = np.zeros(incoming.num_rows, dtype=bool)
        for tier in np.unique(tiers)[::-1].tolist():
            rows = np.flatnonzero(tiers == tier)
            if rows.size > free:
                free += self._evict_below(tier, rows.size - free, dropped)
            take = min(rows.size, max(free, 0))
            keep[rows[:take]] = True
            free -= take
            if take < rows.size:
                dropped.append(incoming.take(rows[take:]))
        if keep.all():
            return incoming, dropped
        return (incoming.filter(keep) if keep.any() else None), dropped

    def _evict_below(self, tier: int, want: int, dropped: list[Batch]) -> int:
        """Drop up to ``want`` queued rows of tiers below ``tier``, lowest first, newest first."""
        freed = 0
        for low in sorted(t for t in self._tiers if t < tier):
            queue = self._tiers[low]
            while queue and freed < want:
                piece = queue.pop()
                n = piece.batch.num_rows
                if n <= want - freed:
                    dropped.append(piece.batch)
                    freed += n
                else:
                    keep_rows = n - (want - freed)
                    dropped.append(piece.batch.slice(keep_rows))
                    queue.append(piece.head(keep_rows))
                    freed = want
                self._deadline_stale |= piece.min_deadline is not None
            if freed >= want:
                break
        self.queued_rows -= freed
        return freed


@dataclass(frozen=True, slots=True)
class BatcherStats:
    """Counters of a ``DynamicBatcher``: model calls made (``batches``), then rows by fate.

    Every submitted row is in exactly one of ``rows`` (emitted with results), ``timeouts``
    (expired in the queue), ``errors`` (its call failed), ``shed`` (dropped under overload for a
    higher tier) and ``queued_rows`` (still waiting).
    """

    batches: int = 0
    rows: int = 0
    timeouts: int = 0
    errors: int = 0
    shed: int = 0
    queued_rows: int = 0
    inline_batches: int = 0
    """Of ``batches``, the calls made in the thread that handed the rows over (``run_inline``,
    ``feed``), not on a dispatcher thread."""
    cpu_ns: int = field(default=0, compare=False)
    """CPU time of the threads that made the model calls, inside the calls (failed ones too):
    see ``DynamicBatcher._compute``. A measurement, not a count: left out of comparisons."""
