"""Planted: heavy serialisation. Each output row carries a 256-float embedding, and the sink
writes every row as a JSON line (to /dev/null, so no disk is involved): encoding the floats
as text costs far more CPU than any other step; at 30,000 events/s the sink's thread is near
saturation (at 20,000 a 2-vCPU AMD EPYC VM keeps up, at times within the latency target).

    aisp run examples/diagnose/serialization/pipeline.py --rate 30000 --metrics-port 9464
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from scenario import COLUMNS, build_scenario  # noqa: E402

from aisp import Batch, JsonlFileSink, Pipeline  # noqa: E402

RATE = 30_000
DIM = 256


def embed(batch: Batch) -> Batch:
    """A 256-dimensional embedding per event (vectorised: cheap to compute, costly to print)."""
    x = batch.numpy("features")
    proj = np.random.default_rng(0).normal(size=(x.shape[1], DIM)).astype(np.float32)
    return batch.with_columns({"embedding": np.tanh(x @ proj)}).select(
        [*COLUMNS, "embedding", "_id", "_ingest_ns"]
    )


def build(events: int = 10_000_000, output: str = "/dev/null") -> Pipeline:
    return build_scenario("serialization", events=int(events), sink=JsonlFileSink(path=output), emit=embed)
