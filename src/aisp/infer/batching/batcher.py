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

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy.typing as npt

from aisp.batch import DEADLINE_NS, Batch
from aisp.errors import Overloaded, Unavailable
from aisp.infer.batching.adaptive import AdaptiveTuner, Setting
from aisp.infer.batching.config import _MS, BatcherConfig
from aisp.infer.batching.in_order import InOrder
from aisp.infer.batching.queue import BatcherStats, BatchQueue
from aisp.infer.runtimes.base import CostModel, Runtime, resolve

__all__ = [
    "BatchQueue",
    "BatcherClosed",
    "BatcherConfig",
    "BatcherStats",
    "DeadLetter",
    "DynamicBatcher",
    "Emit",
    "Finish",
    "OnBatch",
    "Prepare",
    "QueueFull",
]

Prepare = Callable[[Batch], Mapping[str, npt.NDArray[Any]]]
Finish = Callable[[Batch, Mapping[str, npt.NDArray[Any]], Runtime], Batch]
"""``finish(batch, outputs, runtime)``: ``runtime`` is the version that computed ``outputs``."""
Emit = Callable[[Batch], None]
DeadLetter = Callable[[Batch, str], None]
OnBatch = Callable[[int, int, int, int], None]
"""``on_batch(rows, queue_wait_ns, compute_ns, work_ns)``: called after each successful model
call; ``work_ns`` is the thread's whole time on it (the batch formed, inputs prepared, the
model, outputs attached: from when a dispatcher stopped waiting for work, or an inline call
began, until the result goes to ``emit``), ``compute_ns`` the model's part of it."""


class QueueFull(Overloaded):
    """``submit`` waited its ``timeout_ms`` while the batcher's queue stayed full."""


class BatcherClosed(Unavailable):
    """``submit`` on a batcher that is closing: its model was unloaded or the server is stopping."""


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
        on_batch: optional ``on_batch(rows, queue_wait_ns, compute_ns, work_ns)`` metrics hook.

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
        self._in_flight = 0  # model calls running now
        self._after = CostModel()  # what ``emit`` (the steps after the model) takes per call
        self._inline_cost = CostModel()  # calls made in the callers' threads (claim_inline)
        self._probe_ns = 0  # when a call too slow for inline last time may be tried there again
        self._caller = threading.local()  # per thread: ns not spent on its own work (not_work_ns)
        self._failure: BaseException | None = None
        # results in the order batches were formed (``ordered``, several instances), else as calls end
        self._in_order = InOrder(self._emit_one) if config.ordered and config.instances > 1 else None
        self._tuner: AdaptiveTuner | None = None
        if config.adaptive is not None:
            self._tuner = AdaptiveTuner(config.adaptive, max_batch_size=config.max_batch_size, now_ns=clock())
            self._apply(self._tuner.current)

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
            QueueFull: ``timeout_ms`` passed while the queue stayed full.
            BatcherClosed: the batcher is closed.
        """
        rows = batch.num_rows
        if rows == 0:
            return
        shed: list[Batch] = []
        admitted: Batch | None = batch
        limit = None if timeout_ms is None else time.monotonic_ns() + int(timeout_ms * _MS)
        with self._lock:
            while True:
                if self._closing:
                    raise BatcherClosed(f"batcher for model {self.runtime.name!r} is closed")
                queued = self._queue.queued_rows
                if queued == 0 or queued + rows <= self.config.capacity_rows:
                    break
                if self.config.overload == "shed":
                    admitted, shed = self._queue.shed(batch, self.config.capacity_rows)
                    self._count["shed"] += sum(b.num_rows for b in shed)
                    self._not_full.notify_all()
                    break
                wait_s = None if limit is None else (limit - time.monotonic_ns()) / 1e9
                if wait_s is not None and wait_s <= 0:
                    raise QueueFull(
                        f"batcher queue full ({queued} of {self.config.capacity_rows} rows)"
                        f" for {timeout_ms:g} ms"
                    )
                waited = time.perf_counter_ns()
                self._not_full.wait(wait_s)
                self._not_work(time.perf_counter_ns() - waited)
            if admitted is not None:
                self._queue.push(admitted, self._clock())
                if self._tuner is not None:
                    self._tuner.arrived(admitted.num_rows)
                self._not_empty.notify()
        for rows_shed in shed:
            self._guard(self._dead, rows_shed, "shed")

    def run_inline(self, batch: Batch, *, max_cost_ns: int) -> bool:
        """Run ``batch`` now, in the caller's thread, if the model is idle (nothing queued, no
        call in flight) and a call on its rows is expected to take at most ``max_cost_ns``.

        For callers whose hand-off to a dispatcher thread costs more than such a call (an event
        loop serving a small model). Returns False, having done nothing, otherwise; the results
        go to ``emit`` (or ``dead_letter``) before it returns True.
        """
        if not self.claim_inline(batch.num_rows, max_cost_ns=max_cost_ns):
            return False
        self._run_claimed(batch, 0, inline=True)
        return True

    def claim_inline(self, rows: int, *, max_cost_ns: int) -> bool:
        """Take the model for a call on ``rows`` rows in the caller's thread, if it is idle
        (nothing queued, no call in flight) and such a call is expected to take at most
        ``max_cost_ns``; the caller then makes it with ``run_arrays``. False: nothing taken."""
        with self._lock:
            if (
                self._closing
                or self._in_order is not None  # a call in the caller's thread has no place in the order
                or self._in_flight
                or self._queue.queued_rows
                or rows > self._queue.config.max_batch_size
                or not self._cheap_inline(rows, max_cost_ns)
            ):
                return False
            self._in_flight += 1
            self._count["inline_batches"] += 1
            if self._tuner is not None:  # offered load, as if submitted
                self._tuner.arrived(rows)
        return True

    def release_claim(self) -> None:
        """Give back what ``claim_inline`` took, without a call."""
        with self._lock:
            self._in_flight -= 1

    def _cheap_inline(self, rows: int, max_cost_ns: int) -> bool:
        """(Under the lock) Whether a call on ``rows`` is expected to take at most ``max_cost_ns``
        in the caller's thread, as the calls made there (``_inline_cost``) say. The dispatchers'
        figures are only a bound: a dispatcher's call is timed by the wall clock, which includes
        waiting for the GIL while the caller (an event loop, say) holds it, up to the switch
        interval per call. Within that bound, a call is tried inline when none has been, and
        once a second when the last ones were too slow (their cost may have been a start-up's
        or a busy moment's). Nothing known at all: not inline (a first call may take anything)."""
        if max_cost_ns <= 0:
            return False
        expected = self._inline_cost.expected_ns(rows)
        if 0 < expected <= max_cost_ns:
            return True
        bound = self._queue.cost.expected_ns(rows)
        if not 0 < bound <= max_cost_ns + sys.getswitchinterval() * 1e9:
            return False
        now = self._clock()
        if expected > 0 and now < self._probe_ns:
            return False
        self._probe_ns = now + 1_000_000_000
        return True

    def run_arrays(
        self, inputs: Mapping[str, npt.NDArray[Any]], rows: int
    ) -> tuple[Mapping[str, npt.NDArray[Any]], Runtime, int]:
        """The call that ``claim_inline`` took the model for, on inputs the caller prepared
        (no batch, ``prepare`` or ``finish``): (outputs, the version that computed them, the
        model's nanoseconds). Counted, learnt from and tuned on like any call; the caller
        reports it (no ``on_batch``). A failing model raises, its rows counted as errors."""
        try:
            outputs, runtime, compute_ns = self._compute(inputs)
        except Exception:
            with self._lock:
                self._in_flight -= 1
                self._count.update(batches=1, errors=rows)
            raise
        with self._lock:
            self._in_flight -= 1
            self._called(rows, 0, compute_ns, inline=True)
        return outputs, runtime, compute_ns

    def feed(self, batch: Batch, *, max_cost_ns: int = 5_000_000) -> None:
        """``submit``, except that what the queue would dispatch at once runs in the caller's
        thread, when each call, with what ``emit`` does after it, is expected to take at most
        ``max_cost_ns`` (a slow step after the model, a sink waiting on a remote store, keeps
        the dispatcher thread, so the caller goes on reading meanwhile).

        With the model idle and nothing queued, the queue would at once form every whole model
        batch (``max_batch_size`` rows) of ``batch``, and the rest too when batching is eager
        (an idle model takes what is queued) and no preferred size would split it. Handing
        those to the dispatcher thread gains nothing and costs two thread switches under the
        GIL per call; they run here, in order, and whatever is left is submitted. Rows with
        deadlines always go through the queue, which drops the expired ones.
        """
        cfg = self._queue.config
        size, rows = cfg.max_batch_size, batch.num_rows
        if DEADLINE_NS not in batch:
            start = 0
            while start < rows:
                take = min(size, rows - start)
                if take < size and not (
                    cfg.eager and (not cfg.preferred_batch_sizes or take in cfg.preferred_batch_sizes)
                ):
                    break
                part = batch if take == rows else batch.slice(start, take)
                budget = max_cost_ns - self._after.expected_ns(take)
                if budget <= 0 or not self.run_inline(part, max_cost_ns=budget):
                    break
                start += take
            if start:
                batch = batch.slice(start)
        self.submit(batch)

    def _apply(self, setting: Setting) -> None:
        self._queue.retune(
            max_batch_size=setting.max_batch_size,
            max_queue_delay_ms=setting.max_queue_delay_ms,
            eager=setting.eager,
        )

    def batching(self) -> dict[str, object]:
        """The batching setting in use (and, when adaptive, the tuner's state and Pareto front)."""
        with self._lock:
            if self._tuner is not None:
                return {"adaptive": True, **self._tuner.describe()}
            cfg = self._queue.config
            return {
                "adaptive": False,
                "max_batch_size": cfg.max_batch_size,
                "max_queue_delay_ms": cfg.max_queue_delay_ms,
            }

    def settings(self) -> dict[str, float]:
        """The numbers of the setting in use: max_batch_rows, max_queue_delay_seconds (as tuned,
        when adaptive), instances, capacity_rows."""
        with self._lock:
            cfg = self._queue.config
            return {
                "max_batch_rows": cfg.max_batch_size,
                "max_queue_delay_seconds": cfg.max_queue_delay_ms / 1000,
                "instances": self.config.instances,
                "capacity_rows": self.config.capacity_rows,
            }

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
            began = time.perf_counter_ns()
            with self._lock:
                work = self._next_work()
            if work is None:
                return
            expired, batch, wait_ns, idle_ns, seq = work
            for rows, reason in expired:
                self._guard(self._dead, rows, reason)
            if batch is not None:  # the call's work began when this thread stopped idling
                self._run_claimed(batch, wait_ns, began + idle_ns, seq=seq)

    def _next_work(self) -> tuple[list[tuple[Batch, str]], Batch | None, int, int, int | None] | None:
        """Under the lock: wait until rows expire or a batch is ready; None once closed and
        empty. Also returns the nanoseconds this thread spent waiting for work, and the batch's
        number when results leave in order."""
        queue = self._queue
        idle_ns = 0
        while True:
            now = self._clock()
            expired = queue.expire(now)
            free = self.config.instances - self._in_flight  # this one among them: a burst is split
            batch = queue.form_batch(now, free) if self._closing else queue.pop_ready(now, True, free)
            if expired or batch is not None:
                self._count["timeouts"] += sum(b.num_rows for b, _ in expired)
                self._in_flight += batch is not None
                self._not_full.notify_all()
                if queue.queued_rows:
                    self._not_empty.notify()
                seq = self._in_order.number() if batch is not None and self._in_order else None
                return expired, batch, queue.last_wait_ns, idle_ns, seq
            if self._closing:
                return None
            wake = queue.next_wakeup_ns(now)
            waited = time.perf_counter_ns()
            self._not_empty.wait(None if wake is None else max(wake - now, 10_000) / 1e9)
            idle_ns += time.perf_counter_ns() - waited

    def _run_claimed(
        self,
        batch: Batch,
        wait_ns: int,
        began: int | None = None,
        *,
        inline: bool = False,
        seq: int | None = None,
    ) -> None:
        """Call the model on ``batch`` (its ``_in_flight`` slot taken), then give the slot back.
        ``began``: when the call's work began (``perf_counter_ns``), if before this call;
        ``seq``: its number when results leave in order."""
        try:
            self._call(batch, wait_ns, began, inline, seq)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _call(self, batch: Batch, wait_ns: int, began: int | None, inline: bool, seq: int | None) -> None:
        rows = batch.num_rows
        began = time.perf_counter_ns() if began is None else began
        try:
            outputs, runtime, compute_ns = self._compute(self._prepare(batch))
            result = self._finish(batch, outputs, runtime)
        except Exception as exc:  # noqa: BLE001 - a failed call dead-letters its rows, never the thread
            with self._lock:
                self._count.update(batches=1, errors=rows)
            self._guard(self._dead, batch, f"{type(exc).__name__}: {exc}")
            self._hand_on(seq, None)
            return
        with self._lock:
            self._called(rows, wait_ns, compute_ns, inline=inline)
        started = time.perf_counter_ns()
        if self._on_batch is not None:
            self._guard(self._on_batch, rows, wait_ns, compute_ns, started - began)
            self._not_work(started - began)  # counted once, by on_batch
        self._hand_on(seq, result)

    def _hand_on(self, seq: int | None, result: Batch | None) -> None:
        """A call's result (None: it failed) to ``emit``: in the order batches were formed when
        results leave in order, else at once."""
        if self._in_order is not None and seq is not None:
            self._in_order.done(seq, result)
        elif result is not None:
            self._emit_one(result)

    def _emit_one(self, result: Batch) -> None:
        started = time.perf_counter_ns()
        self._guard(self._emit, result)
        self._after.observe(result.num_rows, time.perf_counter_ns() - started)

    def _compute(
        self, inputs: Mapping[str, npt.NDArray[Any]]
    ) -> tuple[Mapping[str, npt.NDArray[Any]], Runtime, int]:
        """One model call: (outputs, the version that computed them, its nanoseconds). The
        calling thread's CPU time in it is counted too (``cpu_ns``): the model's own work where
        it computes on that thread (ONNX Runtime with one intra-op thread, AISP's default), with
        no wait for the GIL or a core in it, so steps can be compared on a busy machine."""
        start, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            runtime = resolve(self.runtime)  # one version per batch, even across a hot swap
            outputs = runtime.run(inputs)
            return outputs, runtime, time.perf_counter_ns() - start
        finally:
            cpu = time.thread_time_ns() - cpu
            with self._lock:
                self._count["cpu_ns"] += cpu

    def _called(self, rows: int, wait_ns: int, compute_ns: int, *, inline: bool) -> None:
        """(Under the lock) A call that succeeded: learn its cost, count it, tune on it."""
        self._queue.cost.observe(rows, compute_ns)
        if inline:
            self._inline_cost.observe(rows, compute_ns)
        count = self._count
        count["batches"] += 1
        count["rows"] += rows
        if self._tuner is not None:
            setting = self._tuner.observe(self._clock(), rows, wait_ns + compute_ns)
            if setting is not None:
                self._apply(setting)

    def not_work_ns(self) -> int:
        """Nanoseconds the calling thread has spent inside this batcher on what is not the
        caller's own work: waiting for room in a full queue (backpressure) and model calls whose
        ``work_ns`` ``on_batch`` already reported. A step's busy time is the time it spent in ``feed`` less
        the growth of this figure."""
        return getattr(self._caller, "ns", 0)

    def _not_work(self, ns: int) -> None:
        self._caller.ns = getattr(self._caller, "ns", 0) + ns

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Call a user callback; keep the first exception for ``close`` instead of dying."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the dispatcher must outlive a faulty callback
            with self._lock:
                self._failure = self._failure or exc
