"""The live dashboard: a JSON state of a running pipeline and the page that draws it, served by
``aisp run``'s observability server (``aisp.observe.server``) and mounted by ``aisp serve``.

Endpoints: ``/`` (or ``/dashboard``): the page (plain HTML and JavaScript in one file, no build
step, nothing fetched from elsewhere); ``/dashboard/state``: the current state as JSON (with
``?history=1`` also the last minutes of end-to-end percentiles, which the page asks for when it
opens); ``/dashboard/events``: the same state as server-sent events, one a second.

The state: the DAG (steps, kinds, edges); per stage over the last interval rows/s in and out,
queue depth, p99 of each phase, mean batch size; end-to-end p50/p90/p99 over the interval and
since the start; drift scores per model input feature; each vector search step's retrieval
confidence; the current diagnosis
(``aisp.observe.diagnose.pipeline`` over the last five seconds, renewed that often); and model rollouts
(the pipeline's rollout steps and, under ``aisp serve``, the served models'), each with its
state, traffic share and latest decisions with their evidence. A server without pipelines
shows its models' rollouts alone (``ModelsState``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from importlib.resources import files
from typing import Any

from prometheus_client import CollectorRegistry

from aisp.graph import split_ref
from aisp.observe.clock import wall_ms
from aisp.observe.diagnose.pipeline import Scrape, diagnose
from aisp.observe.export.metrics import PipelineCollector
from aisp.observe.export.operators import operator_counters
from aisp.observe.export.rollouts import rollout_rows, step_statuses
from aisp.observe.latency import LatencyHistogram
from aisp.observe.stats import AdmissionStats, RunStats
from aisp.observe.view import PipelineView

__all__ = ["DashboardState", "ModelsState", "page", "sse"]


def page() -> bytes:
    """The dashboard's HTML (it fetches ``/dashboard/state`` relative to itself)."""
    return files("aisp.observe").joinpath("dashboard.html").read_bytes()


_NO_WATERMARK = -(2**63)  # a window step before any event (transform.event_time)


class DashboardState:
    """Builds the dashboard's JSON state of one executor, over the interval since the previous
    ``update`` (callers share one instance; ``update`` at most once per ``min_interval_s``)."""

    def __init__(
        self,
        executor: PipelineView,
        *,
        admission: AdmissionStats | None = None,
        min_interval_s: float = 1.0,
        diagnose_every_s: float = 5.0,
        models: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
    ) -> None:
        self._ex = executor
        self._models = models
        """Served models' rollout statuses, by model (``aisp serve``), shown beside the
        pipeline's rollout steps."""
        self._registry = CollectorRegistry()
        self._registry.register(PipelineCollector(executor, admission))
        self._min_interval_s = min_interval_s
        self._diagnose_every_s = diagnose_every_s
        self._lock = threading.Lock()
        self._prev: tuple[float, dict[str, Any], float] | None = None
        self._diagnosed: tuple[float, Scrape, list[dict[str, Any]]] | None = None
        self._e2e = LatencyHistogram()
        self._phases: dict[tuple[str, str], LatencyHistogram] = {}
        self._state: dict[str, Any] = {}

    def graph(self) -> dict[str, Any]:
        nodes = [
            {"id": n.step_id, "kind": n.kind, "inputs": [split_ref(i)[0] for i in n.inputs]}
            for n in self._ex.graph.topological_order()
        ]
        return {"name": self._ex.graph.name, "nodes": nodes}

    def update(self) -> dict[str, Any]:
        """The state now (recomputed when the last one is older than ``min_interval_s``)."""
        with self._lock:
            now = time.monotonic()
            if self._prev is not None and now - self._prev[0] < self._min_interval_s and self._state:
                return self._state
            st = self._ex.stats  # read once: a remote view replaces it whole on each snapshot
            clock = st.seconds()  # the counters' own clock (a copy's is its time)
            if self._prev is not None and clock == self._prev[2] and self._state:
                return self._state  # no newer snapshot yet: an empty interval would read as zeros
            counts = self._counts(st)
            seconds = clock - self._prev[2] if self._prev is not None else clock
            self._state = self._build(st, self._diagnosis(now), counts, max(seconds, 1e-6))
            self._prev = (now, counts, clock)
            return self._state

    def _diagnosis(self, now: float) -> list[dict[str, Any]]:
        """The findings over the last ``diagnose_every_s`` (re-diagnosed that often: reading
        every metric is the costliest part of an update; ``aisp serve`` does it in the pipeline's
        process)."""
        if self._diagnosed is not None and now - self._diagnosed[0] < self._diagnose_every_s:
            return self._diagnosed[2]
        scrape = Scrape.of(self._registry)
        before = self._diagnosed[1] if self._diagnosed is not None else None
        seconds = now - self._diagnosed[0] if self._diagnosed is not None else self._ex.stats.seconds()
        findings = [f.as_dict() for f in diagnose(before, scrape, seconds=max(seconds, 1e-6))[:3]]
        self._diagnosed = (now, scrape, findings)
        return findings

    def with_history(self) -> dict[str, Any]:
        """``update()`` plus ``history``: the engine's end-to-end p50/p90/p99 of each second of
        the last minutes (``RunStats.trail``), for a page to draw what came before it opened."""
        stats, state = self._ex.stats, self.update()
        points = stats.trail.points(stats.started_ns)  # up to the (possibly cached) state's time
        return {**state, "history": [p for p in points if p["t"] <= state["time_s"]]}

    @staticmethod
    def _counts(st: RunStats) -> dict[str, Any]:
        return {
            "events_in": st.events_in,
            "events_out": st.events_out,
            "stages": {
                s.step_id: (s.rows_in, s.rows_out, s.batches, s.batch_rows.sum_ns) for s in st.stages.values()
            },
        }

    def _window(self, hist: LatencyHistogram, key: tuple[str, str]) -> LatencyHistogram:
        """What ``hist`` recorded since the last update."""
        earlier = self._phases.get(key)
        self._phases[key] = hist.snapshot()
        return hist.since(earlier) if earlier is not None else hist.snapshot()

    def _build(
        self, st: RunStats, findings: list[dict[str, Any]], counts: dict[str, Any], seconds: float
    ) -> dict[str, Any]:
        empty: dict[str, Any] = {"events_in": 0, "events_out": 0, "stages": {}}
        before = self._prev[1] if self._prev is not None else empty
        stages = []
        for s in st.stages.values():
            rows_in, rows_out, batches, batch_rows = counts["stages"][s.step_id]
            b_in, b_out, b_batches, b_rows = before["stages"].get(s.step_id, (0, 0, 0, 0))
            p99 = {}
            for phase in s.PHASES:
                hist = s.phases.get(phase)
                if hist is not None:
                    recent = self._window(hist, (s.step_id, phase))
                    if recent.count:
                        p99[phase] = round(recent.percentile(99) / 1e6, 3)
            stages.append(
                {
                    "id": s.step_id,
                    "kind": s.kind,
                    "rows_in_per_s": round((rows_in - b_in) / seconds, 1),
                    "rows_out_per_s": round((rows_out - b_out) / seconds, 1),
                    "queue_rows": s.queue_rows(),
                    "p99_ms": p99,
                    "mean_batch_rows": round((batch_rows - b_rows) / (batches - b_batches), 1)
                    if batches > b_batches
                    else None,
                }
            )
        recent = self._window(st.e2e, ("", "e2e"))
        return {
            "pipeline": self._ex.graph.name,
            "graph_version": getattr(self._ex, "graph_version", 1),  # a served pipeline's updates
            "graph_updates": list(getattr(self._ex, "graph_updates", ()))[-5:],
            "time_s": round(st.seconds(), 2),
            "events_in_per_s": round((counts["events_in"] - before["events_in"]) / seconds, 1),
            "events_out_per_s": round((counts["events_out"] - before["events_out"]) / seconds, 1),
            "events_in": counts["events_in"],
            "events_out": counts["events_out"],
            "dead_letters": self._ex.dead_letter.count,
            "e2e_ms": {
                "p50": round(recent.percentile(50) / 1e6, 3),
                "p90": round(recent.percentile(90) / 1e6, 3),
                "p99": round(recent.percentile(99) / 1e6, 3),
                "count": recent.count,
            },
            "e2e_total_ms": st.e2e.summary_ms(),
            "stages": stages,
            "drift": [
                {
                    "stage": m.stage,
                    "feature": f,
                    "psi": round(float(m.psi[j]), 4),
                    "ks": round(float(m.ks[j]), 4),
                }
                for m in self._ex.drift_monitors
                for j, f in enumerate(m.features)
            ],
            "retrieval": _retrieval_rows(self._ex),
            "windows": [
                {
                    "stage": sid,
                    "watermark_ms": w.watermark if w.watermark > _NO_WATERMARK else None,
                    "lag_s": round(max(0.0, (wall_ms() - w.watermark) / 1000), 3)
                    if w.watermark > _NO_WATERMARK
                    else None,
                    "open_windows": w.open_windows,
                    "late_events": w.late_events,
                }
                for sid, w in self._ex.windows.items()
            ],
            "diagnosis": findings,
            "graph": self.graph(),
            "rollouts": rollout_rows("step", step_statuses(self._ex.graph))
            + rollout_rows("model", self._models() if self._models is not None else {}),
        }


def _retrieval_rows(view: Any) -> list[dict[str, Any]]:
    """Each vector search step's queries and confidence: the last window's share of queries
    under its threshold, against its target, and the alerts raised."""
    counters = getattr(view, "counters", None)  # a remote view's come with its snapshots
    retrieval = (counters if counters is not None else operator_counters(view.graph)).get("retrieval", {})
    return [
        {
            "stage": sid,
            "queries": st["queries"],
            "low_share": round(st["share"], 4) if st["threshold"] is not None else None,
            "target_share": st["target_share"],
            "threshold": st["threshold"],
            "alerts": st["alerts"],
        }
        for sid, st in sorted(retrieval.items())
    ]


class ModelsState:
    """The dashboard's state of a server without pipelines: its models' rollouts (the page
    shows only those)."""

    def __init__(self, models: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self._models = models

    def update(self) -> dict[str, Any]:
        return {"pipeline": None, "rollouts": rollout_rows("model", self._models())}

    def with_history(self) -> dict[str, Any]:
        return self.update()


def sse(state: DashboardState, stop: threading.Event, period_s: float = 1.0) -> Iterator[bytes]:
    """Server-sent events: the state every ``period_s`` until ``stop``."""
    while not stop.is_set():
        yield b"data: " + json.dumps(state.update()).encode() + b"\n\n"
        stop.wait(period_s)
