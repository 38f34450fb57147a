"""Semantic routing: a small classifier sends each event to a cheap or an expensive model.

    events -> running state -> features -> triage (logistic, ``risk``)
        -> route: risk > 0.5 -> ``mlp``    (the fraud MLP, expensive)
                  otherwise  -> ``linear`` (logistic regression, cheap)
        -> union -> {"id", "user", "score", "alert", "risk", "model"}

About 14% of workload-F events are routed to the MLP. ``model`` says which scorer produced the
row. Run it: ``aisp run examples/router/pipeline.py --input IN.jsonl --output OUT.jsonl``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from aisp import Batch, NullSink, OnnxRuntime, Pipeline, WorkloadFSource

HERE = Path(__file__).resolve().parent
RISK_THRESHOLD = 0.5
ALERT_THRESHOLD = 0.9
OUTPUT_COLUMNS = ["id", "user", "score", "alert", "risk", "model"]


def _fraud_example() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_fraud", HERE.parent / "fraud" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the schema's annotations through it
    spec.loader.exec_module(module)
    return module


fraud = _fraud_example()
Event = fraud.Event  # type: ignore[attr-defined]


def emit(batch: Batch) -> Batch:
    out = batch.with_columns({"alert": batch.numpy("score") > ALERT_THRESHOLD})
    return out.select([*OUTPUT_COLUMNS, "_id", "_ingest_ns"])


def build(events: int = 200_000, seed: int = 0) -> Pipeline:
    p = Pipeline("router", output_columns=OUTPUT_COLUMNS)
    src = p.source("events", WorkloadFSource(events=events, seed=seed), schema=Event)
    stats = src.key_by("by_user", "user").running_stats("user_stats", "amount", count="n", mean="mean_amount")
    feats = stats.map_batch("features", fraud.features)  # type: ignore[attr-defined]
    x = {"features": "features"}
    triage = OnnxRuntime(HERE / "triage.onnx", name="triage")
    triaged = feats.infer("triage", triage, inputs=x, outputs={"risk": "risk"})
    branch = triaged.route(
        "route",
        ["mlp", "linear"],
        predicates={"mlp": lambda b: b.numpy("risk") > RISK_THRESHOLD},
        default="linear",
    )
    expensive = OnnxRuntime(HERE.parent / "fraud" / "model.onnx", name="fraud_mlp")
    cheap = OnnxRuntime(HERE / "linear.onnx", name="fraud_linear")
    mlp = branch["mlp"].infer("mlp", expensive, inputs=x, outputs={"score": "score"})
    linear = branch["linear"].infer("linear", cheap, inputs=x, outputs={"score": "score"})
    p.union("merge", mlp, linear).map_batch("emit", emit).sink("out", NullSink())
    return p
