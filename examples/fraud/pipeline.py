"""Reference workload F: fraud scoring (see README.md in this folder).

parse -> per-user running count and mean of ``amount`` -> 18 features -> ONNX MLP with dynamic
batching -> ``{"id", "user", "score", "alert", "n", "mean_amount"}``.

Run it: ``aisp run examples/fraud/pipeline.py --input IN.jsonl --output OUT.jsonl``; without
``--input`` it scores generated events. ``--model-repository examples/fraud/repository`` serves
the model from a Triton-style repository and swaps to a newer version when one is copied in;
``--param model_url=HOST:PORT`` calls it on an OIP v2 gRPC server instead (``aisp serve``), and
``--param model_url=HOST:PORT,HOST:PORT,...`` on a pool of them (each batch to the least busy).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from aisp import Batch, BatcherConfig, NullSink, OnnxRuntime, Pipeline, ServedModel, WorkloadFSource
from aisp.infer.runtimes.endpoints import EndpointAccess
from aisp.infer.runtimes.pool import RemotePool
from aisp.infer.runtimes.remote import RemoteRuntime

HERE = Path(__file__).resolve().parent
MODEL = HERE / "model.onnx"
ALERT_THRESHOLD = 0.9
OUTPUT_COLUMNS = ["id", "user", "score", "alert", "n", "mean_amount"]

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class Event(msgspec.Struct):
    """One workload-F event; decoding validates types, required fields and the 16 features."""

    id: Int64
    user: str
    amount: float
    ts: Int64
    f: Annotated[list[float], msgspec.Meta(min_length=16, max_length=16)]


def features(batch: Batch) -> Batch:
    """18 float32 features: f[0..15], the user's running count, the user's running mean amount."""
    f = batch.numpy("f")
    x = np.empty((batch.num_rows, 18), dtype=np.float32)
    x[:, :16] = f
    x[:, 16] = batch.numpy("n")
    x[:, 17] = batch.numpy("mean_amount")
    return batch.with_columns({"features": x})


def emitter(columns: list[str]) -> Callable[[Batch], Batch]:
    """The output row: ``columns``, with alert = score > 0.9."""
    keep = [*columns, "_id", "_ingest_ns"]

    def emit(batch: Batch) -> Batch:
        out = batch.with_columns({"alert": batch.numpy("score") > ALERT_THRESHOLD})
        return out.select(keep)

    return emit


def build(
    events: int = 1_000_000,
    seed: int = 0,
    model: str | Path = MODEL,
    model_repository: str | Path | None = None,
    model_url: str | None = None,
    model_api_key_env: str | None = None,
    model_ca: str | None = None,
) -> Pipeline:
    """Workload F.

    With ``model_repository`` the model is ``fraud`` from that Triton-style repository (swapped
    to a newer version when one appears) and rows also carry ``model`` and ``model_version``.
    With ``model_url`` (``HOST:PORT``, or several joined by commas for a pool) the model is
    ``fraud`` on those OIP v2 gRPC servers, reached with the bearer token in the variable
    ``model_api_key_env`` and over TLS against the CA file ``model_ca`` when given.
    """
    runtime: OnnxRuntime | ServedModel | RemoteRuntime | RemotePool
    access = EndpointAccess.of(api_key_env=model_api_key_env, ca=model_ca)
    if model_url is not None and "," in model_url:  # a pool of servers, up to 2 batches in flight each
        urls = model_url.split(",")
        runtime = RemotePool(urls, "fraud", access=access)
        batcher = BatcherConfig(max_batch_size=512, max_queue_delay_ms=1.0, instances=2 * len(urls))
        columns = OUTPUT_COLUMNS
    elif model_url is not None:  # the model on an OIP v2 gRPC server (`aisp serve`, Triton, ...)
        runtime = RemoteRuntime(model_url, "fraud", access=access)
        batcher = BatcherConfig(max_batch_size=512, max_queue_delay_ms=1.0)
        columns = OUTPUT_COLUMNS
    elif model_repository is not None:
        runtime = ServedModel(model_repository, "fraud")
        batcher = runtime.config.batcher
        columns = [*OUTPUT_COLUMNS, "model", "model_version"]
    else:
        runtime = OnnxRuntime(str(model), name="fraud")
        batcher = BatcherConfig(max_batch_size=1024, max_queue_delay_ms=1.0)
        columns = OUTPUT_COLUMNS
    p = Pipeline("fraud", output_columns=columns)
    src = p.source("events", WorkloadFSource(events=events, seed=seed), schema=Event)
    stats = src.key_by("by_user", "user").running_stats("user_stats", "amount", count="n", mean="mean_amount")
    scored = stats.map_batch("features", features).infer(
        "score",
        runtime,
        inputs={"features": "features"},
        outputs={"score": "score"},
        batcher=batcher,
        latency_budget_ms=10.0,
    )
    scored.map_batch("emit", emitter(columns)).sink("out", NullSink())
    return p
