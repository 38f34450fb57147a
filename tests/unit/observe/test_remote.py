"""The observer process's view of a pipeline: a snapshot, sent as JSON and loaded in another
process, renders the same metrics and dashboard as the pipeline itself."""

from __future__ import annotations

import re
import time
import urllib.request

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry

from aisp import Batch, CollectSink, DeadLetterSink, Pipeline, PythonRuntime, WorkloadFSource
from aisp.observe.dashboard import DashboardState
from aisp.observe.drift import DriftConfig
from aisp.observe.export.metrics import PipelineCollector, TextExposition, metrics_registry
from aisp.observe.remote import ConsistentRegistry, RemoteObserver, SnapshotView, snapshot
from aisp.retry import RETRIES
from aisp.schedule.executor import LocalExecutor


def finished_executor() -> LocalExecutor:
    model = PythonRuntime(
        lambda i: {"y": i["x"].sum(axis=1)}, name="m", input_names=["x"], output_names=["y"]
    )

    def features(b: Batch) -> Batch:
        if (b.numpy("id") == 1500).any():
            raise ValueError("a planted failure: this batch is dead-lettered")
        return b.with_columns({"x": b.numpy("f").astype(np.float32)})

    p = Pipeline("tiny")
    p.source("events", WorkloadFSource(events=3000)).map_batch("x", features).infer(
        "score", model, inputs={"x": "x"}, outputs={"y": "y"}, drift=DriftConfig(window_rows=500)
    ).sink("out", CollectSink(columns=["id"]))
    executor = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    executor.run()
    return executor


def pipeline_text(view: object, retries: object = RETRIES) -> str:
    registry = CollectorRegistry()
    registry.register(PipelineCollector(view, retries=retries))  # type: ignore[arg-type]
    return TextExposition(registry).render().decode()


def test_a_loaded_snapshot_renders_the_same_metrics_and_dashboard() -> None:
    ex = finished_executor()
    view = SnapshotView(ex.graph)
    view.load(msgspec.json.decode(msgspec.json.encode(snapshot(ex))))  # as it crosses the pipe
    assert pipeline_text(view, view.retries) == pipeline_text(ex)
    assert "aisp_drift_psi" in pipeline_text(view, view.retries)
    assert view.dead_letter.count == ex.dead_letter.count > 0
    here, there = DashboardState(ex).with_history(), DashboardState(view).with_history()
    assert here == there


def test_the_dashboard_of_a_view_keeps_its_state_until_a_newer_snapshot() -> None:
    """Two updates between the same two snapshots must not read as an interval with no events
    (rates and percentiles of zero on the page)."""
    ex = finished_executor()
    view = SnapshotView(ex.graph)
    data = msgspec.json.decode(msgspec.json.encode(snapshot(ex)))
    view.load(data)
    state = DashboardState(view, min_interval_s=0.0)
    first = state.update()
    assert first["e2e_ms"]["count"] > 0 and first["events_in_per_s"] > 0
    view.load(data)  # the same snapshot again, as when an update comes before the next one
    assert state.update() == first


def test_a_scrape_reads_one_snapshot_whole() -> None:
    """A snapshot is loaded under the view's lock, which a scrape of ``ConsistentRegistry``
    holds: a load waits for the scrape, so the totals and the workers' shares agree."""
    import threading

    ex = finished_executor()
    view = SnapshotView(ex.graph)
    data = msgspec.json.decode(msgspec.json.encode(snapshot(ex)))
    view.load(data)
    registry = ConsistentRegistry(metrics_registry(view, gc_collector=view.gc, retries=view.retries), view)
    inner = metrics_registry(view, gc_collector=view.gc, retries=view.retries)
    assert [m.name for m in registry.collect()] == [m.name for m in inner.collect()]
    with view.lock:  # as during a scrape
        loader = threading.Thread(target=view.load, args=(data,))
        loader.start()
        loader.join(0.2)
        assert loader.is_alive()
    loader.join(5)
    assert not loader.is_alive()


def test_the_observer_serves_the_pipeline_process_metrics() -> None:
    ex = finished_executor()
    observer = RemoteObserver(ex.graph, 0, dashboard=True, interval_s=0.05)
    try:
        observer.start(lambda: snapshot(ex))
        url = f"http://127.0.0.1:{observer.port}"
        text, out = "", None
        for _ in range(100):  # the first snapshot arrives within interval_s
            text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
            out = re.search(r'aisp_events_total\{direction="out"\} (\S+)', text)
            if out is not None and float(out.group(1)) > 0:
                break
            time.sleep(0.05)
        assert out is not None and float(out.group(1)) == ex.stats.events_out
        # process metrics are this (the pipeline's) process's, not the observer's
        started = re.search(r"^process_start_time_seconds (\S+)", text, re.MULTILINE)
        ours = metrics_registry(ex).get_sample_value("process_start_time_seconds")
        assert started is not None and float(started.group(1)) == ours
        assert "python_gc_collections_total" in text and "aisp_gc_pause_seconds_bucket" in text
        state = urllib.request.urlopen(f"{url}/dashboard/state", timeout=5).read()
        assert msgspec.json.decode(state)["events_out"] == ex.stats.events_out
    finally:
        observer.close()
