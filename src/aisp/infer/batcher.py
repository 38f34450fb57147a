"""Dynamic batching: queue rows from many micro-batches, call the model on well-sized batches.

* ``BatchQueue``: the pure policy. ``push`` queues rows, ``pop_ready`` forms the next model batch
  when a flush rule holds, ``expire`` removes rows past their timeout or deadline. Every call
  takes ``now_ns``; nothing sleeps, so tests need no real time.
* ``DynamicBatcher``: the threads. One dispatcher per model instance calls the runtime outside
  the lock (the next batch forms meanwhile), results go to ``emit``, failures to ``dead_letter``.

A batch is flushed when (DESIGN.md section 3) an instance is idle and ``eager`` is set; the queue
reaches ``max_batch_size`` or a preferred size; the oldest row waited ``max_queue_delay_ms``; or
the most urgent row's deadline minus the expected compute time is within ``safety_margin_ms``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import DEADLINE_NS, TIER, Batch
from aisp.errors import ConfigError
from aisp.infer.runtime import CostModel, Runtime

__all__ = [
    "BatchQueue",
    "BatcherConfig",
    "BatcherStats",
    "DeadLetter",
    "DynamicBatcher",
    "Emit",
    "Finish",
    "OnBatch",
    "Prepare",
]

Prepare = Callable[[Batch], Mapping[str, npt.NDArray[Any]]]
Finish = Callable[[Batch, Mapping[str, npt.NDArray[Any]]], Batch]
Emit = Callable[[Batch], None]
DeadLetter = Callable[[Batch, str], None]
OnBatch = Callable[[int, int, int], None]
"""``on_batch(rows, queue_wait_ns, compute_ns)``: called after each successful model call."""

_MS = 1_000_000


def _int_at_least(name: str, value: object, low: int, low_text: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low_text or low}, got {value!r}")


def _ms_at_least(name: str, value: object, low: float, strict: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        raise ConfigError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class BatcherConfig:
    """How a batcher forms batches. Sizes are in rows, times in milliseconds.

    >>> BatcherConfig(max_batch_size=64, preferred_batch_sizes=(32, 16)).preferred_batch_sizes
    (16, 32)
    """

    max_batch_size: int = 512
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ms: float = 1.0
    timeout_ms: float | None = None
    safety_margin_ms: float = 1.0
    eager: bool = True
    capacity_rows: int = 8192
    instances: int = 1

    def __post_init__(self) -> None:
        _int_at_least("max_batch_size", self.max_batch_size, 1)
        top = f"max_batch_size ({self.max_batch_size})"
        for size in self.preferred_batch_sizes:
            _int_at_least("preferred_batch_sizes entries", size, 1)
            if size > self.max_batch_size:
                raise ConfigError(f"preferred_batch_sizes entries must be <= {top}, got {size}")
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(self.preferred_batch_sizes))))
        _ms_at_least("max_queue_delay_ms", self.max_queue_delay_ms, 0.0)
        if self.timeout_ms is not None:
            _ms_at_least("timeout_ms", self.timeout_ms, 0.0, strict=True)
        _ms_at_least("safety_margin_ms", self.safety_margin_ms, 0.0)
        if not isinstance(self.eager, bool):
            raise ConfigError(f"eager must be a bool, got {self.eager!r}")
        _int_at_least("capacity_rows", self.capacity_rows, self.max_batch_size, top)
        _int_at_least("instances", self.instances, 1)


class _Piece:
    """Queued rows from one pushed batch (or its tier): one enqueue time, optional deadlines."""

    __slots__ = ("batch", "deadlines", "enqueue_ns", "min_deadline")

    def __init__(self, batch: Batch, enqueue_ns: int, deadlines: npt.NDArray[np.int64] | None) -> None:
        self.batch = batch
        self.enqueue_ns = enqueue_ns
        self.deadlines = deadlines
        set_ = None if deadlines is None else deadlines[deadlines != 0]
        self.min_deadline = int(set_.min()) if set_ is not None and set_.size else None
        if self.min_deadline is None:
            self.deadlines = None  # no row has a deadline

    def rest(self, offset: int) -> _Piece:
        """The piece without its first ``offset`` rows."""
        deadlines = None if self.deadlines is None else self.deadlines[offset:]
        return _Piece(self.batch.slice(offset), self.enqueue_ns, deadlines)


class BatchQueue:
    """The batching policy over a clock the caller supplies; no threads, no sleeping.

    Rows are queued per tier (``_tier`` column, 0 when absent), higher tiers served first, FIFO
    within a tier. A formed batch never exceeds ``max_batch_size``; queued pieces are split with
    ``Batch.slice`` and joined with ``Batch.concat``. Pieces whose schema differs from the first
    piece taken wait for the next batch.

    >>> q = BatchQueue(BatcherConfig(max_batch_size=2))
    >>> q.push(Batch.from_columns({"x": [1, 2, 3]}), now_ns=0)
    >>> q.pop_ready(now_ns=0, idle=False).num_rows, q.queued_rows
    (2, 1)
    """

    def __init__(self, config: BatcherConfig, cost: CostModel | None = None) -> None:
        self.config = config
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
        self._timeout_ns = None if config.timeout_ms is None else int(config.timeout_ms * _MS)
        self._timeout_reason = f"timeout after {config.timeout_ms or 0:g} ms in batcher queue"

    # -- input ------------------------------------------------------------------------------
    def push(self, batch: Batch, now_ns: int) -> None:
        """Queue ``batch``'s rows as enqueued at ``now_ns``, split by ``_tier`` when mixed."""
        if batch.num_rows == 0:
            return
        if TIER not in batch:
            self._append(0, batch, now_ns)
            return
        tiers = batch.numpy(TIER)
        if (tiers == tiers[0]).all():
            self._append(int(tiers[0]), batch, now_ns)
            return
        for tier in np.unique(tiers)[::-1]:
            self._append(int(tier), batch.filter(tiers == tier), now_ns)

    def _append(self, tier: int, batch: Batch, now_ns: int) -> None:
        deadlines = batch.numpy(DEADLINE_NS).astype(np.int64, copy=False) if DEADLINE_NS in batch else None
        piece = _Piece(batch, now_ns, deadlines)
        if tier not in self._tiers:
            self._tiers[tier] = deque()
            self._order = sorted(self._tiers, reverse=True)
        self._tiers[tier].append(piece)
        self.queued_rows += batch.num_rows
        if piece.min_deadline is not None:  # a lower bound stays one when rows leave
            md = self._min_deadline
            self._min_deadline = piece.min_deadline if md is None else min(md, piece.min_deadline)

    # -- policy -----------------------------------------------------------------------------
    def target_size(self) -> int:
        """Rows the next batch takes: the largest preferred size that fits, else up to max."""
        n = min(self.queued_rows, self.config.max_batch_size)
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

    def pop_ready(self, now_ns: int, idle: bool) -> Batch | None:
        """The next model batch if a flush rule holds at ``now_ns``, else ``None``."""
        return self.form_batch(now_ns) if self.ready(now_ns, idle) else None

    def next_wakeup_ns(self, now_ns: int) -> int | None:
        """When a time rule (delay, latency budget, timeout, deadline) next fires; None if empty."""
        if self.queued_rows == 0:
            return None
        oldest = self._oldest_ns()
        wake = min(oldest + self._delay_ns, self._budget_flush_ns(now_ns))
        if self._timeout_ns is not None:
            wake = min(wake, oldest + self._timeout_ns)
        md = self._deadline(now_ns + 1)
        return wake if md is None else min(wake, md)

    def _oldest_ns(self) -> int:
        return min(d[0].enqueue_ns for d in self._tiers.values() if d)

    def _budget_flush_ns(self, now_ns: int) -> int:
        """Latest time the most urgent row can be dispatched and still meet its deadline."""
        spare = self.cost.expected_ns(self.target_size()) + self._margin_ns
        urgent = self._deadline(now_ns + spare + 1)
        if self._timeout_ns is not None:
            by_timeout = self._oldest_ns() + self._timeout_ns
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
    def form_batch(self, now_ns: int) -> Batch | None:
        """Take the next batch now, whatever the flush rules say (used to drain on close)."""
        need = self.target_size()
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
                elif piece.batch.schema is not schema and not piece.batch.schema.equals(schema):
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
            elif self._timeout_ns is not None:  # FIFO: only the front pieces can have timed out
                while queue and self._expire_piece(queue[0], now_ns, out) is None:
                    queue.popleft()
        return out

    def _expire_piece(self, piece: _Piece, now_ns: int, out: list[tuple[Batch, str]]) -> _Piece | None:
        """Move ``piece``'s expired rows to ``out``; return what is left of it, if anything."""
        timed_out = self._timeout_ns is not None and piece.enqueue_ns + self._timeout_ns <= now_ns
        if piece.min_deadline is not None and piece.min_deadline <= now_ns:
            assert piece.deadlines is not None
            self._deadline_stale = True
            late = (piece.deadlines != 0) & (piece.deadlines <= now_ns)
            whole = bool(late.all())
            out.append((piece.batch if whole else piece.batch.filter(late), "deadline exceeded"))
            self.queued_rows -= piece.batch.num_rows if whole else int(late.sum())
            if whole:
                return None
            piece = _Piece(piece.batch.filter(~late), piece.enqueue_ns, piece.deadlines[~late])
        if not timed_out:
            return piece
        self._deadline_stale |= piece.min_deadline is not None
        out.append((piece.batch, self._timeout_reason))
        self.queued_rows -= piece.batch.num_rows
        return None


@dataclass(frozen=True, slots=True)
class BatcherStats:
    """Counters of a ``DynamicBatcher``: model calls made (``batches``), then rows by fate.

    Every submitted row is in exactly one of ``rows`` (emitted with results), ``timeouts``
    (expired in the queue), ``errors`` (its call failed) and ``queued_rows`` (still waiting).
    """

    batches: int = 0
    rows: int = 0
    timeouts: int = 0
    errors: int = 0
    queued_rows: int = 0


class DynamicBatcher:
    """Batch rows for one model: a bounded queue and one dispatcher thread per instance.

    Args:
        runtime: the model.
        config: batching policy, queue capacity and instance count.
        prepare: builds the model inputs from a formed batch.
        finish: attaches the model outputs to the batch.
        emit: receives each result batch (called from a dispatcher thread).
        dead_letter: receives rows that timed out or whose call failed, with the reason.
        clock: monotonic nanoseconds, the same clock as ``_deadline_ns``; injectable for tests.
        on_batch: optional ``on_batch(rows, queue_wait_ns, compute_ns)`` metrics hook.

    ``submit`` blocks while the queue holds ``capacity_rows`` (backpressure). ``close`` stops
    intake, dispatches what is queued and joins the threads, so no row is lost. An exception
    raised by ``emit``, ``dead_letter`` or ``on_batch`` does not stop the dispatchers; the first
    one is raised again by ``close``.
    """

    def __init__(
        self,
        runtime: Runtime,
        config: BatcherConfig,
        *,
        prepare: Prepare,
        finish: Finish,
        emit: Emit,
        dead_letter: DeadLetter,
        clock: Callable[[], int] = time.monotonic_ns,
        on_batch: OnBatch | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self._prepare, self._finish, self._emit, self._dead = prepare, finish, emit, dead_letter
        self._clock = clock
        self._on_batch = on_batch
        self._queue = BatchQueue(config)
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._started = self._closing = False
        self._count: Counter[str] = Counter()
        self._failure: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Warm the runtime up at the max and preferred sizes, then start the dispatchers."""
        if self._started:
            raise RuntimeError("batcher already started")
        self._started = True
        cfg = self.config
        self.runtime.warmup(sorted({cfg.max_batch_size, *cfg.preferred_batch_sizes}))
        for i in range(cfg.instances):
            name = f"aisp-batcher-{self.runtime.name}-{i}"
            thread = threading.Thread(target=self._dispatch_loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop intake, dispatch every queued row, join the dispatchers (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
        if self._threads:
            for thread in self._threads:
                thread.join()
        else:
            self._dispatch_loop()
        if self._failure is not None:
            raise self._failure

    def __enter__(self) -> DynamicBatcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- intake -----------------------------------------------------------------------------
    def submit(self, batch: Batch, *, timeout_ms: float | None = None) -> None:
        """Queue ``batch``; block while the queue is full (admitted whole when it fits or is empty).

        Raises:
            TimeoutError: ``timeout_ms`` passed while the queue stayed full.
            RuntimeError: the batcher is closed.
        """
        rows = batch.num_rows
        if rows == 0:
            return
        limit = None if timeout_ms is None else time.monotonic_ns() + int(timeout_ms * _MS)
        with self._lock:
            while True:
                if self._closing:
                    raise RuntimeError(f"batcher for model {self.runtime.name!r} is closed")
                queued = self._queue.queued_rows
                if queued == 0 or queued + rows <= self.config.capacity_rows:
                    break
                wait_s = None if limit is None else (limit - time.monotonic_ns()) / 1e9
                if wait_s is not None and wait_s <= 0:
                    raise TimeoutError(
                        f"batcher queue full ({queued} of {self.config.capacity_rows} rows)"
                        f" for {timeout_ms:g} ms"
                    )
                self._not_full.wait(wait_s)
            self._queue.push(batch, self._clock())
            self._not_empty.notify()

    @property
    def queued_rows(self) -> int:
        return self._queue.queued_rows

    @property
    def stats(self) -> BatcherStats:
        """A snapshot of the counters."""
        with self._lock:
            return BatcherStats(**self._count, queued_rows=self._queue.queued_rows)

    # -- dispatch ---------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while True:
            with self._lock:
                work = self._next_work()
            if work is None:
                return
            expired, batch, wait_ns = work
            for rows, reason in expired:
                self._guard(self._dead, rows, reason)
            if batch is not None:
                self._call(batch, wait_ns)

    def _next_work(self) -> tuple[list[tuple[Batch, str]], Batch | None, int] | None:
        """Under the lock: wait until rows expire or a batch is ready; None once closed and empty."""
        queue = self._queue
        while True:
            now = self._clock()
            expired = queue.expire(now)
            batch = queue.form_batch(now) if self._closing else queue.pop_ready(now, idle=True)
            if expired or batch is not None:
                self._count["timeouts"] += sum(b.num_rows for b, _ in expired)
                self._not_full.notify_all()
                if queue.queued_rows:
                    self._not_empty.notify()
                return expired, batch, queue.last_wait_ns
            if self._closing:
                return None
            wake = queue.next_wakeup_ns(now)
            self._not_empty.wait(None if wake is None else max(wake - now, 10_000) / 1e9)

    def _call(self, batch: Batch, wait_ns: int) -> None:
        rows = batch.num_rows
        try:
            inputs = self._prepare(batch)
            start = time.perf_counter_ns()
            outputs = self.runtime.run(inputs)
            compute_ns = time.perf_counter_ns() - start
            result = self._finish(batch, outputs)
        except Exception as exc:  # noqa: BLE001 - a failed call dead-letters its rows, never the thread
            with self._lock:
                self._count.update(batches=1, errors=rows)
            self._guard(self._dead, batch, f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._queue.cost.observe(rows, compute_ns)
            self._count.update(batches=1, rows=rows)
        if self._on_batch is not None:
            self._guard(self._on_batch, rows, wait_ns, compute_ns)
        self._guard(self._emit, result)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Call a user callback; keep the first exception for ``close`` instead of dying."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the dispatcher must outlive a faulty callback
            with self._lock:
                self._failure = self._failure or exc
