"""The local executor: runs a validated graph in one process.

Steps are grouped into tasks (operator chaining, as in Flink): a step joins its upstream's task
when it has one input, that output feeds only it, and the upstream is a plain operator. Each task
is one thread reading one bounded ``Channel``; sources run in their own threads; an ``infer``
step hands rows to its ``DynamicBatcher``, whose dispatcher threads call the model (ONNX Runtime
releases the GIL) and feed the next task's channel. Sinks record each event's end-to-end latency
when its row is written.

End of input flows downstream: a source that is exhausted (or told to stop) flushes and closes its
outputs; every task drains its channel, flushes its operators in order and closes its own
outputs, so a stop never loses a row that was accepted. An exception from an operator sends that
batch's rows to the dead-letter sink with the step and the cause, and the pipeline goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import INGEST_NS, Batch
from aisp.errors import AispError, ConfigError, SinkError, StateError
from aisp.graph import Graph, Node, split_ref
from aisp.infer.batcher import DynamicBatcher
from aisp.infer.stage import InferSpec, build_batcher
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.ingest.process import ProcessSource
from aisp.observe.drift import DriftConfig, DriftMonitor
from aisp.observe.stats import RunStats, StageStats
from aisp.schedule.channel import Channel
from aisp.schedule.keyed_state import KeyedStateKeeper
from aisp.schedule.pacing import Pacer
from aisp.sinks.base import Sink, SinkPartition
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.sinks.process import ProcessSink
from aisp.state.checkpoint import Checkpoint, CheckpointStore
from aisp.state.keyed import KeyIndex
from aisp.state.partitions import PartitionStates
from aisp.state.store import LmdbStateStore
from aisp.transform.operators import Checkpointable, Emit, IncrementalState, Operator, OperatorContext

if TYPE_CHECKING:
    from aisp.observe.tracing import EventTracer

__all__ = ["ExecutorOptions", "Lineage", "LocalExecutor"]

log = logging.getLogger("aisp.executor")

CHAINABLE = frozenset({"map_batch", "map", "filter", "key_by", "stateful", "route", "union", "sink", "infer"})
CHAIN_UPSTREAM = frozenset({"source", "map_batch", "map", "filter", "key_by", "stateful", "route", "union"})


@dataclass(frozen=True, kw_only=True)
class ExecutorOptions:
    """Executor settings. ``rate_events_per_s`` paces sources open-loop (0: as fast as possible)."""

    channel_capacity_rows: int = 8192
    source_batch_rows: int = 512
    rate_events_per_s: float = 0.0
    paced_linger_ms: float = 1.0
    offload_sources: bool = True
    offload_sinks: bool = False
    state_max_keys: int = 0
    """With a state store: keep about this many keys per key space in memory (0: all); at a
    checkpoint, keys not seen for the longest are evicted (their state is in the store) and
    read back from the store when seen again."""


class Lineage(Protocol):
    """Follows each event (by ``_id``) through the graph, so a caller can tell when it is done.

    An event starts with one open branch. ``forwarded`` is told what an operator made of a batch
    before its outputs move on (a filter closes branches, a route to two ports opens one), and
    of every output that goes to several consumers, or to none;
    ``written`` that a sink took rows (each closes a branch); ``failed`` that rows went to the
    dead-letter sink (each closes a branch, unless ``closes`` is False: an operator dead-lettered
    them itself, and ``forwarded`` closes their branch). Calls come from the executor's threads.
    """

    def forwarded(self, step: str, batch: Batch, outs: Emit) -> None: ...

    def written(self, step: str, batch: Batch) -> None: ...

    def failed(self, step: str, batch: Batch, reason: str, *, closes: bool = True) -> None: ...


def _can_fork(step_id: str) -> bool:
    """Process offload forks; that is only safe while this is the process's only thread."""
    if threading.active_count() == 1:
        return True
    log.warning(
        "step %r runs in-process: %d threads are already running, so forking a worker is unsafe",
        step_id,
        threading.active_count(),
    )
    return False


class _SinkOp:
    """Writes to a sink partition and records each row's end-to-end latency once written."""

    def __init__(self, part: SinkPartition, run: RunStats) -> None:
        self.part, self._run = part, run
        if part.reports_written:
            part.on_written = self._written

    def _written(self, ingest_ns: npt.NDArray[np.int64], written_ns: int) -> None:
        self._run.e2e.record(written_ns - ingest_ns)
        self._run.events_out += ingest_ns.shape[0]
        self._run.last_written_ns = written_ns

    def process(self, batch: Batch) -> Emit:
        if not batch.num_rows:
            return []
        self.part.write(batch)
        if not self.part.reports_written:
            self._written(batch.numpy(INGEST_NS), time.monotonic_ns())
        return []

    def flush(self) -> Emit:
        self.part.flush()
        return []


class _InferOp:
    def __init__(self, batcher: DynamicBatcher, step_id: str, spec: InferSpec) -> None:
        self.batcher = batcher
        self._step, self._spec = step_id, spec
        self.drift: DriftMonitor | None = None
        drift = spec.drift
        if (
            drift is not None
            and isinstance(drift.alert, str)
            and drift.alert.startswith(("redis://", "nats://"))
        ):
            from aisp.connectors import alert_to

            # connected when the executor starts, so that an unreachable target fails the start
            self._spec = replace(spec, drift=replace(drift, alert=alert_to(drift.alert)))

    def process(self, batch: Batch) -> Emit:
        if self._spec.drift is not None and batch.num_rows:
            self._watch(batch, self._spec.drift)
        self.batcher.submit(batch)
        return []

    def _watch(self, batch: Batch, config: DriftConfig) -> None:
        columns = list(self._spec.inputs.values())
        parts = [batch.numpy(c).reshape(batch.num_rows, -1) for c in columns]
        matrix = parts[0] if len(parts) == 1 else np.hstack(parts)
        if self.drift is None:
            names = [
                name
                for c, arr in zip(columns, parts, strict=True)
                for name in ([c] if arr.shape[1] == 1 else [f"{c}[{i}]" for i in range(arr.shape[1])])
            ]
            self.drift = DriftMonitor(self._step, config, matrix.shape[1], names)
        self.drift.observe(matrix)

    def flush(self) -> Emit:
        self.batcher.close()
        return []


class LocalExecutor:
    """Runs ``graph`` with threads in this process; ``run()`` blocks until the pipeline drained."""

    def __init__(
        self,
        graph: Graph,
        *,
        dead_letter: DeadLetterWriter,
        options: ExecutorOptions | None = None,
        lineage: Lineage | None = None,
        restore: Checkpoint | None = None,
        state_store: LmdbStateStore | None = None,
        tracer: EventTracer | None = None,
        partition_states: PartitionStates | None = None,
    ) -> None:
        graph.validate()
        self.lineage = lineage
        self.tracer = tracer
        """Per-event traces of sampled events (closed by ``run``/``join`` when the run ends)."""
        self.graph = graph
        self.options = options or ExecutorOptions()
        self.dead_letter = dead_letter
        self.stats = RunStats()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._nodes = {n.step_id: n for n in graph.topological_order()}
        self._consumers = graph.consumers()
        self._task_of = self._assign_tasks()
        self._channels: dict[str, Channel] = {}
        self._ops: dict[str, Operator] = {}
        self._pending_inputs: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._key_indexes: dict[str, KeyIndex] = {}
        self._sink_parts: dict[str, SinkPartition] = {}
        self._source_parts: dict[str, SourcePartition] = {}
        self.batchers: dict[str, DynamicBatcher] = {}
        self._restore = restore
        self.state_store = state_store
        """Keyed state goes here at checkpoints (only what changed), instead of into the
        checkpoint's files."""
        self.partition_states = partition_states
        """Keyed state checkpointed per input partition (it moves with the partitions of a Kafka
        input between the processes of a group), instead of into the checkpoint's files."""
        self.keyed = KeyedStateKeeper(
            graph.name, self._key_indexes, self._ops, state_store=state_store,
            partition_states=partition_states, max_keys=self.options.state_max_keys,
        )  # fmt: skip
        """Keyed state outside the hot path (checkpoints, a bounded hot layer, partitions)."""
        # checkpoints: rows in flight (read, not yet written, dropped or dead-lettered), and a
        # pause that sources obey between batches
        self._in_flight = 0
        self._flight = threading.Condition()
        self._pause = False
        self._sources_waiting = 0
        self._sources_running = 0
        self.on_drained: Callable[[], object] | None = None
        """Called once when every task has ended, before sources and sinks close (a final
        checkpoint: positions at the end of what was read, acks to brokers)."""

    # -- planning -----------------------------------------------------------------------------
    def _assign_tasks(self) -> dict[str, str]:
        """Chain each step into its upstream's thread where that is safe and saves a hand-off.

        Every Python stage holds the GIL, so a thread per stage buys no parallelism, only
        switches; chains keep a batch in one thread from the source to the model, and from the
        model's dispatcher thread to the sink. A step downstream of a model with several
        instances gets its own task, since those dispatchers run concurrently.
        """
        task_of: dict[str, str] = {}
        for sid, node in self._nodes.items():
            task_of[sid] = sid
            if node.kind not in CHAINABLE or len(node.inputs) != 1:
                continue
            up, port = split_ref(node.inputs[0])
            up_node = self._nodes[up]
            single = len(self._consumers[(up, port)]) == 1
            after_model = up_node.kind == "infer" and up_node.spec.batcher.instances == 1
            if single and (up_node.kind in CHAIN_UPSTREAM or after_model):
                task_of[sid] = task_of[up]
        return task_of

    def _chained(self, step_id: str) -> bool:
        return self._task_of[step_id] != step_id

    def thread_of(self) -> dict[str, str]:
        """Step id -> the thread (group) that does its work: its task's, except that a model's
        calls, and the steps chained after it, run on the model's dispatcher threads (named by
        the model step)."""
        out: dict[str, str] = {}
        for sid, node in self._nodes.items():
            if node.kind == "infer" or not self._chained(sid):
                out[sid] = sid
            else:
                up = split_ref(node.inputs[0])[0]
                out[sid] = up if self._nodes[up].kind == "infer" else out[up]
        return out

    def tasks(self) -> dict[str, list[str]]:
        """Task id -> the step ids it runs, in order."""
        out: dict[str, list[str]] = defaultdict(list)
        for sid in self._nodes:
            out[self._task_of[sid]].append(sid)
        return dict(out)

    # -- building -----------------------------------------------------------------------------
    def _dead_letter_rows(self, batch: Batch, step: str, reason: str) -> None:
        """Rows that leave the pipeline here (a failed batch, the batcher's expired rows)."""
        self.dead_letter.rows(batch, step, reason)
        self._landed(-batch.num_rows)
        if self.lineage is not None:
            self.lineage.failed(step, batch, reason)
        if self.tracer is not None and self.tracer.active:
            self.tracer.failed(step, batch, reason)

    def _operator_dead_letters(self, batch: Batch, step: str, reason: str) -> None:
        """Rows an operator dead-letters itself: also missing from its output, which is where
        their branch is counted as closed."""
        self.dead_letter.rows(batch, step, reason)
        if self.lineage is not None:
            self.lineage.failed(step, batch, reason, closes=False)
        if self.tracer is not None and self.tracer.active:
            self.tracer.failed(step, batch, reason)

    def _landed(self, rows: int) -> None:
        """``rows`` more (or, negative, fewer) rows are in flight."""
        if rows:
            with self._flight:
                self._in_flight += rows
                if self._in_flight <= 0:
                    self._flight.notify_all()

    def _build(self) -> None:
        for sid, node in self._nodes.items():
            st = self.stats.stage(sid, node.kind)
            self._pending_inputs[sid] = len(node.inputs)
            if node.kind != "source" and not self._chained(sid):
                ch = Channel(self.options.channel_capacity_rows, producers=len(node.inputs))
                self._channels[sid] = ch
                st.queue_rows = lambda ch=ch: ch.rows  # type: ignore[misc]
            if node.kind == "source":
                continue
            if node.kind == "sink":
                spec: Sink = node.spec
                if self.options.offload_sinks and spec.encode_heavy and _can_fork(sid):
                    spec = ProcessSink(inner=spec)
                position = self._restore.meta["sinks"].get(sid) if self._restore is not None else None
                part = spec.open() if position is None else spec.resume(position)
                self._sink_parts[sid] = part
                self._ops[sid] = _SinkOp(part, self.stats)
            elif node.kind == "infer":
                self._ops[sid] = _InferOp(self._make_batcher(node, st), sid, node.spec)
            else:
                ctx = OperatorContext(sid, self._operator_dead_letters, self._key_indexes)
                self._ops[sid] = node.spec.build(ctx)

    def _make_batcher(self, node: Node, st: StageStats) -> DynamicBatcher:
        spec: InferSpec = node.spec
        sid = node.step_id

        call = threading.local()  # the dispatcher's last call, for its trace span

        def emit(batch: Batch) -> None:
            st.rows_out += batch.num_rows
            if self.tracer is not None and self.tracer.active:
                self.tracer.model_out(sid, batch, getattr(call, "wait_ns", 0), getattr(call, "compute_ns", 0))
            try:
                self._emit(sid, "out", batch)
            except SinkError as exc:  # from a sink chained after the model: the pipeline stops
                self._errors.append(exc)
                self._stop.set()

        def on_batch(rows: int, queue_wait_ns: int, compute_ns: int) -> None:
            call.wait_ns, call.compute_ns = queue_wait_ns, compute_ns
            st.batches += 1
            st.busy_ns += compute_ns
            st.phase("batch", queue_wait_ns)
            st.phase("compute", compute_ns)
            st.batch_rows.record_one(rows)

        batcher = build_batcher(
            spec,
            emit=emit,
            dead_letter=lambda b, reason: self._dead_letter_rows(b, sid, reason),
            on_batch=on_batch,
        )
        ch = self._channels.get(sid)
        st.queue_rows = lambda: batcher.queued_rows + (ch.rows if ch else 0)
        self.batchers[sid] = batcher
        return batcher

    # -- data flow ----------------------------------------------------------------------------
    def _push(self, sid: str, batch: Batch) -> None:
        st = self.stats.stages[sid]
        st.rows_in += batch.num_rows
        traced = batch.traced  # sampled events (set at ingest when tracing)
        if traced is not None:
            self._trace(sid, traced, batch)
            traced_from = time.monotonic_ns()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            outs = self._ops[sid].process(batch)
        except (SinkError, StateError):
            raise  # a sink that gave up (its broker stayed away), state that cannot be kept: fatal
        except Exception as exc:  # noqa: BLE001 - rows go to the dead-letter sink, the pipeline goes on
            st.errors += 1
            self._dead_letter_rows(batch, sid, f"{type(exc).__name__}: {exc}")
            return
        finally:
            took = time.perf_counter_ns() - t0
            st.busy_ns += took
        kind = self._nodes[sid].kind
        if kind != "infer":  # a model's phases come from its batcher
            st.cpu_ns += time.thread_time_ns() - c0
            st.batches += 1
            st.phase("serialize" if kind == "sink" else "compute", took)
            st.batch_rows.record_one(batch.num_rows)
        if kind == "sink":
            self._landed(-batch.num_rows)
        elif kind != "infer":
            self._landed(sum(o.num_rows for _, o in outs) - batch.num_rows)
        if traced is not None and kind != "infer":
            self._traced(sid, kind, traced, traced_from, batch.num_rows, outs)
        if self.lineage is not None:
            if kind == "sink":
                self.lineage.written(sid, batch)
            elif kind != "infer":  # a model's rows move on from its batcher, one out per in
                self.lineage.forwarded(sid, batch, outs)
        for port, out in outs:
            if kind != "infer":
                st.rows_out += out.num_rows
            self._emit(sid, port, out)

    def _trace(self, sid: str, traced: npt.NDArray[np.int64], batch: Batch) -> None:
        """Traced rows enter ``sid``: a model step notes when (its span ends at its output); a
        sink gets their ``traceparent`` values for its outgoing messages."""
        kind = self._nodes[sid].kind
        if self.tracer is None:
            return
        if kind == "infer":
            self.tracer.model_in(sid, traced, time.monotonic_ns())
        elif kind == "sink":
            batch.traceparents = self.tracer.headers(traced) or None

    def _traced(
        self, sid: str, kind: str, traced: npt.NDArray[np.int64], start_ns: int, rows: int, outs: Emit
    ) -> None:
        """Traced rows left ``sid``: a step span each; a sink ends their traces, a step that
        let some of them go (a filter) ends theirs."""
        tracer = self.tracer
        if tracer is None:
            return
        if kind == "sink":
            tracer.written(sid, traced, start_ns, rows)
            return
        kept: set[int] = set()
        for _, out in outs:
            tracer.among(out, traced)
            if out.traced is not None:
                kept.update(out.traced.tolist())
        tracer.stage(sid, traced, start_ns, rows, kept)

    def _emit(self, sid: str, port: str, batch: Batch) -> None:
        consumers = self._consumers.get((sid, port), ())
        if len(consumers) != 1:  # each consumer gets its own copy
            self._landed(batch.num_rows * (len(consumers) - 1))
            if self.lineage is not None:
                self.lineage.forwarded(sid, batch, [(port, batch)] * len(consumers))
        for consumer in consumers:
            if self._chained(consumer):
                self._push(consumer, batch)
            else:
                self._channels[consumer].put(batch)

    def _finish(self, sid: str) -> None:
        """``sid`` will get no more input: flush it and tell everything downstream."""
        node = self._nodes[sid]
        if node.kind != "source":
            try:
                outs = self._ops[sid].flush()
            except Exception as exc:  # noqa: BLE001 - a failing flush must not stop the drain
                self._errors.append(exc)
                outs = []
            for port, out in outs:
                self._emit(sid, port, out)
        for port in node.ports:
            for consumer in self._consumers.get((sid, port), ()):
                if self._chained(consumer):
                    self._pending_inputs[consumer] -= 1
                    if self._pending_inputs[consumer] == 0:
                        self._finish(consumer)
                else:
                    self._channels[consumer].close_producer()

    # -- tasks --------------------------------------------------------------------------------
    def _open_source(self, node: Node) -> SourcePartition:
        spec: Source = node.spec
        if self.options.offload_sources and spec.decode_heavy and _can_fork(node.step_id):
            spec = ProcessSource(inner=spec)
        position = self._restore.meta["sources"].get(node.step_id) if self._restore is not None else None
        if self.partition_states is not None:  # positions come with each partition's state
            ctx = SourceContext(
                node.step_id, self._source_dead_letters, self.options.source_batch_rows,
                on_assign=self._partitions_assigned, on_revoke=self._partitions_revoked,
            )  # fmt: skip
            return spec.open(ctx, resume_from=None)
        ctx = SourceContext(node.step_id, self._source_dead_letters, self.options.source_batch_rows)
        return spec.open(ctx, resume_from=position)

    def _source_dead_letters(self, records: list[DeadLetterRecord]) -> None:
        """Input a source could not decode: counted as read (``events_in``) and dead-lettered."""
        self.stats.events_in += len(records)
        self.dead_letter.records(records)

    def _source_task(self, node: Node) -> None:
        st = self.stats.stages[node.step_id]
        part = self._source_parts[node.step_id]
        try:
            self._pump(node, part, st)
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by run() after the drain
            self._errors.append(exc)
            self._stop.set()
        finally:
            with self._flight:
                self._sources_running -= 1
                self._flight.notify_all()
            self._finish(node.step_id)  # the partition stays open for a final checkpoint

    def _pump(self, node: Node, part: SourcePartition, st: StageStats) -> None:
        rate = self.options.rate_events_per_s
        pacer: Pacer | None = None  # the schedule starts when the first rows are in hand
        held: Batch | None = None
        read_started = time.monotonic_ns()
        while not self._stop.is_set():
            if held is None or held.num_rows == 0:
                if self._pause or self.keyed.full():
                    self._wait_while_paused()
                    continue
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                read_started = time.monotonic_ns()
                held = part.next_batch(self.options.source_batch_rows)
                read_ns = time.perf_counter_ns() - t0
                if held is None:
                    return
                if held.traceparents and self.tracer is not None:  # the producers' traces
                    self.tracer.parent_ids(held.traceparents)
                if held.num_rows:  # reading and decoding; an empty read is idle, not busy
                    if self.stats.first_read_ns is None:
                        self.stats.first_read_ns = read_started
                    st.busy_ns += read_ns
                    st.cpu_ns += time.thread_time_ns() - c0
                    st.phase("serialize", read_ns)
                    st.batch_rows.record_one(held.num_rows)
                if not held.num_rows:
                    continue
            if rate <= 0:
                out, held = held, None
            else:
                if pacer is None:
                    pacer = Pacer(rate, self.options.paced_linger_ms, time.monotonic_ns())
                now = time.monotonic_ns()
                n, wait_until = pacer.take(now, held.num_rows)
                if n == 0:
                    self._stop.wait((wait_until - now) / 1e9)
                    continue
                out, held = held.slice(0, n), held.slice(n)
                out = out.with_columns({INGEST_NS: pacer.times(n)})
            st.rows_out += out.num_rows
            st.batches += 1
            self.stats.events_in += out.num_rows
            self._landed(out.num_rows)
            if self.tracer is not None:
                self.tracer.ingest(node.step_id, out, read_started)
            self._emit(node.step_id, "out", out)

    def _chain_task(self, sid: str) -> None:
        ch = self._channels[sid]
        try:
            st = self.stats.stages[sid]
            while (batch := ch.get()) is not None:
                st.phase("queue", ch.last_wait_ns)
                self._push(sid, batch)
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by run() after the drain
            self._errors.append(exc)
            self._stop.set()
            while ch.get() is not None:  # keep upstream from blocking forever
                pass
        finally:
            self._finish(sid)

    # -- checkpoints --------------------------------------------------------------------------
    def _wait_while_paused(self) -> None:
        with self._flight:
            self._sources_waiting += 1
            self._flight.notify_all()
            while (self._pause or self.keyed.full()) and not self._stop.is_set():
                self._flight.wait(0.05)
            self._sources_waiting -= 1

    def _quiesce(self, timeout_s: float) -> bool:
        """Pause the sources between batches and wait until no row is in flight."""
        deadline = time.monotonic() + timeout_s
        with self._flight:
            self._pause = True
            while self._sources_waiting < self._sources_running or self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._flight.wait(min(left, 0.05))
        return True

    def _resume(self) -> None:
        with self._flight:
            self._pause = False
            self._flight.notify_all()

    def checkpoint(self, store: CheckpointStore, *, timeout_s: float = 10.0) -> int | None:
        """Take a checkpoint; returns its id, or None when the pipeline did not go quiet within
        ``timeout_s`` (then nothing is written).

        While the sources are paused and no row is in flight, it copies operator state and key
        spaces and takes the source, sink and dead-letter positions (sinks flush to the OS);
        then the sources resume, and only the durable part runs alongside the pipeline, in the
        calling thread: sinks sync to disk, the files and the manifest are written, and the
        sources are told (brokers ack up to there).
        """
        try:
            if not self._quiesce(timeout_s):
                return None
            # under the pause only copies (or views that stay valid); conversions come after
            columns_of: dict[str, dict[str, Any]] = {}
            key_views: dict[str, Callable[[], pa.Array]] = {}
            dirty: dict[str, tuple[Callable[[], pa.Array], dict[str, Any]]] = {}
            if self.state_store is not None:  # only the keys that changed, written below
                for sid, op in self._ops.items():
                    if isinstance(op, IncrementalState):
                        codes, columns = op.take_dirty()
                        dirty[sid] = (op.index.frozen_keys(codes), columns)
                if self.options.state_max_keys:
                    self.keyed.evict()
            elif self.partition_states is None:
                key_views = {space: index.frozen_keys() for space, index in self._key_indexes.items()}
            for index in self._key_indexes.values():
                index.advance()
            for sid, op in self._ops.items():
                keyed_elsewhere = self.partition_states is not None and isinstance(op, IncrementalState)
                if isinstance(op, Checkpointable) and sid not in dirty and not keyed_elsewhere:
                    columns_of[sid] = op.snapshot()
            sources = {sid: part.snapshot() for sid, part in self._source_parts.items()}
            partitions = (
                self.keyed.capture_partitions(self.partition_states.owned) if self.partition_states else {}
            )
            meta = {
                "pipeline": self.graph.name,
                "sources": sources,
                "sinks": {sid: part.snapshot() for sid, part in self._sink_parts.items()},
                "models": {sid: str(getattr(b.runtime, "version", "")) for sid, b in self.batchers.items()},
                "dead_letter_bytes": self.dead_letter.snapshot(),
                "events_in": self.stats.events_in,
            }
        finally:
            self._resume()
        tables = {f"keys.{space}": pa.table({"key": view()}) for space, view in key_views.items()}
        tables.update({f"op.{sid}": pa.table(columns) for sid, columns in columns_of.items()})
        changed = {sid: (keys(), columns) for sid, (keys, columns) in dirty.items()}
        for sink in self._sink_parts.values():
            sink.sync()
        self.dead_letter.sync()
        checkpoint_id = store.next_id()
        if self.state_store is not None:  # every 10th drops what no kept checkpoint reads
            kept = store.ids()
            before = kept[0] if kept and checkpoint_id % 10 == 0 else 0
            meta["state_store"] = self.keyed.write_to_store(checkpoint_id, changed, before)
        store.write(checkpoint_id, tables, meta)
        if partitions:  # after the local manifest: the outputs they cover are durable
            (offsets,) = (position["offsets"] for position in sources.values())
            self.keyed.write_partitions(partitions, offsets)
        for sid, part in self._source_parts.items():
            part.commit(sources[sid])
        self.stats.checkpoints += 1
        return checkpoint_id

    @property
    def drift_monitors(self) -> list[DriftMonitor]:
        """The drift monitors of infer steps (those that have seen data)."""
        return [op.drift for op in self._ops.values() if isinstance(op, _InferOp) and op.drift is not None]

    def commit_sources(self) -> None:
        """Tell every source that all it handed out is done (a drained run without checkpoints:
        brokers get their acks, at-least-once)."""
        for part in self._source_parts.values():
            part.commit(part.snapshot())

    # -- keyed state that follows input partitions ---------------------------------------------
    def _follow_partitions(self) -> None:
        sources = [n.spec for n in self._nodes.values() if n.kind == "source"]
        partition_of = getattr(sources[0], "partition_of", None) if len(sources) == 1 else None
        if partition_of is None:
            raise ConfigError("keyed state that follows input partitions needs a single Kafka input")
        self.keyed.follow_partitions(partition_of)

    def _drain_in_flight(self) -> None:
        """Wait until every row read so far is written, dropped or dead-lettered (called by the
        only source, which reads nothing meanwhile)."""
        with self._flight:
            while self._in_flight > 0 and not self._stop.is_set():
                self._flight.wait(0.05)

    def _partitions_assigned(self, partitions: list[int]) -> dict[int, int]:
        """Claim newly assigned partitions and load their state; where to start each."""
        assert self.partition_states is not None
        self._drain_in_flight()
        log.info("input partitions %s assigned", partitions)
        offsets: dict[int, int] = {}
        for partition in partitions:
            checkpoint = self.partition_states.claim(partition)
            if checkpoint is not None:
                offsets[partition] = self.keyed.load_partition(partition, checkpoint)
        return offsets

    def _partitions_revoked(self, partitions: list[int]) -> None:
        """Flush the state of partitions taken away (outputs first), release them, drop their
        keys."""
        assert self.partition_states is not None
        self._drain_in_flight()
        owned = [p for p in partitions if p in self.partition_states.owned]
        with self._flight:  # a failed run (or a stop that cut the drain short) writes nothing:
            consistent = not self._errors and self._in_flight == 0  # the last checkpoint stands
        if consistent:
            for sink in self._sink_parts.values():
                sink.snapshot()  # the outputs their state covers are durable (a Kafka sink commits)
            (source,) = self._source_parts.values()
            self.keyed.write_partitions(self.keyed.capture_partitions(owned), source.snapshot()["offsets"])
        for partition in owned:
            self.partition_states.release(partition)
        log.info("input partitions %s revoked: their state is checkpointed and released", partitions)
        self.keyed.drop_partitions(partitions)

    # -- control ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop reading sources; everything already read is processed and written (a drain)."""
        self._stop.set()

    @property
    def errors(self) -> list[BaseException]:
        """Fatal errors raised by tasks (operator errors on rows are dead letters, not these)."""
        return list(self._errors)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Open sources (forking source processes while this is the only thread), then start."""
        self._build()
        if self.partition_states is not None:
            self._follow_partitions()
        if self.state_store is not None:  # what came after the restored checkpoint never happened
            self.state_store.discard_after(self._restore.id if self._restore is not None else 0)
            self.keyed.page_from_store()
        if self._restore is not None:
            self.keyed.restore(self._restore)
        try:
            for sid, node in self._nodes.items():
                if node.kind == "source":
                    self._source_parts[sid] = self._open_source(node)
        except BaseException:
            for part in self._source_parts.values():
                part.close()
            raise
        for sink in self._sink_parts.values():
            sink.bind_sources(self._source_parts)
        for batcher in self.batchers.values():
            batcher.start()
        for sid, node in self._nodes.items():
            if node.kind == "source":
                target: Callable[..., None] = self._source_task
                args: tuple[Any, ...] = (node,)
            elif not self._chained(sid):
                target, args = self._chain_task, (sid,)
            else:
                continue
            t = threading.Thread(target=target, args=args, name=f"aisp-{sid}", daemon=True)
            self._threads.append(t)
        self.stats.started_ns = time.monotonic_ns()
        self._sources_running = len(self._source_parts)
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the drain to finish; True when every task ended."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self._threads:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            t.join(remaining)
        done = not any(t.is_alive() for t in self._threads)
        if done and self.stats.ended_ns is None:
            self.stats.ended_ns = time.monotonic_ns()
            try:
                if self.on_drained is not None and not self._errors:
                    self.on_drained()
            finally:
                for source in self._source_parts.values():
                    source.close()
                for part in self._sink_parts.values():
                    part.close()
                self.dead_letter.flush()
        return done

    def run(self) -> RunStats:
        self.start()
        self.join()
        if self._errors:
            err = self._errors[0]
            if isinstance(err, AispError):
                raise err
            raise AispError(f"pipeline {self.graph.name!r} failed: {type(err).__name__}: {err}") from err
        return self.stats
