"""The shipped Grafana dashboard only queries metrics that AISP exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

import aisp.observe
from aisp import CollectSink, DeadLetterSink, Pipeline, PythonRuntime, WorkloadFSource
from aisp.observe.drift import DriftConfig
from aisp.observe.export.metrics import PipelineCollector, gc_pauses
from aisp.observe.stats import AdmissionStats
from aisp.schedule.executor import LocalExecutor
from aisp.serve.metrics import ServerMetrics

DASHBOARD = Path(aisp.observe.__file__).parent / "grafana-dashboard.json"


def exported_families() -> set[str]:
    model = PythonRuntime(
        lambda i: {"y": i["x"].sum(axis=1)}, name="m", input_names=["x"], output_names=["y"]
    )
    p = Pipeline("tiny")
    p.source("events", WorkloadFSource(events=2000)).map_batch(
        "x", lambda b: b.with_columns({"x": b.numpy("f").astype(np.float32)})
    ).infer("score", model, inputs={"x": "x"}, outputs={"y": "y"}, drift=DriftConfig(window_rows=500)).sink(
        "out", CollectSink(columns=["id"])
    )
    executor = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    executor.run()
    registry = CollectorRegistry()
    registry.register(PipelineCollector(executor, AdmissionStats()))
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(gc_pauses())
    text = generate_latest(registry).decode() + generate_latest(ServerMetrics(None).registry).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def test_every_panel_queries_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:aisp|process)_[a-z0-9_]+)", e)}
    families = exported_families()
    for metric in used:
        base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
        assert base in families, f"{metric} is not exported (families: {sorted(families)})"
    assert len(dashboard["panels"]) >= 10
