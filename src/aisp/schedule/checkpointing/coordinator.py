"""Checkpoints of a running pipeline, and keyed state that follows Kafka partitions.

``Flight`` is the barrier: it counts the rows in flight (read, not yet written, dropped or
dead-lettered) and holds the pause that sources obey between batches. The executor reports to
it; ``CheckpointCoordinator`` uses it and owns what happens around it. A checkpoint, in order:

1. the barrier: the sources pause between batches and the rows in flight finish;
2. capture, under the pause, only copies or views that stay valid: operator state and key spaces
   (or, with a state store, the keys and windows that changed), source, sink and dead-letter
   positions, each model step's version and weights hash (``model_steps.model_record``);
3. the sources resume;
4. beside the running pipeline: the captured views become Arrow tables, sinks and dead letters
   sync to disk, the state store writes the changed keys, the checkpoint's files and then its
   manifest are written, then per-partition state (state in changelogs goes first, before a
   transactional Kafka output commits the input offsets with its outputs: a changelog record
   counts only once the group's commit reaches the offset it covers);
5. the sources are told (brokers acknowledge up to there).

If the pipeline does not go quiet in time nothing is written. Partition handoff (a Kafka
rebalance): a partition taken away has what is in flight drained, then its state written; one
assigned is restored in the background (``restores``) and loaded between batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from aisp.errors import ConfigError
from aisp.graph import Graph
from aisp.infer.batching.batcher import DynamicBatcher
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.observe.stats import RunStats
from aisp.schedule.checkpointing.keyed_state import KeyedStateKeeper, PartitionCapture
from aisp.schedule.checkpointing.restores import Restores
from aisp.schedule.model_steps import model_record
from aisp.schedule.watermarks import SourceClocks
from aisp.sinks.base import SinkPartition
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.state.checkpoint import CheckpointStore
from aisp.state.keyed import KeyIndex
from aisp.state.partitions import PartitionStates, PartitionStateStore
from aisp.state.store import LmdbStateStore
from aisp.transform.operators import Checkpointable, IncrementalState, LoggedState, Operator

__all__ = ["CheckpointCoordinator", "Flight"]

log = logging.getLogger("aisp.executor")

REVOKE_DRAIN_S = 20.0
"""How long a revoke waits for the rows in flight before it gives the partitions up unwritten."""


class Flight:
    """Rows in flight and the pause sources obey between batches (see the module docstring).

    ``full`` says when keyed state is over its bound: sources wait then too, until a
    checkpoint evicts.
    """

    def __init__(self, stop: threading.Event, errors: list[BaseException], full: Callable[[], bool]) -> None:
        self._stop, self._errors, self._full = stop, errors, full
        self._cond = threading.Condition()
        self._in_flight = 0
        self._pause = False
        self._sources_waiting = 0
        self._sources_running = 0

    def landed(self, rows: int) -> None:
        """``rows`` more (or, negative, fewer) rows are in flight."""
        if rows:
            with self._cond:
                self._in_flight += rows
                if self._in_flight <= 0:
                    self._cond.notify_all()

    def sources_started(self, n: int) -> None:
        self._sources_running = n

    def source_ended(self) -> None:
        with self._cond:
            self._sources_running -= 1
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether a source should wait before its next batch."""
        return self._pause or self._full()

    def wait_while_paused(self) -> None:
        """(A source, between batches) wait while the pause lasts."""
        with self._cond:
            self._sources_waiting += 1
            self._cond.notify_all()
            while (self._pause or self._full()) and not self._stop.is_set():
                self._cond.wait(0.05)
            self._sources_waiting -= 1

    def quiesce(self, timeout_s: float) -> bool:
        """Pause the sources between batches and wait until no row is in flight."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._pause = True
            while self._sources_waiting < self._sources_running or self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def pause(self) -> None:
        """Hold the sources between batches (without waiting for the rows in flight)."""
        with self._cond:
            self._pause = True

    def resume(self) -> None:
        with self._cond:
            self._pause = False
            self._cond.notify_all()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every row read so far is written, dropped or dead-lettered (called by the
        only source, which reads nothing meanwhile), or ``timeout_s`` passed (``consistent``
        then says no)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight > 0 and not self._stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    return
                self._cond.wait(0.05)

    def consistent(self) -> bool:
        """No task failed and no row is in flight: state and positions agree."""
        with self._cond:
            return not self._errors and self._in_flight == 0


class CheckpointCoordinator:
    """Checkpoints (see the module docstring) and partition handoff, over the executor's
    operators, key spaces, source and sink partitions and keyed-state keeper."""

    def __init__(
        self,
        pipeline: str,
        flight: Flight,
        *,
        ops: Mapping[str, Operator],
        key_indexes: Mapping[str, KeyIndex],
        source_parts: Mapping[str, SourcePartition],
        sink_parts: Mapping[str, SinkPartition],
        batchers: Mapping[str, DynamicBatcher],
        dead_letter: DeadLetterWriter,
        stats: RunStats,
        keyed: KeyedStateKeeper,
        state_store: LmdbStateStore | None,
        partition_states: PartitionStateStore | None,
        state_max_keys: int,
        clocks: SourceClocks | None = None,
    ) -> None:
        self.pipeline, self.flight = pipeline, flight
        self._ops, self._key_indexes = ops, key_indexes
        self._source_parts, self._sink_parts, self._batchers = source_parts, sink_parts, batchers
        self._dead_letter, self._stats, self.keyed = dead_letter, stats, keyed
        self.state_store, self.partition_states = state_store, partition_states
        self._state_max_keys = state_max_keys
        self._clocks = clocks
        self._loaded: set[int] = set()
        self._restores = (
            Restores(partition_states.claim, partition_states.release)
            if partition_states is not None
            else None
        )

    def checkpoint(
        self,
        store: CheckpointStore,
        *,
        timeout_s: float = 10.0,
        checkpoint_id: int | None = None,
        stay_paused: bool = False,
    ) -> int | None:
        """Take a checkpoint (numbered ``checkpoint_id``, else the store's next); returns its id,
        or None when the pipeline did not go quiet within ``timeout_s`` (then nothing is written).
        ``stay_paused``: the sources stay paused after a checkpoint taken (a graph that hands its
        state over to another, which starts from it)."""
        taken = False
        try:
            if not self.flight.quiesce(timeout_s):
                return None
            captured = self._capture()
            taken = True
        finally:
            if not (taken and stay_paused):
                self.flight.resume()
        return self._write(store, *captured, checkpoint_id=checkpoint_id)

    def savepoint(self, timeout_s: float) -> dict[str, dict[str, Any]] | None:
        """Pause the sources, wait for the rows in flight, and return each operator's state
        columns (rows in key code order for keyed steps), leaving the sources paused: what a
        topology update carries to the next graph, which shares the key indexes; None,
        resumed, when the pipeline did not go quiet within ``timeout_s``."""
        if not self.flight.quiesce(timeout_s):
            self.flight.resume()
            return None
        return {sid: op.snapshot() for sid, op in self._ops.items() if isinstance(op, Checkpointable)}

    def _capture(self) -> tuple[Any, ...]:
        """(Under the pause) copies, or views that stay valid; conversions come after."""
        columns_of: dict[str, dict[str, Any]] = {}
        key_views: dict[str, Callable[[], pa.Array]] = {}
        dirty: dict[str, tuple[Callable[[], pa.Array], dict[str, Any]]] = {}
        logged: dict[str, tuple[dict[str, Any], Any, bool]] = {}
        if self.state_store is not None:  # only the keys (and windows) that changed, written below
            for sid, op in self._ops.items():
                if isinstance(op, IncrementalState):
                    codes, columns = op.take_dirty()
                    dirty[sid] = (op.index.frozen_keys(codes), columns)
                elif isinstance(op, LoggedState):
                    base = self.keyed.base_due(sid, op.open_windows)
                    logged[sid] = (*op.changes(everything=base), base)
            if self._state_max_keys:
                self.keyed.evict()
        elif self.partition_states is None:
            key_views = {space: index.frozen_keys() for space, index in self._key_indexes.items()}
        for index in self._key_indexes.values():
            index.advance()
        for sid, op in self._ops.items():
            keyed_elsewhere = self.partition_states is not None and isinstance(
                op, IncrementalState | LoggedState
            )
            if (
                isinstance(op, Checkpointable)
                and sid not in dirty
                and sid not in logged
                and not keyed_elsewhere
            ):
                columns_of[sid] = op.snapshot()
        sources = {sid: part.snapshot() for sid, part in self._source_parts.items()}
        partitions = self._capture_partitions(self.loaded) if self.partition_states else {}
        meta = {
            "pipeline": self.pipeline,
            "sources": sources,
            "sinks": {sid: part.snapshot() for sid, part in self._sink_parts.items()},
            "models": model_record({sid: b.runtime for sid, b in self._batchers.items()}),
            "dead_letter_bytes": self._dead_letter.snapshot(),
            "events_in": self._stats.events_in,
        }
        if self._clocks:
            meta["watermarks"] = self._clocks.snapshot()
        return columns_of, key_views, (dirty, logged), sources, partitions, meta

    def _write(
        self,
        store: CheckpointStore,
        columns_of: dict[str, dict[str, Any]],
        key_views: dict[str, Callable[[], pa.Array]],
        changes: tuple[dict[str, tuple[Callable[[], pa.Array], dict[str, Any]]], dict[str, Any]],
        sources: dict[str, Any],
        partitions: dict[int, Any],
        meta: dict[str, Any],
        *,
        checkpoint_id: int | None = None,
    ) -> int:
        """(Beside the running pipeline) the durable part of a checkpoint; its id."""
        started = time.monotonic()
        tables = {f"keys.{space}": pa.table({"key": view()}) for space, view in key_views.items()}
        tables.update({f"op.{sid}": pa.table(columns) for sid, columns in columns_of.items()})
        dirty, logged = changes
        changed = {sid: (keys(), columns) for sid, (keys, columns) in dirty.items()}
        offsets = next(iter(sources.values()))["offsets"] if partitions else {}
        early = (
            bool(partitions)
            and self.partition_states is not None
            and self.partition_states.written_before_outputs
        )
        if early:  # before a transactional Kafka output commits the input offsets with the outputs
            self.keyed.write_partitions(partitions, offsets)
        for sink in self._sink_parts.values():
            sink.sync()
        self._dead_letter.sync()
        if checkpoint_id is None:
            checkpoint_id = store.next_id()
        if self.state_store is not None:  # every 10th drops what no kept checkpoint reads
            kept = store.ids()
            before = kept[0] if kept and checkpoint_id % 10 == 0 else 0
            meta["state_store"] = self.keyed.write_to_store(checkpoint_id, changed, before, logged)
        store.write(checkpoint_id, tables, meta)
        if partitions and not early:  # after the local manifest: the outputs they cover are durable
            self.keyed.write_partitions(partitions, offsets)
        for sid, part in self._source_parts.items():
            part.commit(sources[sid])
        self._stats.checkpoints += 1
        self._stats.checkpoint_s = time.monotonic() - started
        return checkpoint_id

    def bind_sinks(self) -> None:
        """Once sources and sinks are open: sinks that commit source offsets learn the sources,
        and the first transactional sink that can takes the writes of state that follows
        partitions into its transactions."""
        states = self.partition_states
        for sink in self._sink_parts.values():
            sink.bind_sources(self._source_parts)
            if states is not None and sink.take_state_writes(states):
                log.info("keyed state in changelogs is written in the output's transactions")
                states = None

    def commit_sources(self) -> None:
        """Tell every source that all it handed out is done (a drained run without checkpoints:
        brokers get their acks, at-least-once)."""
        for part in self._source_parts.values():
            part.commit(part.snapshot())

    # -- keyed state that follows input partitions ---------------------------------------------
    def follow_partitions(self, sources: Sequence[Source]) -> None:
        partition_of = getattr(sources[0], "partition_of", None) if len(sources) == 1 else None
        if partition_of is None:
            raise ConfigError("keyed state that follows input partitions needs a single Kafka input")
        self.keyed.follow_partitions(partition_of)
        if self._clocks:
            self._clocks.follow_partitions()

    def _capture_partitions(self, partitions: list[int]) -> PartitionCapture:
        return self.keyed.capture_partitions(partitions, self._clocks.newest if self._clocks else None)

    def source_context(
        self, step_id: str, dead_letter: Callable[[list[DeadLetterRecord]], None], batch_rows: int
    ) -> SourceContext:
        """The context of a source whose partitions bring their state with them."""
        return SourceContext(
            step_id,
            dead_letter,
            batch_rows,
            on_assign=self.partitions_assigned,
            restored=self.partitions_restored,
            on_revoke=self.partitions_revoked,
        )

    def partitions_assigned(self, partitions: list[int]) -> None:
        """Restore newly assigned partitions in the background (``restores``)."""
        assert self._restores is not None
        log.info("input partitions %s assigned: restoring their state", partitions)
        self._restores.start(partitions)

    def partitions_restored(self) -> dict[int, int | None]:
        """(The source thread, between batches) load the partitions restored since the last
        call; where to start each (None: where the group says)."""
        assert self._restores is not None
        ready = self._restores.take_ready()
        if not ready:
            return {}
        self.flight.drain()
        offsets: dict[int, int | None] = {}
        for partition, checkpoint in sorted(ready.items()):
            offsets[partition] = self.keyed.load_partition(partition, checkpoint) if checkpoint else None
            if self._clocks:  # event time read on from where the partition's state was taken
                self._clocks.take_over(partition, checkpoint.meta.get("event_time") if checkpoint else None)
            self._loaded.add(partition)
        log.info("input partitions %s restored", sorted(ready))
        return offsets

    @property
    def loaded(self) -> list[int]:
        """The partitions whose state is loaded (and checkpointed with the pipeline's)."""
        return sorted(self._loaded)

    def partitions_revoked(self, partitions: list[int]) -> None:
        """Flush the state of partitions taken away (outputs first), release them, drop their
        keys; cancel the restores of those not loaded yet. A failed run, a stop, or rows still in
        flight after ``REVOKE_DRAIN_S`` (a revoke must end well within the group's poll
        interval) write nothing: the last checkpoint stands, and the next owner replays from it."""
        assert self.partition_states is not None and self._restores is not None
        self._restores.cancel(partitions)
        self.flight.drain(REVOKE_DRAIN_S)
        owned = [p for p in partitions if p in self._loaded]
        if self.flight.consistent():
            (source,) = self._source_parts.values()
            offsets = source.snapshot()["offsets"]
            captured = self._capture_partitions(owned)
            early = self.partition_states.written_before_outputs
            if early:  # (see ``_write``)
                self.keyed.write_partitions(captured, offsets)
            for sink in self._sink_parts.values():
                sink.snapshot()  # the outputs their state covers are durable (a Kafka sink commits)
                sink.sync()
            if not early:
                self.keyed.write_partitions(captured, offsets)
            source.commit({"offsets": {p: o for p, o in offsets.items() if int(p) in owned}})
        for partition in owned:
            self.partition_states.release(partition)
            self._loaded.discard(partition)
        if self._clocks:  # what this process read of them no longer holds event time back
            for partition in partitions:
                self._clocks.take_over(partition, None)
        log.info("input partitions %s revoked: their state is checkpointed and released", partitions)
        self.keyed.drop_partitions(partitions)

    def close(self) -> None:
        """Stop restoring (a claim under way ends when its store closes)."""
        if self._restores is not None:
            self._restores.close(timeout_s=5.0)


CHANGELOG = "changelog"
"""``--partition-state`` that keeps keyed state in changelog topics on the input's broker."""


def open_partition_states(
    graph: Graph, where: str, *, keep: int = 3, standby_replicas: int = 0, local_dir: str | None = None
) -> PartitionStateStore:
    """Where keyed state that follows input partitions lives: ``CHANGELOG`` (changelog topics
    on the broker of the pipeline's Kafka input, with local copies in ``local_dir``), else a
    directory the group's processes share."""
    if where != CHANGELOG:
        return PartitionStates(where, keep=keep)
    from aisp.connectors.kafka import KafkaSource
    from aisp.connectors.kafka.changelog import ChangelogStates
    from aisp.connectors.kafka.client import security_settings

    sources = [n.spec for n in graph.nodes if n.kind == "source"]
    if len(sources) != 1 or not isinstance(sources[0], KafkaSource):
        raise ConfigError(
            "state in changelog topics needs a single Kafka input (kafka://HOST:PORT/TOPIC?group=G)"
        )
    src = sources[0]
    return ChangelogStates(
        src.bootstrap,
        src.group,
        src.topic,
        graph.name,
        standby_replicas=standby_replicas,
        local_dir=local_dir,
        security=security_settings(src.access, src.sasl),
    )
