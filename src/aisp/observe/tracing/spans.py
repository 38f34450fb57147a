"""Per-event traces (OpenTelemetry) of a sample of the events.

A sampled event gets a trace: a root span ``aisp.event`` from its ingest to its sink write
(parented to the client's span when the event came with a W3C ``traceparent``), and one child
span per stage it went through, with the rows of the batch it travelled in. A model step's
calls get ``aisp.batch`` spans of their own, linked to the events each call carried (many
events share one call). Spans leave through the OTLP/HTTP exporter in a background thread.

Sampling is decided at ingest: events with a sampled ``traceparent`` always (their client asked
for it), the others by a hash of their id against ``sample_ratio``; and at most
``max_traces_per_s`` traces a second in all, so that tracing costs a bounded share of the
process whatever the event rate (a token bucket). Everything else costs one check per batch:
are any traced events in flight? When none are, nothing more is done.

Spans are built finished (start and end known) as the SDK's ``ReadableSpan`` and handed to its
``BatchSpanProcessor``: the SDK's ``start_span``/``end`` path (sampler, attribute copies, locks)
costs several times more per span, and every span here is recorded after the fact anyway.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from aisp.batch import INGEST_NS, Batch
from aisp.observe.clock import wall_ns
from aisp.observe.tracing.config import TraceConfig

__all__ = ["EventTracer", "TraceConfig", "extract_parent"]

_PROPAGATOR = TraceContextTextMapPropagator()
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: ids in sequence spread evenly
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("aisp")


def extract_parent(traceparent: str | None, tracestate: str | None = None) -> SpanContext | None:
    """The client's span context from a W3C ``traceparent`` header (None when absent or invalid)."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None


def _members(ids: npt.NDArray[np.int64], wanted: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The ``ids`` that are in ``wanted`` (a few traced events, the usual case: plain compares)."""
    if wanted.shape[0] > 8:
        return ids[np.isin(ids, wanted)]
    mask: npt.NDArray[np.bool_] = ids == wanted[0]
    for eid in wanted[1:]:
        mask |= ids == eid
    found: npt.NDArray[np.int64] = ids[mask]
    return found


@dataclass
class _Open:
    """A traced event in flight: its root span's identity, start, attributes and status, and
    when it entered the model steps."""

    context: SpanContext
    parent: SpanContext | None
    start_ns: int
    attributes: dict[str, Any]
    status: Status = field(default_factory=Status)
    model_enter_ns: dict[str, int] = field(default_factory=dict)


class EventTracer:
    """Traces of sampled events through one pipeline (see the module docstring).

    Calls come from the executor's threads; one lock guards the open traces. ``exporter``
    replaces the OTLP exporter (tests, other backends).
    """

    def __init__(self, config: TraceConfig, pipeline: str, *, exporter: SpanExporter | None = None) -> None:
        self.config = config
        self.pipeline = pipeline
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.resolved_endpoint())
        self._resource = Resource.create({"service.name": config.service_name, "aisp.pipeline": pipeline})
        self._exporter = exporter
        self._processor: BatchSpanProcessor | None = None
        self._early: list[ReadableSpan] = []
        self._random = random.Random()
        self._open: dict[int, _Open] = {}
        self._open_ids = np.empty(0, dtype=np.int64)
        self._lock = threading.Lock()
        self._threshold = np.uint64(min(int(config.sample_ratio * 2.0**64), 2**64 - 1))
        self._parents: list[tuple[int, int, SpanContext]] = []  # (first id, end id, client span)
        self._id_parents: dict[int, SpanContext] = {}  # event id -> producer's span
        self._tokens = config.max_traces_per_s
        self._refilled_ns = time.monotonic_ns()
        self.traces = 0
        """Traces started so far."""

    def start(self) -> None:
        """Start exporting (a thread: in a process that forks workers, call it after they are
        forked). Spans finished before are kept and exported then."""
        processor = BatchSpanProcessor(self._exporter)
        with self._lock:
            early, self._early = self._early, []
            self._processor = processor
        for span in early:
            processor.on_end(span)

    # -- cheap checks -------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Any traced event in flight (else a stage has nothing to do)."""
        return bool(self._open)

    def rows(self, batch: Batch) -> npt.NDArray[np.int64]:
        """Ids of the traced events in ``batch``."""
        open_ids = self._open_ids
        if not open_ids.shape[0] or not batch.num_rows:
            return open_ids[:0]
        return _members(batch.ids, open_ids)

    def _reindex(self) -> None:
        """Under the lock: refresh the array of open ids after a change."""
        self._open_ids = np.fromiter(self._open, dtype=np.int64, count=len(self._open))

    # -- ingest -------------------------------------------------------------------------------
    def parent(self, first_id: int, count: int, ctx: SpanContext | None) -> None:
        """Events ``first_id .. first_id + count - 1`` came with the client's span ``ctx``."""
        if ctx is not None and count > 0:
            with self._lock:
                self._parents.append((first_id, first_id + count, ctx))

    def parent_ids(self, traceparents: dict[int, str]) -> None:
        """Events (by id) that came with a producer's ``traceparent`` (broker message headers)."""
        found = {eid: ctx for eid, tp in traceparents.items() if (ctx := extract_parent(tp)) is not None}
        if found:
            with self._lock:
                if len(self._id_parents) > 100_000:  # ids that never reached ingest (a stopped run)
                    self._id_parents.clear()
                self._id_parents.update(found)

    def headers(self, ids: npt.NDArray[np.int64]) -> dict[int, str]:
        """``traceparent`` values naming each traced event's root span, for outgoing messages."""
        with self._lock:
            found = [(e, self._open.get(e)) for e in ids.tolist()]
        return {
            e: f"00-{tr.context.trace_id:032x}-{tr.context.span_id:016x}-01"
            for e, tr in found
            if tr is not None
        }

    def _has_token(self) -> bool:
        """Whether a new trace may start now (a racy read: ``_admit`` decides)."""
        cap = self.config.max_traces_per_s
        return cap <= 0 or self._tokens + (time.monotonic_ns() - self._refilled_ns) / 1e9 * cap >= 1

    def _admit(self, wanted: int) -> int:
        """Under the lock: how many of ``wanted`` new traces the rate cap allows now."""
        cap = self.config.max_traces_per_s
        if cap <= 0:
            return wanted
        now = time.monotonic_ns()
        self._tokens = min(cap, self._tokens + (now - self._refilled_ns) / 1e9 * cap)
        self._refilled_ns = now
        n = min(wanted, int(self._tokens))
        self._tokens -= n
        return n

    def ingest(self, step: str, batch: Batch, read_start_ns: int) -> None:
        """A source emitted ``batch``: sample its events, open their traces, record the source's
        span (from the read, or the event's arrival when later, to now), and mark the batch
        with its traced ids (``Batch.traced``)."""
        if not batch.num_rows:
            return
        sampling = bool(self._threshold) and self._has_token()
        if not sampling and not self._parents and not self._id_parents:
            return
        ids = batch.ids
        chosen: dict[int, SpanContext | None] = {}
        if sampling:
            hashed = ids.astype(np.uint64) * _HASH  # wraps: a multiplicative hash
            picked = np.flatnonzero(hashed < self._threshold)
            if picked.shape[0]:
                with self._lock:
                    picked = picked[: self._admit(picked.shape[0])]
                chosen = dict.fromkeys(ids[picked].tolist())
        if self._parents or self._id_parents:
            self._claim_parents(ids, chosen)
        if not chosen:
            return
        now = time.monotonic_ns()
        wanted = np.fromiter(chosen, dtype=np.int64, count=len(chosen))
        where = np.flatnonzero(np.isin(ids, wanted))
        arrivals = dict(zip(ids[where].tolist(), batch.numpy(INGEST_NS)[where].tolist(), strict=True))
        opened = {}
        for eid, parent in chosen.items():
            arrived = arrivals[eid]
            trace_id = parent.trace_id if parent is not None else self._random.getrandbits(128)
            tr = _Open(
                context=SpanContext(trace_id, self._random.getrandbits(64), False, _SAMPLED),
                parent=parent,
                start_ns=min(arrived, read_start_ns),
                attributes={"aisp.pipeline": self.pipeline, "aisp.event_id": eid},
            )
            self._span(f"stage {step}", tr, max(read_start_ns, arrived), now, step, batch.num_rows)
            opened[eid] = tr
        with self._lock:
            self._open.update(opened)
            self.traces += len(opened)
            self._reindex()
        batch.traced = np.fromiter(opened, dtype=np.int64, count=len(opened))

    def among(self, batch: Batch, traced: npt.NDArray[np.int64]) -> None:
        """Mark ``batch`` (an operator's output) with those of ``traced`` it carries."""
        if batch.traced is None and batch.num_rows:
            found = _members(batch.ids, traced)
            batch.traced = found if found.shape[0] else None

    def _claim_parents(self, ids: npt.NDArray[np.int64], chosen: dict[int, SpanContext | None]) -> None:
        """Events of ``ids`` sent with a client's span: chosen with it when the client sampled
        its trace (within the rate cap), left out when it did not; spent ranges dropped."""
        with self._lock:
            parents, keep = self._parents, []
            top = int(ids.max())
            spans: list[tuple[list[int], SpanContext]] = []
            for lo, hi, ctx in parents:
                spans.append((ids[(ids >= lo) & (ids < hi)].tolist(), ctx))
                if hi - 1 > top:
                    keep.append((lo, hi, ctx))
            self._parents = keep
            if self._id_parents:
                pop = self._id_parents.pop
                spans += [([e], span) for e in ids.tolist() if (span := pop(e, None)) is not None]
            for inside, span in spans:
                if span.trace_flags.sampled:
                    chosen.update(dict.fromkeys(inside[: self._admit(len(inside))], span))
                else:  # the client's trace is not sampled: follow its decision
                    for eid in inside:
                        chosen.pop(eid, None)

    # -- spans --------------------------------------------------------------------------------
    def _emit(self, span: ReadableSpan) -> None:
        if self._processor is not None:
            self._processor.on_end(span)
        else:  # spans of the first batches, before the export thread started
            with self._lock:
                self._early.append(span)

    def _span(self, name: str, tr: _Open, start_ns: int, end_ns: int, step: str, rows: int) -> SpanContext:
        """A finished child span of event ``tr``; returns its context (to link to)."""
        ctx = SpanContext(tr.context.trace_id, self._random.getrandbits(64), False, _SAMPLED)
        self._emit(
            ReadableSpan(
                name,
                context=ctx,
                parent=tr.context,
                resource=self._resource,
                attributes={"aisp.step": step, "aisp.batch_rows": rows},
                start_time=wall_ns(start_ns),
                end_time=wall_ns(max(end_ns, start_ns)),
                instrumentation_scope=_SCOPE,
            )
        )
        return ctx

    def _end(self, tr: _Open, end_ns: int) -> None:
        """The event's root span, now that its end is known."""
        self._emit(
            ReadableSpan(
                "aisp.event",
                context=tr.context,
                parent=tr.parent,
                resource=self._resource,
                attributes=tr.attributes,
                kind=SpanKind.CONSUMER,
                status=tr.status,
                start_time=wall_ns(tr.start_ns),
                end_time=wall_ns(max(end_ns, tr.start_ns)),
                instrumentation_scope=_SCOPE,
            )
        )

    # -- stages -------------------------------------------------------------------------------
    def stage(
        self, step: str, ids: npt.NDArray[np.int64], start_ns: int, rows: int, kept: set[int] | None = None
    ) -> None:
        """An operator processed a batch holding traced ``ids`` from ``start_ns`` to now.
        ``kept``: the traced ids among its outputs (those missing were filtered out)."""
        now = time.monotonic_ns()
        gone: list[int] = []
        with self._lock:
            found = [(e, self._open.get(e)) for e in ids.tolist()]
        for eid, tr in found:
            if tr is None:
                continue
            self._span(f"stage {step}", tr, start_ns, now, step, rows)
            if kept is not None and eid not in kept:
                tr.attributes["aisp.dropped_at"] = step
                gone.append(eid)
        if gone:
            self._close(gone, now)

    def entered(self, step: str, kind: str, traced: npt.NDArray[np.int64], batch: Batch) -> None:
        """Traced rows enter ``step`` (of ``kind``): a model step notes when (its span ends at
        its output); a sink gets their ``traceparent`` values for its outgoing messages."""
        if kind in ("infer", "llm"):
            self.model_in(step, traced, time.monotonic_ns())
        elif kind == "sink":
            batch.traceparents = self.headers(traced) or None

    def left(
        self,
        step: str,
        kind: str,
        traced: npt.NDArray[np.int64],
        start_ns: int,
        rows: int,
        outs: Sequence[tuple[str, Batch]],
    ) -> None:
        """Traced rows left ``step``: a step span each; a sink ends their traces, a step that
        let some of them go (a filter) ends theirs."""
        if kind == "sink":
            self.written(step, traced, start_ns, rows)
            return
        kept: set[int] = set()
        for _, out in outs:
            self.among(out, traced)
            if out.traced is not None:
                kept.update(out.traced.tolist())
        self.stage(step, traced, start_ns, rows, kept)

    def model_in(self, step: str, ids: npt.NDArray[np.int64], now_ns: int) -> None:
        """Traced rows were handed to model step ``step``'s batcher."""
        with self._lock:
            for e in ids.tolist():
                tr = self._open.get(e)
                if tr is not None:
                    tr.model_enter_ns[step] = now_ns

    def model_out(self, step: str, batch: Batch, wait_ns: int, compute_ns: int) -> None:
        """Model step ``step`` returned ``batch`` (one call: ``wait_ns`` in the queue, then
        ``compute_ns``): a batch span linked to each traced event's step span; the batch is
        marked with them."""
        ids = self.rows(batch)
        if not ids.shape[0]:
            return
        batch.traced = ids
        now = time.monotonic_ns()
        with self._lock:
            found = [self._open.get(e) for e in ids.tolist()]
        links = []
        for tr in found:
            if tr is not None:
                entered = tr.model_enter_ns.pop(step, now - wait_ns - compute_ns)
                links.append(Link(self._span(f"stage {step}", tr, entered, now, step, batch.num_rows)))
        call = SpanContext(self._random.getrandbits(128), self._random.getrandbits(64), False, _SAMPLED)
        self._emit(
            ReadableSpan(
                "aisp.batch",  # a trace of its own: one call carries many events
                context=call,
                resource=self._resource,
                attributes={
                    "aisp.step": step,
                    "aisp.batch_rows": batch.num_rows,
                    "aisp.queue_wait_ms": wait_ns / 1e6,
                    "aisp.compute_ms": compute_ns / 1e6,
                },
                links=links,
                start_time=wall_ns(now - compute_ns),
                end_time=wall_ns(now),
                instrumentation_scope=_SCOPE,
            )
        )

    def written(self, step: str, ids: npt.NDArray[np.int64], start_ns: int, rows: int) -> None:
        """A sink wrote traced ``ids``: its span, and the end of their traces."""
        self.stage(step, ids, start_ns, rows)
        self._close(ids.tolist(), time.monotonic_ns())

    def failed(self, step: str, batch: Batch, reason: str) -> None:
        """Traced events of ``batch`` were dead-lettered at ``step``: their traces end in error."""
        ids = batch.traced if batch.traced is not None else self.rows(batch)
        if not ids.shape[0]:
            return
        with self._lock:
            found = [self._open.get(e) for e in ids.tolist()]
        for tr in found:
            if tr is not None:
                tr.attributes["aisp.dead_letter_step"] = step
                tr.status = Status(StatusCode.ERROR, reason)
        self._close(ids.tolist(), time.monotonic_ns())

    def _close(self, ids: list[int], end_ns: int) -> None:
        with self._lock:
            ended = [tr for e in ids if (tr := self._open.pop(e, None)) is not None]
            if ended:
                self._reindex()
        for tr in ended:
            self._end(tr, end_ns)

    def close(self) -> None:
        """End traces still open (the run stopped), export everything, stop the exporter."""
        with self._lock:
            left = list(self._open.values())
            self._open.clear()
            self._reindex()
        now = time.monotonic_ns()
        for tr in left:
            tr.attributes["aisp.unfinished"] = True
            self._end(tr, now)
        if self._processor is None:
            self.start()
        assert self._processor is not None
        self._processor.force_flush()
        self._processor.shutdown()  # type: ignore[no-untyped-call]
