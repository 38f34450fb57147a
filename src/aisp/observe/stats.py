"""Per-stage counters the executor updates and the live view, summary and metrics read."""

from __future__ import annotations

import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aisp.observe.latency import LatencyHistogram

__all__ = ["AdmissionStats", "LatencyTrail", "RunStats", "StageStats", "peak_rss_mb"]


@dataclass
class StageStats:
    """Counters for one stage. Updated by the stage's own thread; read racily by observers."""

    step_id: str
    kind: str
    rows_in: int = 0
    rows_out: int = 0
    batches: int = 0
    errors: int = 0
    busy_ns: int = 0
    """Wall time spent working on batches (reading, an operator, a write, a model call)."""
    cpu_ns: int = 0
    """The thread CPU time of that work, where the stage's own thread does it (not a model
    call: its runtime computes on threads of its own). Far below ``busy_ns``: the stage waits
    (on I/O, a lock, a remote peer)."""
    queue_rows: Callable[[], int] = field(default=lambda: 0, repr=False)
    phases: dict[str, LatencyHistogram] = field(default_factory=dict, repr=False)
    """Per-batch durations (ns) by phase: queue, batch, serialize, compute."""
    batch_rows: LatencyHistogram = field(default_factory=LatencyHistogram, repr=False)
    """Rows per batch."""

    PHASES = ("queue", "batch", "serialize", "compute")
    COUNTERS = ("rows_in", "rows_out", "batches", "errors", "busy_ns", "cpu_ns")
    """The counters that add up (across the workers of a run)."""

    def phase(self, name: str, ns: int) -> None:
        """Record one batch's time in phase ``name``."""
        hist = self.phases.get(name)
        if hist is None:
            hist = self.phases.setdefault(name, LatencyHistogram())
        hist.record_one(ns)

    def to_state(self) -> dict[str, Any]:
        """Everything, as plain data for another process (``from_state``)."""
        return {
            "step_id": self.step_id,
            "kind": self.kind,
            **{name: getattr(self, name) for name in self.COUNTERS},
            "queue_rows": self.queue_rows(),
            "phases": {name: h.to_dict() for name, h in list(self.phases.items())},
            "batch_rows": self.batch_rows.to_dict(),
        }

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> StageStats:
        queued = int(data["queue_rows"])
        return cls(
            step_id=data["step_id"],
            kind=data["kind"],
            **{name: data[name] for name in cls.COUNTERS},
            queue_rows=lambda: queued,
            phases={name: LatencyHistogram.from_dict(h) for name, h in data["phases"].items()},
            batch_rows=LatencyHistogram.from_dict(data["batch_rows"]),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_id,
            "kind": self.kind,
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "batches": self.batches,
            "errors": self.errors,
            "busy_s": round(self.busy_ns / 1e9, 3),
            "queue_rows": self.queue_rows(),
        }


@dataclass
class AdmissionStats:
    """Events offered to a served pipeline, by outcome: ``accepted``, refused because the
    admission queue stayed full (``queue_full``) or by a rate limit (``rate_limited``)."""

    accepted: int = 0
    queue_full: int = 0
    rate_limited: int = 0

    OUTCOMES = ("accepted", "queue_full", "rate_limited")


class LatencyTrail:
    """End-to-end p50/p90/p99 of each second of the last ``keep_s`` seconds with events, kept by
    the engine whether anyone watches or not, so a dashboard opened late draws the past.

    ``tick`` is called with each write's time (by the sinks); once a second it takes the
    window since the previous second from the histogram (~0.1 ms): nothing per event.
    """

    def __init__(self, e2e: LatencyHistogram, keep_s: int = 300) -> None:
        self._e2e = e2e
        self._points: deque[tuple[int, float, float, float, int]] = deque(maxlen=keep_s)
        self._next_ns = 0
        self._prev: LatencyHistogram | None = None
        self._lock = threading.Lock()

    def tick(self, now_ns: int, e2e: LatencyHistogram | None = None) -> None:
        """A point for the second before ``now_ns``, if due; ``e2e``: the histogram as it is
        now, when it is not the one the trail was made with (a merge of several workers')."""
        if now_ns < self._next_ns or not self._lock.acquire(blocking=False):
            return  # not due, or another sink's thread is taking this second
        try:
            if now_ns < self._next_ns:
                return
            snap = (e2e or self._e2e).snapshot()
            window = snap.since(self._prev) if self._prev is not None else snap
            self._prev = snap
            self._next_ns = now_ns + 1_000_000_000
            if window.count:
                ms = [round(window.percentile(q) / 1e6, 3) for q in (50, 90, 99)]
                self._points.append((now_ns, ms[0], ms[1], ms[2], window.count))
        finally:
            self._lock.release()

    def export(self) -> list[tuple[int, float, float, float, int]]:
        """The points as plain data (``load`` them into a trail in another process)."""
        return list(self._points)

    def load(self, points: list[tuple[int, float, float, float, int]]) -> None:
        self._points.clear()
        self._points.extend(tuple(p) for p in points)  # type: ignore[misc]

    def points(self, started_ns: int) -> list[dict[str, float]]:
        """Oldest first: ``{"t": seconds since started_ns, "p50", "p90", "p99": ms, "count"}``."""
        return [
            {"t": round((t - started_ns) / 1e9, 2), "p50": a, "p90": b, "p99": c, "count": n}
            for t, a, b, c, n in list(self._points)
        ]


@dataclass
class RunStats:
    """Whole-run counters: events in/out, dead letters, end-to-end latency.

    ``events_in`` counts every record read, including those dead-lettered by the source's
    decoder; ``events_out`` counts rows written by sinks.
    """

    started_ns: int = field(default_factory=time.monotonic_ns)
    ended_ns: int | None = None
    first_read_ns: int | None = None
    """When the first event was read (a broker's input may come long after the start)."""
    last_written_ns: int | None = None
    """When the last output row was written."""
    events_in: int = 0
    events_out: int = 0
    checkpoints: int = 0
    checkpoint_s: float = 0.0
    """How long the durable part of the last checkpoint took (state files, manifest, commits)."""
    e2e: LatencyHistogram = field(default_factory=LatencyHistogram)
    stages: dict[str, StageStats] = field(default_factory=dict)
    as_of_ns: int | None = None
    """When the counters were taken, for a copy of them (``from_state``; None: they are live),
    so that rates between two copies use the copies' own clock."""
    trail: LatencyTrail = field(init=False, repr=False)
    """The last minutes of end-to-end percentiles, a point a second (``LatencyTrail``)."""

    def __post_init__(self) -> None:
        self.trail = LatencyTrail(self.e2e)

    def seconds(self) -> float:
        end = self.ended_ns if self.ended_ns is not None else self.as_of_ns or time.monotonic_ns()
        return (end - self.started_ns) / 1e9

    def active_seconds(self) -> float:
        """From the first event read to the last row written: the time input kept the pipeline
        busy, without waiting for input to begin (a consumer group forming) or to end."""
        if self.first_read_ns is None or self.last_written_ns is None:
            return 0.0
        return max(0, self.last_written_ns - self.first_read_ns) / 1e9

    def stage(self, step_id: str, kind: str) -> StageStats:
        return self.stages.setdefault(step_id, StageStats(step_id, kind))

    def to_state(self) -> dict[str, Any]:
        """Everything, as plain data for another process (``from_state``)."""
        return {
            "started_ns": self.started_ns,
            "ended_ns": self.ended_ns,
            "first_read_ns": self.first_read_ns,
            "last_written_ns": self.last_written_ns,
            "events_in": self.events_in,
            "events_out": self.events_out,
            "checkpoints": self.checkpoints,
            "checkpoint_s": self.checkpoint_s,
            "e2e": self.e2e.to_dict(),
            "trail": self.trail.export(),
            "stages": [s.to_state() for s in list(self.stages.values())],
            "as_of_ns": time.monotonic_ns(),
        }

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> RunStats:
        stats = cls(
            started_ns=data["started_ns"],
            ended_ns=data["ended_ns"],
            first_read_ns=data["first_read_ns"],
            last_written_ns=data["last_written_ns"],
            events_in=data["events_in"],
            events_out=data["events_out"],
            checkpoints=data["checkpoints"],
            checkpoint_s=data.get("checkpoint_s", 0.0),
            e2e=LatencyHistogram.from_dict(data["e2e"]),
            stages={s["step_id"]: StageStats.from_state(s) for s in data["stages"]},
            as_of_ns=data["as_of_ns"],
        )
        stats.trail.load(data["trail"])
        return stats


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MB.

    Linux's ``VmHWM`` when it can be read: ``getrusage``'s ``ru_maxrss`` is kept across
    ``fork`` and ``exec``, so a run started by a large process would report that process's size.
    """
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
