"""A pipeline as a network service: events in over HTTP or gRPC, one result per event back.

``PipelineService`` runs a pipeline with its source replaced by an ``Inbox`` (a bounded
admission queue fed by the transports) and its primary sink by the response path. Every chunk
of request lines is decoded with the pipeline's input schema into one batch whose events carry
their ingest time and, when the client gave one, a deadline that the batcher honours.

A ``ResultTracker`` (the executor's ``Lineage``) follows each event to its end, so a chunk knows
when each of its events is done and what came of it: the output row as the pipeline's sink would
write it (the same JSON line as ``--output FILE``), ``{"dropped": STEP}`` when a step filtered it
out, ``{"error": REASON, "step": STEP}`` when it was dead-lettered (a deadline that passed,
an operator error, a shed row), ``{"error": REASON, "line": N}`` when the line did not parse.
Events of a chunk are answered in request order, as a prefix of the chunk completes.
Fire-and-forget chunks are not tracked at all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import DEADLINE_NS, ID, TIER, Batch
from aisp.errors import ConfigError, Unavailable
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.ingest.decode import ColumnarDecoder, Decoded
from aisp.ingest.decoder_process import DecoderProcess
from aisp.observe.stats import AdmissionStats
from aisp.pipeline import Pipeline
from aisp.schedule.executor import ExecutorOptions, LocalExecutor
from aisp.sinks.base import RowEncoder
from aisp.sinks.deadletter import DeadLetterSink, DeadLetterWriter
from aisp.sinks.memory import NullSink
from aisp.transform.operators import Emit

if TYPE_CHECKING:
    from aisp.observe.trace_config import TraceConfig

__all__ = ["Chunk", "Inbox", "InboxClosed", "PipelineService", "ResultTracker"]

_encode = msgspec.json.Encoder().encode
log = logging.getLogger("aisp.serve")


class InboxClosed(Unavailable):
    """The service is shutting down and takes no more events (503 / UNAVAILABLE)."""


class Inbox:
    """A bounded queue of decoded batches between the transports and the pipeline's source.

    ``offer`` never blocks: it refuses a batch that does not fit (the caller answers 429 or waits
    for room, which is how a stream stops reading). A batch larger than the whole capacity is
    taken when the inbox is empty, so a big chunk cannot wait forever.
    """

    def __init__(self, capacity_rows: int) -> None:
        if capacity_rows <= 0:
            raise ConfigError(f"inbox capacity must be > 0 rows, got {capacity_rows}")
        self.capacity_rows = capacity_rows
        self._batches: deque[Batch] = deque()
        self._rows = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def rows(self) -> int:
        return self._rows

    def offer(self, batch: Batch) -> bool:
        with self._cond:
            if self._closed:
                raise InboxClosed("the pipeline is shutting down")
            if self._rows and self._rows + batch.num_rows > self.capacity_rows:
                return False
            self._batches.append(batch)
            self._rows += batch.num_rows
            self._cond.notify()
            return True

    def take(self, max_rows: int) -> Batch | None:
        """Up to ``max_rows`` rows (whole queued batches, coalesced); None once closed and empty."""
        with self._cond:
            while not self._batches:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._batches.popleft()
            if first.num_rows > max_rows:
                self._batches.appendleft(first.slice(max_rows))
                first = first.slice(0, max_rows)
            taken, rows = [first], first.num_rows
            while self._batches and rows + self._batches[0].num_rows <= max_rows:
                b = self._batches.popleft()
                taken.append(b)
                rows += b.num_rows
            self._rows -= rows
        return Batch.concat(taken) if len(taken) > 1 else taken[0]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class InboxSource(Source):
    """The pipeline's source while it is served: whatever the transports put in the inbox."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _InboxPartition(self.inbox)

    def describe(self) -> str:
        return "network"


class _InboxPartition(SourcePartition):
    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def next_batch(self, max_rows: int) -> Batch | None:
        return self.inbox.take(max_rows)


class Chunk:
    """The events of one piece of a request, in request order, and what became of each.

    ``prefix`` is the number of leading events that are done; ``results[:prefix]`` are their
    JSON lines. ``notify`` is called (from a pipeline thread) whenever ``prefix`` grows.
    """

    def __init__(self, start: int, n: int, notify: Callable[[], None] | None = None) -> None:
        self.start, self.n = start, n
        self.open = np.ones(n, dtype=np.int32)  # open branches per event; 0 = done
        self.results: npt.NDArray[np.object_] = np.empty(n, dtype=object)  # bytes, or None: not yet
        self.rank = np.zeros(n, dtype=np.int8)  # what results[i] is: see ResultTracker.RANKS
        self.prefix = 0
        self.notify = notify
        self.done = threading.Event()

    def lines(self, start: int, stop: int) -> bytes:
        """The result lines of events ``start:stop`` (done ones), newline-terminated."""
        done = self.results[start:stop].tolist()
        if not done:
            return b""
        if None in done:  # (an event done with no outcome recorded: not expected)
            done = [b"{}" if r is None else r for r in done]
        return b"\n".join(done) + b"\n"

    def _advance(self) -> bool:
        rest = np.flatnonzero(self.open[self.prefix :])
        prefix = self.prefix + int(rest[0]) if rest.size else self.n
        if prefix == self.prefix:
            return False
        self.prefix = prefix
        if prefix == self.n:
            self.done.set()
        return True


class ResultTracker:
    """Maps events back to their chunks and collects their results (see the module docstring).

    An event that took several branches gets the most telling of their outcomes: its output
    rows, else the error of a branch that failed, else a side sink that took it, else the step
    that dropped it.
    """

    DROPPED, SIDE_SINK, ERROR, OUTPUT = 1, 2, 3, 4

    def __init__(self, result_step: str, encoder: RowEncoder) -> None:
        self.result_step = result_step
        self._encoder = encoder
        self._lock = threading.Lock()
        self._chunks: dict[int, Chunk] = {}
        self._starts = np.empty(0, dtype=np.int64)
        self._order: list[Chunk] = []
        self._dirty = False

    @property
    def open_chunks(self) -> int:
        return len(self._chunks)

    def add(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunks[chunk.start] = chunk
            self._dirty = True
            if chunk._advance() and chunk.prefix == chunk.n:  # every line was invalid
                self._chunks.pop(chunk.start)

    def discard(self, chunk: Chunk) -> None:
        with self._lock:
            if self._chunks.pop(chunk.start, None) is not None:
                self._dirty = True

    # -- the executor's Lineage -------------------------------------------------------------
    def forwarded(self, step: str, batch: Batch, outs: Emit) -> None:
        ids = batch.ids
        if len(outs) == 1 and outs[0][1].num_rows == ids.shape[0]:
            out_ids = outs[0][1].ids
            if out_ids is ids or np.array_equal(out_ids, ids):
                return  # one row out per row in: nothing changes
        out_ids = np.concatenate([o.ids for _, o in outs]) if outs else np.empty(0, np.int64)
        uniq, counts = np.unique(out_ids, return_counts=True)
        pos = np.searchsorted(uniq, ids).clip(0, max(uniq.shape[0] - 1, 0))
        found = (uniq[pos] == ids) if uniq.shape[0] else np.zeros(ids.shape[0], dtype=bool)
        delta = np.where(found, counts[pos] if uniq.shape[0] else 0, 0) - 1
        changed = delta != 0
        if changed.any():
            self._update(ids[changed], delta[changed], fill=_encode({"dropped": step}), rank=self.DROPPED)

    def written(self, step: str, batch: Batch) -> None:
        if not batch.num_rows:
            return
        minus = np.full(batch.num_rows, -1, dtype=np.int32)
        if step == self.result_step:
            lines = np.empty(batch.num_rows, dtype=object)
            lines[:] = self._encoder.encode(batch).split(b"\n")[: batch.num_rows]
            self._update(batch.ids, minus, lines=lines)
        else:
            self._update(batch.ids, minus, fill=_encode({"sink": step}), rank=self.SIDE_SINK)

    def failed(self, step: str, batch: Batch, reason: str, *, closes: bool = True) -> None:
        if ID not in batch or not batch.num_rows:
            return
        delta = np.full(batch.num_rows, -1 if closes else 0, dtype=np.int32)
        fill = _encode({"error": reason, "step": step})
        self._update(batch.ids, delta, fill=fill, rank=self.ERROR, always_fill=not closes)

    # -- bookkeeping ------------------------------------------------------------------------
    def _locate(self, ids: npt.NDArray[np.int64]) -> list[tuple[Chunk, npt.NDArray[np.intp]]]:
        """(chunk, row positions in ``ids``) for every tracked chunk that ``ids`` touch."""
        if self._dirty:
            self._order = sorted(self._chunks.values(), key=lambda c: c.start)
            self._starts = np.asarray([c.start for c in self._order], dtype=np.int64)
            self._dirty = False
        if not self._order:
            return []
        pos = np.searchsorted(self._starts, ids, side="right") - 1
        out = []
        for p in np.unique(pos).tolist():
            if p < 0:
                continue
            chunk = self._order[p]
            rows = np.flatnonzero(pos == p)
            rows = rows[ids[rows] - chunk.start < chunk.n]
            if rows.size:
                out.append((chunk, rows))
        return out

    def _update(
        self,
        ids: npt.NDArray[np.int64],
        delta: npt.NDArray[Any],
        *,
        lines: npt.NDArray[np.object_] | None = None,
        fill: bytes | None = None,
        rank: int = 0,
        always_fill: bool = False,
    ) -> None:
        """Apply branch changes ``delta`` to events ``ids``: ``lines`` are their outputs;
        ``fill`` (of ``rank``) is the outcome of the branches that close (``delta`` < 0), or of
        every row given with ``always_fill``."""
        wake = []
        with self._lock:
            for chunk, rows in self._locate(ids):
                idx = ids[rows] - chunk.start
                res = chunk.results
                if lines is not None:
                    ranks = chunk.rank
                    if _distinct(idx, chunk.n) and not (ranks[idx] == self.OUTPUT).any():
                        res[idx] = lines[rows]  # each event's first and only output row here
                    else:  # several output rows for an event: joined, in order
                        for i, r in zip(idx.tolist(), rows.tolist(), strict=True):
                            res[i] = _join(res[i], lines[r]) if ranks[i] == self.OUTPUT else lines[r]
                            ranks[i] = self.OUTPUT
                    ranks[idx] = self.OUTPUT
                elif fill is not None:
                    closing = idx[((delta[rows] < 0) | always_fill) & (chunk.rank[idx] < rank)]
                    res[closing] = fill
                    chunk.rank[closing] = rank
                np.add.at(chunk.open, idx, delta[rows])
                closed = idx[chunk.open[idx] <= 0]
                if closed.size:
                    chunk.open[closed] = 0
                    if chunk._advance():
                        wake.append(chunk)
                        if chunk.prefix == chunk.n:
                            del self._chunks[chunk.start]
                            self._dirty = True
        for chunk in wake:
            if chunk.notify is not None:
                chunk.notify()


def _distinct(idx: npt.NDArray[np.int64], n: int) -> bool:
    """Whether the positions ``idx`` (each below ``n``) are all different."""
    seen = np.zeros(n, dtype=np.bool_)
    seen[idx] = True
    return int(np.count_nonzero(seen)) == idx.size


def _join(a: bytes, b: bytes) -> bytes:
    """Two outputs of one event (a fan-out) as one JSON array line."""
    if a.startswith(b"["):
        return a[:-1] + b"," + b + b"]"
    return b"[" + a + b"," + b + b"]"


class PipelineService:
    """A pipeline served over the network (see the module docstring).

    Args:
        pipeline: the pipeline; its single source is replaced by the network inbox (the pipeline
            must declare its input schema), its primary sink by the responses.
        capacity_rows: the admission queue: events accepted but not yet read by the pipeline.
        chunk_rows: the most lines decoded into one batch.
        dead_letter: where dead letters also go (a JSONL path), besides the responses.
        decode_process: decode request lines in a forked worker process (``DecoderProcess``),
            so that JSON parsing runs on another core; needs a process with no other thread
            yet, else decoding stays in-process (with a warning).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        capacity_rows: int = 65536,
        chunk_rows: int = 2048,
        batch_rows: int = 2048,
        dead_letter: str | None = None,
        decode_process: bool = False,
        trace: TraceConfig | None = None,
    ) -> None:
        self.trace = trace
        if pipeline.input_schema is None:
            raise ConfigError(
                f"pipeline {pipeline.name!r} declares no input schema; pass schema= to source()"
            )
        self.name = pipeline.name
        self.pipeline = pipeline
        self.chunk_rows = chunk_rows
        self.inbox = Inbox(capacity_rows)
        self._decoder = ColumnarDecoder(pipeline.input_schema)
        self._decoder_process: DecoderProcess | None = None
        self._decode_pool: ThreadPoolExecutor | None = None
        if decode_process and threading.active_count() > 1:
            log.warning("pipeline %r decodes in-process: other threads are running", pipeline.name)
        elif decode_process:
            self._decoder_process = DecoderProcess(pipeline.input_schema)
            self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix=f"aisp-decode-{pipeline.name}")
        pipeline.bind(source=InboxSource(self.inbox), sink=NullSink())
        graph = pipeline.build()
        primary = [n.step_id for n in graph.nodes if n.kind == "sink"]
        result_step = "out" if "out" in primary else primary[0]
        self.tracker = ResultTracker(result_step, RowEncoder(pipeline.output_columns))
        self.dead_letters: DeadLetterWriter = DeadLetterSink(path=dead_letter).open()
        self.executor = LocalExecutor(
            graph,
            dead_letter=self.dead_letters,
            options=ExecutorOptions(source_batch_rows=batch_rows, offload_sources=False, offload_sinks=False),
            lineage=self.tracker,
        )
        self._ids = 0
        self._ids_lock = threading.Lock()
        self.rejected_lines = 0
        self.admission = AdmissionStats()
        """Events accepted or refused (queue full, rate limited), for ``/metrics``."""

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.trace is not None:
            from aisp.observe.tracing import EventTracer

            self.executor.tracer = EventTracer(self.trace, self.name)
        self.executor.start()
        if self.executor.tracer is not None:  # after start: its thread must not keep workers from forking
            self.executor.tracer.start()

    def trace_parent(self, traceparent: str | None, tracestate: str | None = None) -> Any:
        """The client's trace context from W3C headers, when this pipeline traces (else None)."""
        if self.executor.tracer is None or not traceparent:
            return None
        from aisp.observe.tracing import extract_parent

        return extract_parent(traceparent, tracestate)

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Stop taking events, finish every accepted one, stop the pipeline."""
        self.inbox.close()
        done = self.executor.join(timeout_s)
        if self.executor.tracer is not None:
            self.executor.tracer.close()
        self.dead_letters.close()
        if self._decoder_process is not None and self._decode_pool is not None:
            self._decode_pool.shutdown()
            self._decoder_process.close()
        return done

    @property
    def stats(self) -> Any:
        return self.executor.stats

    # -- ingest -------------------------------------------------------------------------------
    def decode(self, lines: list[bytes]) -> Decoded:
        """Columns of ``lines`` (in the decoder process when there is one); blocking."""
        if self._decoder_process is not None:
            return self._decoder_process.decode(lines)
        return self._decoder.decode(lines)

    async def decode_async(self, lines: list[bytes]) -> Decoded | None:
        """``decode`` for asyncio callers: None when decoding is in-process (``prepare`` then
        does it); otherwise the decoder process's answer, awaited without blocking the loop."""
        if self._decode_pool is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._decode_pool, self.decode, lines)

    def prepare(
        self,
        lines: list[bytes],
        *,
        decoded: Decoded | None = None,
        deadline_ns: int | None = None,
        tier: int | None = None,
        track: bool = True,
        notify: Callable[[], None] | None = None,
        first_line: int = 1,
        trace_parent: Any = None,
    ) -> tuple[Batch | None, Chunk | None, list[dict[str, Any]]]:
        """Decode ``lines`` into a batch for the inbox: (batch or None, chunk or None, errors).

        Lines that do not parse (``errors``: ``{"line", "reason"}``, numbered from
        ``first_line``) are answered in place (tracked chunks) and dead-lettered.
        ``trace_parent`` (from ``trace_parent()``): the events are traced as its children.
        """
        n = len(lines)
        with self._ids_lock:
            start = self._ids
            self._ids += n
        if trace_parent is not None and self.executor.tracer is not None:
            self.executor.tracer.parent(start, n, trace_parent)
        now = time.monotonic_ns()
        if decoded is None:
            decoded = self.decode(lines)
        kept = np.arange(n, dtype=np.int64) if decoded.kept is None else decoded.kept
        chunk = Chunk(start, n, notify) if track else None
        errors = [{"line": first_line + e.index, "reason": e.reason} for e in decoded.errors]
        if errors:
            self.rejected_lines += len(errors)
            self.dead_letters.records({"step": "ingest", **e} for e in errors)
            if chunk is not None:
                for e, err in zip(decoded.errors, errors, strict=True):
                    chunk.results[e.index] = _encode({"error": err["reason"], "line": err["line"]})
                    chunk.open[e.index] = 0
        if not kept.size:
            return None, chunk, errors
        batch = Batch.from_columns(decoded.columns, ids=start + kept, ingest_ns=now)
        meta: dict[str, Any] = {}
        if deadline_ns is not None:
            meta[DEADLINE_NS] = np.full(batch.num_rows, deadline_ns, dtype=np.int64)
        if tier is not None:
            meta[TIER] = np.full(batch.num_rows, tier, dtype=np.int8)
        return (batch.with_columns(meta) if meta else batch), chunk, errors

    def offer(self, batch: Batch | None, chunk: Chunk | None) -> bool:
        """Admit a prepared batch (registering its chunk first); False when the inbox is full."""
        if chunk is not None:
            self.tracker.add(chunk)
        if batch is None:
            return True
        if self.inbox.offer(batch):
            self.admission.accepted += batch.num_rows
            return True
        if chunk is not None:
            self.tracker.discard(chunk)
        return False

    def refused(self, events: int, *, rate_limited: bool = False) -> None:
        """A transport turned ``events`` away (429 / RESOURCE_EXHAUSTED)."""
        if rate_limited:
            self.admission.rate_limited += events
        else:
            self.admission.queue_full += events
