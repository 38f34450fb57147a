"""Three QoS tiers through a model that cannot keep up: the lowest tier is shed, gold never."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np

from aisp import (
    BatcherConfig,
    CollectSink,
    ExecutorOptions,
    Pipeline,
    PythonRuntime,
    RunOptions,
    WorkloadFSource,
    run,
)


def slow_model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    time.sleep(0.004)  # ~64 rows per 4 ms: about 16k rows/s at most
    return {"y": inputs["x"][:, :1]}


def test_overload_sheds_bronze_first_and_never_gold(tmp_path: Path) -> None:
    rt = PythonRuntime(slow_model, input_names=("x",), output_names=("y",), name="slow")
    names = np.array(["gold", "silver", "bronze"])
    p = Pipeline("tiers")
    out = CollectSink(columns=["id", "tier"])
    (
        p.source("events", WorkloadFSource(events=30_000))
        .map_batch("name", lambda b: b.with_columns({"tier": names[b.numpy("id") % 3]}))
        .tier("qos", "tier")
        .map_batch("x", lambda b: b.with_columns({"x": b.numpy("f")[:, :4].astype(np.float32)}))
        .infer(
            "model",
            rt,
            inputs={"x": "x"},
            outputs={"y": "y"},
            batcher=BatcherConfig(max_batch_size=64, capacity_rows=2048, overload="shed"),
        )
        .sink("out", out)
    )
    dl = tmp_path / "dl.jsonl"
    summary = run(
        p,
        RunOptions(
            execution=ExecutorOptions(rate_events_per_s=30_000, source_batch_rows=128), dead_letter=str(dl)
        ),
    )
    dead = [msgspec.json.decode(x) for x in dl.read_text().splitlines()]
    shed_tiers = [d["row"]["tier"] for d in dead if d["reason"] == "shed"]
    served = [r["tier"] for r in out.rows]
    assert len(served) + len(dead) == 30_000 and len(dead) == len(shed_tiers)
    assert shed_tiers.count("bronze") > 0, "the load was not above capacity"
    assert shed_tiers.count("gold") == 0
    assert served.count("gold") == 10_000
    assert shed_tiers.count("bronze") >= shed_tiers.count("silver")
    assert summary.models["model"]["shed"] == len(shed_tiers)
