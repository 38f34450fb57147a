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
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from aisp.batch import PARTIAL, Batch
from aisp.errors import AispError, SinkError, StateError
from aisp.graph import Graph, Node
from aisp.infer.batching.batcher import DynamicBatcher
from aisp.infer.llm.stage import LlmStage
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.observe.drift import DriftMonitor
from aisp.observe.stats import RunStats, StageStats
from aisp.schedule import planning
from aisp.schedule.channel import Channel
from aisp.schedule.checkpointing.coordinator import CheckpointCoordinator, Flight
from aisp.schedule.checkpointing.keyed_state import KeyedStateKeeper
from aisp.schedule.config import ExecutorOptions, Lineage
from aisp.schedule.model_steps import StepPort, make_batcher, make_llm
from aisp.schedule.ops import InferOp, LlmOp, SinkOp, can_fork, offloaded, resolve_alert
from aisp.schedule.pacing import Pacer
from aisp.schedule.planning import MODEL_KINDS
from aisp.schedule.watermarks import SourceClocks
from aisp.sinks.base import Sink, SinkPartition
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.sinks.process import ProcessSink
from aisp.state.checkpoint import Checkpoint
from aisp.state.keyed import KeyIndex
from aisp.state.partitions import PartitionStateStore
from aisp.state.store import LmdbStateStore
from aisp.transform.operators import Operator, OperatorContext
from aisp.transform.windows.base import WindowsBase

if TYPE_CHECKING:
    from aisp.observe.tracing.spans import EventTracer

__all__ = ["ExecutorOptions", "Lineage", "LocalExecutor"]

log = logging.getLogger("aisp.executor")


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
        partition_states: PartitionStateStore | None = None,
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
        self._task_of = planning.assign_tasks(self._nodes, self._consumers)
        self._channels: dict[str, Channel] = {}
        self._ops: dict[str, Operator] = {}
        self._pending_inputs: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._nested = threading.local()
        """``ns``: nanoseconds of pushes nested in the current one (a model run inline hands
        its results downstream before it returns), kept out of its stage's busy time."""
        self._key_indexes: dict[str, KeyIndex] = {}
        self._sink_parts: dict[str, SinkPartition] = {}
        self._source_parts: dict[str, SourcePartition] = {}
        self.batchers: dict[str, DynamicBatcher] = {}
        self.llm_stages: dict[str, LlmStage] = {}
        self._restore = restore
        self.clocks = SourceClocks({sid: n for sid, n in self._nodes.items() if n.kind == "source"}, graph)
        """Event time and watermarks of the sources that have them."""
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
        self.flight = Flight(self._stop, self._errors, self.keyed.full)
        """Rows in flight and the pause sources obey between batches: a checkpoint's barrier."""
        self.checkpoints = CheckpointCoordinator(
            graph.name, self.flight, ops=self._ops, key_indexes=self._key_indexes,
            source_parts=self._source_parts, sink_parts=self._sink_parts, batchers=self.batchers,
            dead_letter=dead_letter, stats=self.stats, keyed=self.keyed, state_store=state_store,
            partition_states=partition_states, state_max_keys=self.options.state_max_keys,
            clocks=self.clocks,
        )  # fmt: skip
        """Checkpoints, and keyed state that follows input partitions."""
        self.throttle: Callable[[int, threading.Event], None] | None = None
        """Called before a source hands on rows: waits while a controlled rate has no room."""
        self.on_drained: Callable[[], object] | None = None
        """Called once when every task has ended, before sources and sinks close (a final
        checkpoint: positions at the end of what was read, acks to brokers)."""

    # -- planning -----------------------------------------------------------------------------
    def _chained(self, step_id: str) -> bool:
        return self._task_of[step_id] != step_id

    def thread_of(self) -> dict[str, str]:
        """Step id -> the thread (group) that does its work (see ``planning.thread_of``): a
        model most of whose calls ran in the thread that fed it counts as that thread's."""
        inline = [sid for sid, b in self.batchers.items() if 2 * b.stats.inline_batches > b.stats.batches]
        return planning.thread_of(self._nodes, self._task_of, inline)

    def tasks(self) -> dict[str, list[str]]:
        """Task id -> the step ids it runs, in order."""
        return planning.tasks(self._nodes, self._task_of)

    # -- building -----------------------------------------------------------------------------
    def _dead_letter_rows(
        self, batch: Batch, step: str, reason: str, fields: Mapping[str, Sequence[Any]] | None = None,
        *, closes: bool = True,
    ) -> None:  # fmt: skip
        """Rows that leave the pipeline here: a failed batch, the batcher's expired rows, or
        (``closes`` False) rows an operator dead-letters itself, which are also missing from its
        output, where their branch is counted as closed."""
        self.dead_letter.rows(batch, step, reason, fields)
        if closes:
            self.flight.landed(-batch.num_rows)
        if self.lineage is not None:
            self.lineage.failed(step, batch, reason, closes=closes)
        if self.tracer is not None and self.tracer.active:
            self.tracer.failed(step, batch, reason)

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
                if self.options.offload_sinks and spec.encode_heavy and can_fork(sid):
                    spec = ProcessSink(inner=spec)
                position = self._restore.meta["sinks"].get(sid) if self._restore is not None else None
                part = spec.open() if position is None else spec.resume(position)
                self._sink_parts[sid] = part
                self._ops[sid] = SinkOp(part, self.stats)
            elif node.kind == "infer":
                self.batchers[sid] = make_batcher(self._model_port(sid), node.spec, st)
                self._ops[sid] = InferOp(self.batchers[sid], sid, node.spec)
            elif node.kind == "llm":
                self.llm_stages[sid] = make_llm(self._model_port(sid), node.spec, st)
                self._ops[sid] = LlmOp(self.llm_stages[sid])
            else:
                ctx = OperatorContext(
                    sid, partial(self._dead_letter_rows, closes=False), self._key_indexes, resolve_alert
                )
                self._ops[sid] = node.spec.build(ctx)

    def _model_port(self, sid: str) -> StepPort:
        """What model step ``sid`` may do to this executor (its rows come from threads of its own)."""
        ch = self._channels.get(sid)

        def traced(batch: Batch, wait_ns: int, compute_ns: int) -> None:
            if self.tracer is not None and self.tracer.active:  # the tracer may be set after the build
                self.tracer.model_out(sid, batch, wait_ns, compute_ns)

        return StepPort(
            emit=partial(self._emit, sid, "out"),
            dead_letter=lambda b, reason: self._dead_letter_rows(b, sid, reason),
            fail=self._fail, landed=self.flight.landed, traced=traced,
            queued_rows=lambda: ch.rows if ch else 0,
        )  # fmt: skip

    def _fail(self, exc: BaseException) -> None:
        """Record ``exc`` (``run()`` raises it after the drain) and stop the run."""
        self._errors.append(exc)
        self._stop.set()

    # -- data flow ----------------------------------------------------------------------------
    def _push(self, sid: str, batch: Batch) -> None:
        nested = self._nested
        outer, nested.ns = getattr(nested, "ns", 0), 0
        entered = time.perf_counter_ns()
        try:
            self._push_timed(sid, batch)
        finally:  # the caller's stage did not spend this push's time
            nested.ns = outer + time.perf_counter_ns() - entered

    def _push_timed(self, sid: str, batch: Batch) -> None:
        st = self.stats.stages[sid]
        st.rows_in += batch.num_rows
        kind = self._nodes[sid].kind
        if PARTIAL in batch and kind != "sink":  # pieces of results (tokens) pass on unchanged
            st.rows_out += batch.num_rows
            return self._emit(sid, self._nodes[sid].ports[0], batch)
        traced = batch.traced  # sampled events (set at ingest when tracing)
        if traced is not None and self.tracer is not None:
            self.tracer.entered(sid, kind, traced, batch)
            traced_from = time.monotonic_ns()
        op = self._ops[sid]
        model = op.batcher if isinstance(op, InferOp) else None
        not_work = model.not_work_ns() if model is not None else 0
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            outs = op.process(batch)
        except (SinkError, StateError):
            raise  # a sink that gave up (its broker stayed away), state that cannot be kept: fatal
        except Exception as exc:  # noqa: BLE001 - rows go to the dead-letter sink, the pipeline goes on
            st.errors += 1
            self._dead_letter_rows(batch, sid, f"{type(exc).__name__}: {exc}")
            return
        finally:
            took = time.perf_counter_ns() - t0 - self._nested.ns
            if model is not None:  # its calls are counted by on_batch; a full queue is not work
                took -= model.not_work_ns() - not_work
            st.busy_ns += took
        if kind not in MODEL_KINDS:  # a model's phases come from its batcher
            st.cpu_ns += time.thread_time_ns() - c0
            st.batches += 1
            st.phase("serialize" if kind == "sink" else "compute", took)
            st.batch_rows.record_one(batch.num_rows)
        if kind == "sink":
            self.flight.landed(-batch.num_rows)
        elif kind not in MODEL_KINDS:
            self.flight.landed(sum(o.num_rows for _, o in outs) - batch.num_rows)
        if traced is not None and kind not in MODEL_KINDS and self.tracer is not None:
            self.tracer.left(sid, kind, traced, traced_from, batch.num_rows, outs)
        if self.lineage is not None:
            if kind == "sink":
                self.lineage.written(sid, batch)
            elif kind not in MODEL_KINDS:  # a model's rows move on from its own threads, one out per in
                self.lineage.forwarded(sid, batch, outs)
        for port, out in outs:
            if kind not in MODEL_KINDS:
                st.rows_out += out.num_rows
            self._emit(sid, port, out)

    def _emit(self, sid: str, port: str, batch: Batch) -> None:
        consumers = self._consumers.get((sid, port), ())
        if len(consumers) != 1:  # each consumer gets its own copy
            self.flight.landed(batch.num_rows * (len(consumers) - 1))
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
                self._emit_made(sid, self._ops[sid].flush())
            except Exception as exc:  # noqa: BLE001 - a failing flush must not stop the drain
                self._errors.append(exc)
        for port in node.ports:
            for consumer in self._consumers.get((sid, port), ()):
                if self._chained(consumer):
                    self._pending_inputs[consumer] -= 1
                    if self._pending_inputs[consumer] == 0:
                        self._finish(consumer)
                else:
                    self._channels[consumer].close_producer()

    def _emit_made(self, sid: str, outs: list[tuple[str, Batch]]) -> None:
        """Rows an operator made outside a batch (windows at the end, or as event time moves)."""
        self.flight.landed(sum(out.num_rows for _, out in outs))
        for port, out in outs:
            self.stats.stages[sid].rows_out += out.num_rows
            self._emit(sid, port, out)

    def _event_time_moved(self, sid: str) -> None:
        """(The only source, nothing to read) windows close as event time moves on without
        rows (``SourceClocks.moved``), each once the rows before it landed."""
        windows = self.windows
        wm = self.clocks.moved(sid) if len(self._source_parts) == 1 and windows else None
        if wm is None:
            return
        for wid, op in windows.items():
            self.flight.drain()
            if not self.flight.consistent():
                return
            self._emit_made(wid, op.advance(wm))

    # -- tasks --------------------------------------------------------------------------------
    def _open_source(self, node: Node) -> SourcePartition:
        spec: Source = offloaded(node.spec, node.step_id) if self.options.offload_sources else node.spec
        position = self._restore.meta["sources"].get(node.step_id) if self._restore is not None else None
        if self.partition_states is not None:  # positions come with each partition's state
            ctx = self.checkpoints.source_context(
                node.step_id, self._source_dead_letters, self.options.read_rows
            )
            return spec.open(ctx, resume_from=None)
        ctx = SourceContext(node.step_id, self._source_dead_letters, self.options.read_rows)
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
            self._fail(exc)
        finally:
            self.flight.source_ended()
            self.clocks.ended(node.step_id)
            self._finish(node.step_id)  # the partition stays open for a final checkpoint

    def _pump(self, node: Node, part: SourcePartition, st: StageStats) -> None:
        rate = self.options.rate_events_per_s
        pacer: Pacer | None = None  # the schedule starts when the first rows are in hand
        held: Batch | None = None
        read_started = time.monotonic_ns()
        while not self._stop.is_set():
            if held is None or held.num_rows == 0:
                if self.flight.paused:
                    self.flight.wait_while_paused()
                    continue
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                read_started = time.monotonic_ns()
                held = part.next_batch(self.options.read_rows)
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
                    self._event_time_moved(node.step_id)
                    continue
            if rate <= 0:
                out, held = held, None
            else:
                pacer = pacer or Pacer(rate, self.options.paced_linger_ms, time.monotonic_ns())
                out, held = pacer.due(held, self._stop)
                if not out.num_rows:
                    continue
            if self.throttle is not None:  # a controlled rate (anomaly control): read slower
                self.throttle(out.num_rows, self._stop)
            if self.clocks:  # event time and watermarks; rows without event time are dead letters
                out = self.clocks.stamp(node.step_id, out, self.stats, self.dead_letter)
            st.rows_out += out.num_rows
            st.batches += 1
            self.stats.events_in += out.num_rows
            self.flight.landed(out.num_rows)
            if self.tracer is not None:
                self.tracer.ingest(node.step_id, out, read_started)
            self._emit(node.step_id, "out", out)

    def _chain_task(self, sid: str) -> None:
        ch = self._channels[sid]
        try:
            st = self.stats.stages[sid]
            models = any(self._nodes[s].kind == "infer" for s in self.tasks()[sid])
            most = 0 if models else self.options.coalesce_rows  # a batcher makes its own batches
            while (batch := ch.get(most)) is not None:
                st.phase("queue", ch.last_wait_ns)
                self._push(sid, batch)
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by run() after the drain
            self._fail(exc)
            while ch.get() is not None:  # keep upstream from blocking forever
                pass
        finally:
            self._finish(sid)

    # -- what observers read (checkpoints: ``self.checkpoints``) -------------------------------
    @property
    def drift_monitors(self) -> list[DriftMonitor]:
        """The drift monitors of infer steps (those that have seen data)."""
        return [op.drift for op in self._ops.values() if isinstance(op, InferOp) and op.drift is not None]

    @property
    def restored(self) -> bool:
        """Whether the run started from a checkpoint."""
        return self._restore is not None

    @property
    def windows(self) -> dict[str, WindowsBase]:
        """The window steps (open windows, late events, watermark)."""
        return {sid: op for sid, op in self._ops.items() if isinstance(op, WindowsBase)}

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
            self.checkpoints.follow_partitions([n.spec for n in self._nodes.values() if n.kind == "source"])
        if self.state_store is not None:  # what came after the restored checkpoint never happened
            self.state_store.discard_after(self._restore.id if self._restore is not None else 0)
            self.keyed.page_from_store()
        if self._restore is not None:
            self.keyed.restore(self._restore)
            self.clocks.restore(self._restore.meta.get("watermarks", {}))
        try:
            for sid, node in self._nodes.items():
                if node.kind == "source":
                    self._source_parts[sid] = self._open_source(node)
        except BaseException:
            for part in self._source_parts.values():
                part.close()
            raise
        self.checkpoints.bind_sinks()
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
        self.flight.sources_started(len(self._source_parts))
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
                self.checkpoints.close()
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
