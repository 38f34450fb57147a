"""Watching a run from another process: ``/metrics`` and the dashboard off the pipeline's GIL.

Rendering the Prometheus text, a dashboard state or a diagnosis takes milliseconds of Python
(10-40 ms for a scrape of a busy pipeline); in the pipeline's process every millisecond of it
delays events. So ``aisp run --metrics-port/--dashboard`` forks an observer process before the
pipeline starts (while it has one thread) and, every ``interval_s``, sends it a snapshot of
what observers read (``snapshot``: the ``PipelineView``'s counters, histogram buckets that
were hit, the batchers' counters and settings, drift scores, dead letters by step, the GC's
statistics and pauses, retries): one msgspec encode of a few kilobytes, well under a
millisecond. The observer rebuilds a ``PipelineView`` from each (``SnapshotView``) and serves
``ObserveServer`` from it. What it shows is at most ``interval_s`` old; the process metrics
(CPU, memory, open files) are the pipeline process's, read from ``/proc``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from aisp.graph import Graph, Node
from aisp.observe.export.llm import llm_snapshot, llm_views, merge_llm
from aisp.observe.export.metrics import GcPauses, gc_pauses
from aisp.observe.export.operators import operator_counters
from aisp.observe.export.rollouts import GraphVersions, update_counts
from aisp.observe.latency import LatencyHistogram
from aisp.observe.stats import LatencyTrail, RunStats, StageStats
from aisp.observe.view import PipelineView
from aisp.retry import RETRIES

__all__ = ["ConsistentRegistry", "MergedTrail", "RemoteObserver", "SnapshotView", "merge", "snapshot"]


def snapshot(view: PipelineView) -> dict[str, Any]:
    """What observers read of ``view`` now, as plain data (``SnapshotView.load`` takes it)."""
    return {
        "stats": view.stats.to_state(),
        "dead_letters": {"count": view.dead_letter.count, "by_step": dict(view.dead_letter.by_step)},
        "stopping": view.stopping,
        "batchers": {sid: _batcher(b) for sid, b in view.batchers.items()},
        "drift": [
            {
                "stage": m.stage,
                "features": list(m.features),
                "psi": [float(x) for x in m.psi],
                "ks": [float(x) for x in m.ks],
                "alerts": [{"feature": a["feature"]} for a in m.alerts],
            }
            for m in view.drift_monitors
        ],
        "windows": {
            sid: {"open_windows": w.open_windows, "late_events": w.late_events, "watermark": w.watermark}
            for sid, w in view.windows.items()
        },
        "gc": {"stats": gc.get_stats(), "pauses": gc_pauses().pauses.to_dict()},
        "retries": [[target, reason, n] for (target, reason), n in RETRIES.items()],
        "threads": view.thread_of(),
        "counters": operator_counters(view.graph),
        "llm": llm_snapshot(getattr(view, "llm_stages", {})),
        **_graph_of(view),
    }


def _graph_of(view: PipelineView) -> dict[str, Any]:
    """After a topology update of the run (``graph_version`` > 1): the running graph's steps and
    the updates, which the observer, forked with the first graph, does not have."""
    version = getattr(view, "graph_version", 1)
    if version == 1:
        return {}
    graph = view.graph
    nodes = [[n.step_id, n.kind, list(n.inputs), list(n.ports), n.latency_budget_ms] for n in graph.nodes]
    history = list(getattr(view, "graph_updates", ()))
    _, applied, failed = update_counts(version, history)
    return {
        "graph": {"name": graph.name, "version": version, "nodes": nodes, "updates": history[-5:]},
        "graph_update_counts": [applied, failed],
    }


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of several workers' (``snapshot`` of each): counters summed, histograms
    merged, drift scores per worker (their stage ``STEP@wI``), and ``workers``: each one's
    events in and out. The latency trail is left empty (``MergedTrail`` rebuilds it)."""
    stats = [p["stats"] for p in parts]
    stages: dict[str, dict[str, Any]] = {}
    for st in stats:
        for s in st["stages"]:
            into = stages.get(s["step_id"])
            stages[s["step_id"]] = dict(s) if into is None else _merge_stage(into, s)
    batchers: dict[str, dict[str, Any]] = {}
    for p in parts:
        for sid, b in p["batchers"].items():
            into = batchers.setdefault(sid, {**b, "stats": dict.fromkeys(b["stats"], 0)})
            for k, v in b["stats"].items():
                into["stats"][k] += v
    gc_stats = [
        {k: sum(p["gc"]["stats"][g][k] for p in parts) for k in parts[0]["gc"]["stats"][g]}
        for g in range(len(parts[0]["gc"]["stats"]))
    ]
    retries: Counter[tuple[str, str]] = Counter()
    for p in parts:
        for target, reason, n in p["retries"]:
            retries[(target, reason)] += n
    dead: Counter[str] = Counter()
    for p in parts:
        dead.update(p["dead_letters"]["by_step"])
    firsts = [st["first_read_ns"] for st in stats if st["first_read_ns"] is not None]
    lasts = [st["last_written_ns"] for st in stats if st["last_written_ns"] is not None]
    ended = [st["ended_ns"] for st in stats]
    return {
        "stats": {
            "started_ns": min(st["started_ns"] for st in stats),
            "ended_ns": max(ended) if None not in ended else None,
            "first_read_ns": min(firsts) if firsts else None,
            "last_written_ns": max(lasts) if lasts else None,
            "events_in": sum(st["events_in"] for st in stats),
            "events_out": sum(st["events_out"] for st in stats),
            "checkpoints": max(st["checkpoints"] for st in stats),
            "checkpoint_s": max(st.get("checkpoint_s", 0.0) for st in stats),
            "e2e": _merge_hist([st["e2e"] for st in stats]),
            "trail": [],
            "stages": list(stages.values()),
            "as_of_ns": min(st["as_of_ns"] for st in stats),
        },
        "dead_letters": {"count": sum(dead.values()), "by_step": dict(dead)},
        "stopping": any(p["stopping"] for p in parts),
        "batchers": batchers,
        "drift": [{**d, "stage": f"{d['stage']}@w{i}"} for i, p in enumerate(parts) for d in p["drift"]],
        "windows": {f"{sid}@w{i}": w for i, p in enumerate(parts) for sid, w in p.get("windows", {}).items()},
        "llm": merge_llm([p.get("llm", {}) for p in parts]),
        "gc": {"stats": gc_stats, "pauses": _merge_hist([p["gc"]["pauses"] for p in parts])},
        "retries": [[t, r, n] for (t, r), n in sorted(retries.items())],
        "threads": parts[0]["threads"],
        "workers": [
            {"worker": i, "events_in": p["stats"]["events_in"], "events_out": p["stats"]["events_out"]}
            for i, p in enumerate(parts)
        ],
    }


def _merge_hist(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = LatencyHistogram()
    for h in parts:
        merged.merge(LatencyHistogram.from_dict(h))
    return merged.to_dict()


def _merge_stage(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k in (*StageStats.COUNTERS, "queue_rows"):
        out[k] = a[k] + b[k]
    out["phases"] = {
        name: _merge_hist([h for h in (a["phases"].get(name), b["phases"].get(name)) if h is not None])
        for name in {*a["phases"], *b["phases"]}
    }
    out["batch_rows"] = _merge_hist([a["batch_rows"], b["batch_rows"]])
    return out


class MergedTrail:
    """The end-to-end p50/p90/p99 of each second, from merged snapshots taken about once a
    second (the workers' own trails cannot be merged: percentiles do not add up)."""

    def __init__(self) -> None:
        self._trail = LatencyTrail(LatencyHistogram())

    def add(self, merged: dict[str, Any]) -> None:
        """Fill ``merged["stats"]["trail"]``: its window since the previous one is a point."""
        self._trail.tick(time.monotonic_ns(), LatencyHistogram.from_dict(merged["stats"]["e2e"]))
        merged["stats"]["trail"] = self._trail.export()


def _batcher(b: Any) -> dict[str, Any]:
    st, rt = b.stats, b.runtime
    return {
        "stats": {
            k: getattr(st, k)
            for k in (
                "batches",
                "rows",
                "timeouts",
                "errors",
                "shed",
                "queued_rows",
                "inline_batches",
                "cpu_ns",
            )
        },
        "runtime": {
            "name": str(rt.name),
            "version": str(rt.version),
            "provider": str(getattr(rt, "provider", "")),
            "swaps": int(getattr(rt, "swaps", 0)),
            "precision": str(getattr(rt, "precision", "") or ""),
            **({"live_since": rt.live_since} if isinstance(getattr(rt, "live_since", None), float) else {}),
        },
        "settings": b.settings(),
    }


@dataclass(frozen=True)
class _Batcher:
    stats: SimpleNamespace  # the counters of ``BatcherStats``, by name
    runtime: SimpleNamespace  # name, version, provider, swaps, precision, live_since
    _settings: dict[str, float]

    def settings(self) -> dict[str, float]:
        return self._settings


@dataclass(frozen=True)
class _DeadLetters:
    count: int
    by_step: Mapping[str, int]


@dataclass(frozen=True)
class _Drift:
    stage: str
    features: list[str]
    psi: list[float]
    ks: list[float]
    alerts: list[dict[str, Any]]


class _Retries:
    def __init__(self) -> None:
        self.counts: list[tuple[tuple[str, str], int]] = []

    def items(self) -> list[tuple[tuple[str, str], int]]:
        return self.counts


class _Gc:
    """The pipeline process's GC statistics and pauses (``prometheus_client``'s GCCollector
    families and ``aisp_gc_pause_seconds``), from the last snapshot."""

    def __init__(self) -> None:
        self.stats: list[dict[str, int]] = []
        self.pauses = GcPauses()  # not a gc callback here: its histogram is the pipeline's

    def collect(self) -> Iterator[Any]:
        collected = CounterMetricFamily(
            "python_gc_objects_collected", "Objects collected during gc", labels=["generation"]
        )
        uncollectable = CounterMetricFamily(
            "python_gc_objects_uncollectable", "Uncollectable objects found during GC", labels=["generation"]
        )
        collections = CounterMetricFamily(
            "python_gc_collections", "Number of times this generation was collected", labels=["generation"]
        )
        for generation, st in enumerate(self.stats):
            collected.add_metric([str(generation)], st["collected"])
            uncollectable.add_metric([str(generation)], st["uncollectable"])
            collections.add_metric([str(generation)], st["collections"])
        yield from (collected, uncollectable, collections)
        yield from self.pauses.collect()


class SnapshotView:
    """A ``PipelineView`` of another process's pipeline, as of its last snapshot (``load``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.counters: dict[str, Any] = {}
        """Operators' own counters (``observe.operator_counters``)."""
        self.graph_version = 1
        """The running graph's version (one more per topology update of the run)."""
        self.graph_updates: list[dict[str, Any]] = []
        """The latest topology updates (their reports)."""
        self.graph_update_counts: tuple[int, int] = (0, 0)
        """Topology updates so far: applied, failed."""
        self._threads: dict[str, str] = {}
        self.workers: list[dict[str, int]] | None = None
        """With several workers (``merge``): each one's events in and out."""
        self.stats = RunStats()
        self.dead_letter: _DeadLetters = _DeadLetters(0, {})
        self.stopping = False
        self.batchers: dict[str, _Batcher] = {}
        self.drift_monitors: Sequence[_Drift] = []
        self.windows: dict[str, SimpleNamespace] = {}
        self.llm_stages: dict[str, Any] = {}
        """The LLM steps' measurements (``export.llm.llm_views``)."""
        self.retries = _Retries()
        self.gc = _Gc()
        self.lock = threading.Lock()

    def thread_of(self) -> dict[str, str]:
        return self._threads

    def load(self, data: dict[str, Any]) -> None:
        """Take a ``snapshot``; each part is replaced whole, under ``lock`` (a reader that needs
        several parts of one snapshot, a scrape, holds it: ``ConsistentRegistry``)."""
        with self.lock:
            self._load(data)

    def _load(self, data: dict[str, Any]) -> None:
        self.stats = RunStats.from_state(data["stats"])
        self.dead_letter = _DeadLetters(**data["dead_letters"])
        self.stopping = bool(data["stopping"])
        self.batchers = {
            sid: _Batcher(SimpleNamespace(**b["stats"]), SimpleNamespace(**b["runtime"]), b["settings"])
            for sid, b in data["batchers"].items()
        }
        self.drift_monitors = [_Drift(**d) for d in data["drift"]]
        self.windows = {sid: SimpleNamespace(**w) for sid, w in data.get("windows", {}).items()}
        self.llm_stages = llm_views(data.get("llm", {}))
        self.retries.counts = [((t, r), n) for t, r, n in data["retries"]]
        self.gc.stats = data["gc"]["stats"]
        self.gc.pauses.pauses = LatencyHistogram.from_dict(data["gc"]["pauses"])
        self._threads = data["threads"]
        self.counters = data.get("counters", {})
        self.workers = data.get("workers")
        graph = data.get("graph")
        if graph is not None and graph["version"] != self.graph_version:  # the run switched graphs
            nodes = [
                Node(step_id=sid, kind=kind, inputs=tuple(ins), ports=tuple(ports), latency_budget_ms=budget)
                for sid, kind, ins, ports, budget in graph["nodes"]
            ]
            self.graph, self.graph_version = Graph(graph["name"], nodes), graph["version"]
        if graph is not None:
            self.graph_updates = graph["updates"]
            self.graph_update_counts = tuple(data["graph_update_counts"])


class ConsistentRegistry(CollectorRegistry):
    """A view's metrics (``registry``), all read from one snapshot: the total of events out and
    each worker's share come from the same one."""

    def __init__(self, registry: CollectorRegistry, view: SnapshotView) -> None:
        super().__init__(auto_describe=False)
        self._registry, self._view = registry, view

    def collect(self) -> Iterator[Any]:
        with self._view.lock:
            metrics = list(self._registry.collect())
        yield from metrics


def _yield_cpu() -> None:
    """Run only on CPU time the pipeline leaves (Linux ``SCHED_IDLE``; else the lowest nice):
    on a machine the pipeline keeps busy, a scrape waits, not an event."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _observer_main(
    graph: Graph,
    port: int,
    dashboard: bool,
    snapshots: Connection,
    ready: Connection,
    parent_ends: list[Connection],
) -> None:
    from aisp.ipc import worker_init
    from aisp.observe.export.metrics import metrics_registry
    from aisp.observe.server import ObserveServer

    worker_init(*parent_ends)
    _yield_cpu()
    view = SnapshotView(graph)
    try:
        families = metrics_registry(view, pid=os.getppid(), gc_collector=view.gc, retries=view.retries)
        families.register(
            GraphVersions(lambda: {view.graph.name: (view.graph_version, *view.graph_update_counts)})
        )
        registry = ConsistentRegistry(families, view)
        server = ObserveServer(view, port, dashboard=dashboard, registry=registry)
    except OSError as exc:
        ready.send_bytes(msgspec.json.encode({"error": f"cannot serve on port {port}: {exc.strerror}"}))
        return
    ready.send_bytes(msgspec.json.encode({"port": server.port}))
    ready.close()
    dec = msgspec.json.Decoder()
    try:
        while True:
            view.load(dec.decode(snapshots.recv_bytes()))
    except (EOFError, OSError):
        pass
    finally:
        server.close()


class RemoteObserver:
    """Forks the observer process (call while this process has one thread), then, from
    ``start(source)`` until ``close()``, sends it ``source()`` (a ``snapshot``, or a ``merge``
    of several; None: nothing new) every ``interval_s``.

    ``port`` is the one it serves on (the requested one, or the free one it found)."""

    def __init__(self, graph: Graph, port: int, *, dashboard: bool, interval_s: float = 1.0) -> None:
        from aisp.errors import ConfigError

        ctx = mp.get_context("fork")
        rx, self._tx = ctx.Pipe(duplex=False)
        ready_rx, ready_tx = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_observer_main,
            args=(graph, port, dashboard, rx, ready_tx, [self._tx, ready_rx]),
            name="aisp-observer",
            daemon=True,
        )
        self._proc.start()
        rx.close()
        ready_tx.close()
        try:
            answer = (
                msgspec.json.decode(ready_rx.recv_bytes()) if ready_rx.poll(30) else {"error": "no answer"}
            )
        except EOFError:
            answer = {"error": "the observer process exited"}
        finally:
            ready_rx.close()
        if "error" in answer:
            self._proc.join(1)
            raise ConfigError(f"/metrics and the dashboard: {answer['error']}")
        self.port = int(answer["port"])
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, source: Callable[[], dict[str, Any] | None]) -> None:
        self._thread = threading.Thread(
            target=self._publish, args=(source,), name="aisp-observe-publish", daemon=True
        )
        self._thread.start()

    def _publish(self, source: Callable[[], dict[str, Any] | None]) -> None:
        enc = msgspec.json.Encoder()
        while True:
            data = source()
            try:
                if data is not None:
                    self._tx.send_bytes(enc.encode(data))
            except OSError:
                return
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        """Stop publishing and end the observer process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._tx.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
