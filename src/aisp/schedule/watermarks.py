"""The executor's event-time clocks: each source with an ``EventTime`` stamps its rows.

A source's watermark generator (``aisp.transform.windows.event_time``) gives the watermark before each
row from that source's partitions; with several sources, a row's watermark is also held back
by the other sources' current watermarks (the pipeline watermark is the minimum over every
partition of every source), except sources that have ended or stayed idle past their
``idle_timeout_ms``. The generators' state goes into checkpoints (``snapshot``/``restore``).

When state follows the input's partitions (``follow_partitions``), rows also carry their own
partition's watermark before them (``_partition_watermark``), ``_watermark`` is the one over the
partitions after each row (``WatermarkGenerator.partition_watermarks``), and each partition's
progress moves with its state: ``newest`` is written with it, ``take_over`` sets it when it is
loaded elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import EVENT_TIME, PARTITION_WATERMARK, WATERMARK, Batch
from aisp.errors import ConfigError
from aisp.graph import Graph, Node, split_ref
from aisp.observe.stats import RunStats
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.transform.windows.event_time import NO_WATERMARK, EventTime, WatermarkGenerator

__all__ = ["SourceClocks", "check_event_time_options"]


class SourceClocks:
    """Watermark generators of the sources that have event time, by step id."""

    def __init__(self, sources: Mapping[str, Node], graph: Graph | None = None) -> None:
        if graph is not None:
            _check_one_clock_per_input(graph)
        self._gens = {
            sid: WatermarkGenerator(node.event_time)
            for sid, node in sources.items()
            if isinstance(node.event_time, EventTime)
        }
        self._partition_of = {sid: getattr(sources[sid].spec, "partition_of", None) for sid in self._gens}
        self._current = dict.fromkeys(self._gens, NO_WATERMARK)
        self._last_ns = dict.fromkeys(self._gens, time.monotonic_ns())
        self._ended: set[str] = set()
        self._stamped = dict.fromkeys(self._gens, NO_WATERMARK)  # after the last rows stamped
        self._lock = threading.Lock()
        self._follow = False

    def __bool__(self) -> bool:
        return bool(self._gens)

    def stamp(self, sid: str, batch: Batch, stats: RunStats, dead_letter: DeadLetterWriter) -> Batch:
        """``batch`` with ``_event_time`` and ``_watermark``. Rows whose event time is missing or
        not a number cannot be placed in time: they are read (``stats.events_in``) and go to
        ``dead_letter``."""
        gen = self._gens.get(sid)
        if gen is None or not batch.num_rows:
            return batch
        now = time.monotonic_ns()
        spec = gen.spec
        if spec.column is None:
            event_ms = np.full(batch.num_rows, time.time_ns() // 1_000_000, dtype=np.int64)
        else:
            event_ms, ok = spec.event_ms(_column(batch, spec.column))
            if not ok.all():
                bad, batch = batch.filter(~ok), batch.filter(ok)
                event_ms = event_ms[ok]
                stats.events_in += bad.num_rows
                dead_letter.rows(bad, sid, f"event time {spec.column!r} is missing or not a finite number")
        partition_of = self._partition_of[sid]
        partitions = partition_of(batch.ids) if partition_of is not None and batch.num_rows else None
        columns: dict[str, Any] = {EVENT_TIME: event_ms}
        if self._follow and partitions is not None:
            with self._lock:
                wm, columns[PARTITION_WATERMARK] = gen.partition_watermarks(event_ms, partitions, now)
        else:
            wm = gen.watermarks(event_ms, partitions, now)
        with self._lock:
            self._last_ns[sid] = now
            self._stamped[sid], others = self._after(sid, gen, now)
        if others:
            wm = np.minimum(wm, min(others))
        columns[WATERMARK] = wm
        return batch.with_columns(columns)

    def moved(self, sid: str) -> int | None:
        """The watermark, when it moved on past the one after ``sid``'s last rows without rows
        of its own: a partition taken over or given up, one idle past ``idle_timeout_ms``,
        another source ended. Else None."""
        gen = self._gens.get(sid)
        if gen is None:
            return None
        with self._lock:
            wm, _ = self._after(sid, gen, time.monotonic_ns())
            if wm <= self._stamped[sid]:
                return None
            self._stamped[sid] = wm
        return wm

    def _after(self, sid: str, gen: WatermarkGenerator, now_ns: int) -> tuple[int, list[int]]:
        """(Under the lock) the pipeline watermark after ``sid``'s rows so far, and the other
        sources' that hold it back."""
        self._current[sid] = gen.watermark
        others = [w for s, w in self._current.items() if s != sid and self._holds(s, now_ns)]
        return min([self._current[sid], *others]), others

    def _holds(self, sid: str, now_ns: int) -> bool:
        """Whether source ``sid`` holds the pipeline watermark back."""
        if sid in self._ended:
            return False
        idle = self._gens[sid].spec.idle_timeout_ms
        return not idle or now_ns - self._last_ns[sid] < idle * 1e6

    def ended(self, sid: str) -> None:
        """Source ``sid`` has no more input: it no longer holds the watermark back."""
        with self._lock:
            self._ended.add(sid)

    def snapshot(self) -> dict[str, Any]:
        return {sid: gen.snapshot() for sid, gen in self._gens.items()}

    def restore(self, state: Mapping[str, Any]) -> None:
        if self._follow:  # each partition's progress comes with its state (``take_over``)
            return
        for sid, gen in self._gens.items():
            if sid in state:
                gen.restore(state[sid])
                self._current[sid] = gen.watermark

    # -- state that follows input partitions --------------------------------------------------
    def follow_partitions(self) -> None:
        """Stamp rows with their own partition's watermark too; partitions' progress moves with
        their state."""
        self._follow = True

    def newest(self, partition: int) -> dict[str, int]:
        """Per source, the largest event time read from ``partition`` so far."""
        with self._lock:
            out = {sid: gen.newest(partition) for sid, gen in self._gens.items()}
        return {sid: m for sid, m in out.items() if m is not None}

    def take_over(self, partition: int, newest: Mapping[str, int] | None) -> None:
        """``partition`` was loaded (``newest``: what it had read, by source) or taken away
        (None): it no longer holds the watermark back with what this process read of it."""
        with self._lock:
            for sid, gen in self._gens.items():
                gen.take_over(partition, (newest or {}).get(sid))


def _check_one_clock_per_input(graph: Graph) -> None:
    """A window step (and each side of a join) tracks one stream of watermarks: rows of two
    sources with event time, merged before it, may reach it out of order with each other's
    watermarks, so it is refused rather than judged late wrongly."""
    nodes = {n.step_id: n for n in graph.nodes}

    def clocks(step: str) -> set[str]:
        node = nodes[step]
        if node.kind == "source":
            return {step} if node.event_time is not None else set()
        if node.kind in ("window", "join"):
            return {step}  # its output is one stream of watermarks again
        return set().union(*(clocks(split_ref(ref)[0]) for ref in node.inputs))

    for node in graph.nodes:
        if node.kind not in ("window", "join"):
            continue
        for ref in node.inputs:
            upstream = clocks(split_ref(ref)[0])
            if len(upstream) > 1:
                raise ConfigError(
                    f"step {node.step_id!r} reads rows with event time from {sorted(upstream)}: a window"
                    " (or each side of a join) can follow one source's event time for now"
                )


def _column(batch: Batch, name: str) -> pa.Array:
    if name not in batch:
        return pa.nulls(batch.num_rows)
    return batch.column(name)


def check_event_time_options(
    graph: Graph, *, workers: int, state_max_keys: int, partition_state: bool
) -> None:
    """Event time and windows keep key codes and watermarks that these options would break: a
    clear error instead of a silent difference. (Window steps move with input partitions; a
    join's state does not yet.)"""
    if not any(n.kind in ("window", "join") or n.event_time is not None for n in graph.nodes):
        return
    unsupported = {
        "--workers N > 1": workers > 1,
        "--state-max-keys": state_max_keys > 0,
        "--partition-state": partition_state and any(n.kind == "join" for n in graph.nodes),
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ConfigError(f"event time and windows cannot be combined with {', '.join(named)} yet")
