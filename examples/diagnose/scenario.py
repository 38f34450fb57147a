"""Shared by the planted scenarios of ``aisp diagnose`` (``<cause>/pipeline.py`` here).

Each scenario is workload F (events -> per-user running stats -> features -> model -> emit ->
sink) with one thing planted that ``aisp diagnose`` must name as the first cause. Run one with
its metrics exposed and diagnose it from another shell::

    aisp run examples/diagnose/slow_model/pipeline.py --rate 2000 --metrics-port 9464
    aisp diagnose --url http://127.0.0.1:9464

The rate each scenario is meant for is in its docstring (``RATE``); without ``--rate`` the
source runs as fast as the pipeline takes it, which plants the same bottleneck.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aisp import Batch, BatcherConfig, OnnxRuntime, Pipeline, WorkloadFSource
from aisp.pipeline import Stream
from aisp.sinks.base import Sink

FRAUD = Path(__file__).resolve().parents[1] / "fraud"
FRAUD_MODEL = FRAUD / "model.onnx"
COLUMNS = ["id", "user", "score", "n", "mean_amount"]


def mlp_model(width: int, *, seed: int = 0) -> Path:
    """``write_mlp`` once into the temp directory (the scenarios share it)."""
    path = Path(tempfile.gettempdir()) / "aisp-examples" / f"mlp-{width}-{seed}.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = write_mlp(path.with_suffix(f".{os.getpid()}.tmp"), width=width, seed=seed)
        tmp.replace(path)  # atomic: concurrent runs never read half a file
    return path


def write_mlp(path: Path, *, width: int = 1024, seed: int = 0) -> Path:
    """A fully connected net over the 18 fraud features (``features`` [batch, 18] -> width ->
    width -> ``score`` [batch, 1], random weights): milliseconds per call from width 512 up."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    dims = [18, width, width, 1]
    inits, nodes, prev = [], [], "features"
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
        weights = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        inits.append(numpy_helper.from_array(weights, f"w{i}"))
        out = "score" if b == 1 else f"a{i}"
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"])]
        nodes += [helper.make_node("Sigmoid" if b == 1 else "Relu", [f"h{i}"], [out])]
        prev = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 18])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _fraud_example() -> Any:
    """The fraud example's module (its ``features``), imported from its file once."""
    name = "aisp_example_fraud_pipeline"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FRAUD / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the schema's annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


features = _fraud_example().features


def build_scenario(
    name: str,
    *,
    events: int,
    sink: Sink,
    model: Path = FRAUD_MODEL,
    runtime: Any = None,
    batcher: BatcherConfig | None = None,
    model_budget_ms: float = 10.0,
    before_model: Callable[[Stream], Stream] | None = None,
    emit: Callable[[Batch], Batch] | None = None,
) -> Pipeline:
    """Workload F with the planted parts: the model (a file, or a ``runtime``) and its batching,
    steps added before the model (``before_model(stream) -> stream``), the emit function and the
    sink."""
    p = Pipeline(name, output_columns=COLUMNS)
    src = p.source("events", WorkloadFSource(events=events))
    stream = src.key_by("by_user", "user").running_stats(
        "user_stats", "amount", count="n", mean="mean_amount"
    )
    if before_model is not None:
        stream = before_model(stream)
    scored = stream.map_batch("features", features).infer(
        "score",
        runtime or OnnxRuntime(str(model), name=model.stem),
        inputs={"features": "features"},
        outputs={"score": "score"},
        batcher=batcher or BatcherConfig(max_batch_size=512, max_queue_delay_ms=1.0),
        latency_budget_ms=model_budget_ms,
    )
    keep = [*COLUMNS, "_id", "_ingest_ns"]
    scored.map_batch("emit", emit or (lambda b: b.select(keep))).sink("out", sink)
    return p
