"""What drives a run besides its executor: periodic checkpoints (``Checkpointer``), signals
(``install_signals``), GC tuning (``tune_gc``), and topology updates of a running run
(``RunUpdates``).

A topology update of ``aisp run`` (SIGHUP, with ``--checkpoint-dir``) replaces the running graph
by a new version of the pipeline file at a checkpoint:

1. the new version is loaded (bound to the run's input and output as the first one was), built
   and checked; a failure leaves the running graph as it is, with the reason in the log;
2. the running graph takes a checkpoint and stays paused after it: every row read so far is
   written, and the state of every step and the positions of sources, sinks and dead letters
   are on disk;
3. it stops without emitting its open windows (they are in the checkpoint: ``hand_over``);
4. the new graph starts from that checkpoint as from a savepoint (``carry_checkpoint``): the
   state of the steps it keeps (or migrates), the sources reading on from their positions, the
   sinks and dead letters writing on where they were; new steps start empty;
5. if the new graph cannot start, the old version starts again from the same checkpoint.

It needs the state in the checkpoint files (not ``--state-store``, ``--partition-state`` or
``--workers N``). A served pipeline switches graphs without stopping (``aisp.serve.pipelines.topology``).
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from aisp.errors import ConfigError
from aisp.graph import Graph
from aisp.observe.clock import wall_ms
from aisp.schedule.checkpointing.savepoints import carry_checkpoint
from aisp.schedule.executor import LocalExecutor
from aisp.state.checkpoint import Checkpoint, CheckpointStore

__all__ = ["Checkpointer", "RunUpdates", "install_signals", "tune_gc"]

log = logging.getLogger("aisp.runner")

BuildExecutor = Callable[[Graph, Checkpoint, Any], LocalExecutor]
"""(graph, restore point, the running graph's dead-letter writer) -> a new executor, not started."""


class Checkpointer:
    """Takes a checkpoint every ``interval_s`` (when the run has a checkpoint store), and sooner
    when the keyed state's hot layer outgrew its bound (a checkpoint is where keys are evicted),
    but not within ``min_gap_s`` of the previous one. A run that did not start from a checkpoint
    takes its first at once: a restart after a crash before it would otherwise start afresh,
    with no sink position to tell what the crashed run wrote already (a Kafka output counts on
    one)."""

    def __init__(
        self, ex: LocalExecutor, store: CheckpointStore | None, interval_s: float, min_gap_s: float = 0.1
    ) -> None:
        self._ex, self._store, self._interval = ex, store, interval_s
        self._min_gap = min(min_gap_s, interval_s)
        self._last = time.monotonic() - (0.0 if ex.restored else interval_s)

    def poll(self) -> None:
        if self._store is None or self._ex.stopping:
            return
        since = time.monotonic() - self._last
        if since < self._interval and not (since >= self._min_gap and self._ex.keyed.over_bound()):
            return
        if self._ex.checkpoints.checkpoint(self._store) is None:
            log.warning("checkpoint skipped: the pipeline did not go quiet in time")
        self._last = time.monotonic()


class RunUpdates:
    """Topology updates of a running run (see the module docstring): ``request`` (SIGHUP) asks
    for one; the run's loop calls ``apply`` with the running executor between its polls."""

    def __init__(
        self,
        pipeline: Any,
        reload: Callable[[], Any],
        store: CheckpointStore,
        build: BuildExecutor,
        check: Callable[[Graph], None],
    ) -> None:
        self.pipeline = pipeline
        """The running version (``aisp.pipeline.Pipeline``)."""
        self._reload, self._store, self._build, self._check = reload, store, build, check
        self._requested = threading.Event()
        self.version = 1
        self.history: list[dict[str, Any]] = []
        """Each update, applied or failed, with its report."""
        self.restored: Checkpoint | None = None
        """The checkpoint the running graph started from at the last switch."""

    def request(self) -> None:
        self._requested.set()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def apply(self, ex: LocalExecutor) -> LocalExecutor:
        """The running executor after the requested update: a new one, or ``ex`` when the new
        version failed before the switch (it keeps running)."""
        self._requested.clear()
        t0 = time.monotonic()
        try:
            new, graph = self._load(ex.graph.name)
        except Exception as exc:  # noqa: BLE001 - a bad new version leaves the run as it is
            return self._failed(ex, f"{type(exc).__name__}: {exc}")
        paused_at = time.monotonic()
        checkpoint_id = ex.checkpoints.checkpoint(self._store, stay_paused=True)
        if checkpoint_id is None:
            return self._failed(ex, "the pipeline did not go quiet in time; nothing changed")
        for window_step in ex.windows.values():  # their open windows are in the checkpoint
            window_step.hand_over()
        ex.on_drained = None  # the checkpoint just taken is where the next graph starts
        ex.request_stop()
        ex.flight.resume()
        ex.join()
        found = self._store.latest()
        assert found is not None and found.id == checkpoint_id
        try:
            restore, report = carry_checkpoint(found, graph, new.migrations, outputs=True)
            started = self._start(graph, restore, ex, self.version + 1)
        except Exception as exc:  # noqa: BLE001 - the old version goes on from the same checkpoint
            log.exception("topology update failed at the switch, restarting the running version")
            self.history.append({"version": self.version, "failed": f"{type(exc).__name__}: {exc}"})
            old_graph = self.pipeline.build()
            old, _ = carry_checkpoint(found, old_graph, {}, outputs=True)
            return self._start(old_graph, old, ex, self.version)
        self.pipeline = new
        self.version += 1
        entry = {
            "version": self.version,
            "at_ms": wall_ms(),
            "checkpoint": checkpoint_id,
            "steps": [n.step_id for n in graph.nodes],
            "paused_ms": round((time.monotonic() - paused_at) * 1000, 3),
            "took_ms": round((time.monotonic() - t0) * 1000, 3),
            **report,
        }
        self.history.append(entry)
        log.info("graph version %d running (events before: %d): %s", self.version, ex.stats.events_in, entry)
        return started

    def _load(self, name: str) -> tuple[Any, Graph]:
        """The new version and its graph, built and checked."""
        new = self._reload()
        graph = new.build()
        if graph.name != name:
            raise ConfigError(f"the new pipeline is {graph.name!r}; this run runs {name!r}")
        self._check(graph)
        return new, graph

    def _start(self, graph: Graph, restore: Checkpoint, old: LocalExecutor, version: int) -> LocalExecutor:
        new = self._build(graph, restore, old.dead_letter)
        self.restored = restore
        new.tracer = old.tracer
        new.graph_version, new.graph_updates = version, self.history  # type: ignore[attr-defined]
        new.start()
        return new

    def _failed(self, ex: LocalExecutor, reason: str) -> LocalExecutor:
        self.history.append({"version": self.version, "failed": reason})
        log.warning("topology update failed, the running graph stays: %s", reason)
        return ex


def install_signals(
    stop: Callable[[], None], update: Callable[[], None] | None = None
) -> Callable[[], None] | None:
    """SIGINT/SIGTERM call ``stop`` (a drain), SIGHUP ``update`` when given; returns what
    restores the previous handlers (None off the main thread, where signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP and update is not None:
            update()
        else:
            stop()

    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if update is not None else [])
    old = {s: signal.signal(s, handler) for s in signals}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


def tune_gc() -> Callable[[], None]:
    """Freeze what exists and collect young objects less often while the pipeline (or the
    server) runs; returns what undoes it.

    Decoding creates and frees many short-lived objects; the default threshold (700) runs a
    collection every few hundred rows. Measured on workload F: 10.5 -> 7.1 us per event; on
    ``aisp serve`` at 256 connections, p99 66-79 -> 40 ms and 7.6-8.8k -> 9.0-9.2k infer/s.
    """
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)

    def restore() -> None:
        gc.set_threshold(*old)
        gc.unfreeze()

    return restore
