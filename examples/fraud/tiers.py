"""Workload F with QoS tiers: gold and silver users are scored by the FP32 model, bronze users by
its INT8 variant (``model.int8.onnx``, made by ``quantize.py``).

A user's tier comes from their id (u0, u3, ... gold; u1, u4, ... silver; the rest bronze), as a
plan column would in production. Under overload the model steps shed bronze rows first
(``overload="shed"``). Output rows: ``{"id", "user", "tier", "score", "alert", "model"}``.

Run: ``aisp run examples/fraud/tiers.py --input IN.jsonl --output OUT.jsonl``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from aisp import Batch, BatcherConfig, NullSink, OnnxRuntime, Pipeline, WorkloadFSource

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["id", "user", "tier", "score", "alert", "model"]
PLANS = np.array(["gold", "silver", "bronze"])


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(f"aisp_example_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the schema's annotations through it
    spec.loader.exec_module(module)
    return module


fraud = _load("pipeline")
Event = fraud.Event  # type: ignore[attr-defined]


def plan(batch: Batch) -> Batch:
    """The user's plan: by user number modulo 3 (vectorised on the digits of ``u<N>``)."""
    number = pc.cast(pc.utf8_slice_codeunits(batch.column("user"), 1), "int64").to_numpy()
    return batch.with_columns({"tier": PLANS[number % 3]})


def emit(batch: Batch) -> Batch:
    out = batch.with_columns({"alert": batch.numpy("score") > fraud.ALERT_THRESHOLD})  # type: ignore[attr-defined]
    return out.select([*OUTPUT_COLUMNS, "_id", "_ingest_ns"])


def build(events: int = 200_000, seed: int = 0) -> Pipeline:
    p = Pipeline("fraud-tiers", output_columns=OUTPUT_COLUMNS)
    src = p.source("events", WorkloadFSource(events=events, seed=seed), schema=Event)
    tiered = src.map_batch("plan", plan).tier("qos", "tier")
    stats = tiered.key_by("by_user", "user").running_stats(
        "user_stats", "amount", count="n", mean="mean_amount"
    )
    scored = stats.map_batch("features", fraud.features).infer_by_tier(  # type: ignore[attr-defined]
        "score",
        {0: OnnxRuntime(HERE / "model.int8.onnx", name="fraud_int8")},
        default=OnnxRuntime(HERE / "model.onnx", name="fraud"),
        inputs={"features": "features"},
        outputs={"score": "score"},
        batcher=BatcherConfig(max_batch_size=512, overload="shed", capacity_rows=16384),
    )
    scored.map_batch("emit", emit).sink("out", NullSink())
    return p
