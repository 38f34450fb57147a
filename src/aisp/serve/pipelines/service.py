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

from aisp.admission.anomaly import AnomalyControl, AnomalyPolicy
from aisp.batch import DEADLINE_NS, TIER, Batch
from aisp.connectors import dead_letter_sink
from aisp.errors import ConfigError, Forbidden, Unavailable
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.ingest.decode import ColumnarDecoder, Decoded, RawMessage
from aisp.ingest.decoder_process import DecoderProcess
from aisp.observe.stats import AdmissionStats
from aisp.pipeline import Pipeline
from aisp.schedule.executor import ExecutorOptions, LocalExecutor
from aisp.serve.pipelines.results import Chunk, ResultTracker
from aisp.serve.pipelines.topology import allowed_file, load_guarded, short_gil_slices, switch
from aisp.sinks.base import RowEncoder
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.sinks.memory import NullSink

if TYPE_CHECKING:
    from aisp.observe.tracing.config import TraceConfig

__all__ = ["Chunk", "Inbox", "InboxClosed", "PipelineService", "ResultTracker"]

_encode = msgspec.json.Encoder().encode
log = logging.getLogger("aisp.serve")


class _Live:
    """The service's running executor, looked up at each use (it changes at topology updates)."""

    def __init__(self, service: PipelineService) -> None:
        self._service = service

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service.executor, name)

    @property
    def graph_version(self) -> int:
        return self._service.graph_version

    @property
    def graph_updates(self) -> list[dict[str, Any]]:
        return self._service.updates


class InboxClosed(Unavailable):
    """The service is shutting down and takes no more events (503 / UNAVAILABLE)."""


IDLE_READ_S = 0.05
"""How long the served pipeline's source waits for requests before it reads nothing (so that a
barrier, a topology update's or a checkpoint's, finds it between batches)."""

_NOTHING = Batch.from_columns({})


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

    def take(self, max_rows: int, timeout_s: float | None = None) -> Batch | None:
        """Up to ``max_rows`` rows (whole queued batches, coalesced); None once closed and empty;
        no rows when nothing came within ``timeout_s``."""
        with self._cond:
            while not self._batches:
                if self._closed:
                    return None
                if not self._cond.wait(timeout_s):
                    return _NOTHING
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
        # an idle pipeline still comes back between batches, where a barrier pauses it
        return self.inbox.take(max_rows, IDLE_READ_S)


class PipelineService:
    """A pipeline served over the network (see the module docstring).

    Args:
        pipeline: the pipeline; its single source is replaced by the network inbox (the pipeline
            must declare its input schema), its primary sink by the responses.
        capacity_rows: the admission queue: events accepted but not yet read by the pipeline.
        chunk_rows: the most lines decoded into one batch.
        dead_letter: where dead letters also go besides the responses: a JSONL path, or a broker
            stream (``redis://``, ``nats://``; see ``aisp.connectors.dead_letter_sink``).
        decode_process: decode request lines in a forked worker process (``DecoderProcess``),
            so that JSON parsing runs on another core; needs a process with no other thread
            yet, else decoding stays in-process (with a warning).
        anomaly: sliding-window anomaly control of the admitted rate (default: the pipeline's
            ``anomaly_control``).
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
        anomaly: AnomalyPolicy | None = None,
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
        self.raw = pipeline.input_schema is RawMessage
        """Each request body or WebSocket message is one event's bytes (``RawMessage``)."""
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
        policy = anomaly or pipeline.anomaly
        self.control = AnomalyControl(policy) if policy is not None else None
        """Sliding-window anomaly control of the admitted rate (``schedule.anomaly``), if any."""
        if self.control is not None:
            self.tracker.observe = self.control.observe
        self.dead_letters: DeadLetterWriter = dead_letter_sink(dead_letter).open()
        self._batch_rows = batch_rows
        self.executor = self.new_executor(graph)
        self.view: Any = _Live(self)
        """The running executor, whichever it is after topology updates (metrics, dashboard)."""
        self.graph_version = 1
        self.updates: list[dict[str, Any]] = []
        """Topology updates, applied or failed, with their reports (``aisp.serve.pipelines.topology``)."""
        self.reload: Callable[[str | None], Pipeline] | None = None
        """Loads the pipeline file served again, or another file (set by ``aisp serve``)."""
        self.pipeline_dirs: tuple[str, ...] = ()
        """The directories another pipeline file may be loaded from (``allowed_file``): the
        served file's own and those given with ``--pipeline-dir`` (set by ``aisp serve``)."""
        self._switching = threading.Lock()
        self._ids = 0
        self._ids_lock = threading.Lock()
        self.rejected_lines = 0
        self.admission = AdmissionStats()
        """Events accepted or refused (queue full, rate limited), for ``/metrics``."""

    def bound(self, pipeline: Pipeline) -> Any:
        """``pipeline``'s graph reading the inbox, its primary sink the responses; checked."""
        pipeline.bind(source=InboxSource(self.inbox), sink=NullSink())
        return pipeline.build()

    def new_executor(self, graph: Any) -> LocalExecutor:
        """An executor of ``graph`` reading the inbox and answering through the tracker."""
        return LocalExecutor(
            graph,
            dead_letter=self.dead_letters,
            options=ExecutorOptions(
                source_batch_rows=self._batch_rows, offload_sources=False, offload_sinks=False
            ),
            lineage=self.tracker,
        )

    def update(self, pipeline: Pipeline | None = None, *, path: str | None = None) -> dict[str, Any]:
        """Replace the running graph by ``pipeline``'s (default: the pipeline file at ``path``,
        else the served file, reloaded) at a barrier, carrying the state of the steps it keeps
        (``aisp.serve.pipelines.topology.switch``); the update's report. A failed update leaves the
        running graph as it was, reports why and raises. A ``path`` outside ``pipeline_dirs``
        is ``Forbidden`` and loads nothing."""
        if path is not None and pipeline is None:
            try:
                path = str(allowed_file(path, self.pipeline_dirs))
            except Forbidden as exc:
                log.warning("pipeline %r: topology update refused: %s", self.name, exc)
                raise
        with self._switching, short_gil_slices():
            try:
                t0 = time.monotonic()
                new = pipeline if pipeline is not None else self._reloaded(path)
                loaded = time.monotonic() - t0
                report = {"load_ms": round(loaded * 1000, 3), **switch(self, new)}
            except Exception as exc:
                self.updates.append({"version": self.graph_version, "failed": f"{type(exc).__name__}: {exc}"})
                log.warning(
                    "pipeline %r: topology update failed, the running graph stays: %s", self.name, exc
                )
                raise
            self.graph_version += 1
            report = {"version": self.graph_version, **report}
            self.updates.append(report)
            log.info("pipeline %r: graph version %d running: %s", self.name, self.graph_version, report)
            return report

    def _reloaded(self, path: str | None) -> Pipeline:
        if self.reload is None:
            raise ConfigError(f"pipeline {self.name!r} was not served from a file: give the new one")
        return load_guarded(self.reload, path)

    def adopt(self, pipeline: Pipeline, executor: LocalExecutor) -> None:
        """(``topology.switch``, at the barrier) make ``executor`` the running graph's."""
        graph = executor.graph
        primary = [n.step_id for n in graph.nodes if n.kind == "sink"]
        self.tracker.switch("out" if "out" in primary else primary[0], RowEncoder(pipeline.output_columns))
        executor.tracer = self.executor.tracer
        self.pipeline, self.executor = pipeline, executor

    def graph_status(self) -> dict[str, Any]:
        """The running graph's version, steps and latency bound, and the updates so far."""
        graph = self.executor.graph
        return {
            "pipeline": self.name,
            "version": self.graph_version,
            "steps": [n.step_id for n in graph.nodes],
            "latency_bound_ms": graph.latency_bound_ms(),
            "updates": list(self.updates),
        }

    def set_anomaly(self, changes: dict[str, Any]) -> None:
        """Change the anomaly policy at run time (``AnomalyControl.update``), or install one."""
        if self.control is not None:
            self.control.update(changes)
            return
        self.control = AnomalyControl(AnomalyPolicy.from_config(changes))
        self.tracker.observe = self.control.observe

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.trace is not None:
            from aisp.observe.tracing.spans import EventTracer

            self.executor.tracer = EventTracer(self.trace, self.name)
        self.executor.start()
        if self.executor.tracer is not None:  # after start: its thread must not keep workers from forking
            self.executor.tracer.start()

    def trace_parent(self, traceparent: str | None, tracestate: str | None = None) -> Any:
        """The client's trace context from W3C headers, when this pipeline traces (else None)."""
        if self.executor.tracer is None or not traceparent:
            return None
        from aisp.observe.tracing.spans import extract_parent

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
