"""Planted: a model whose calls fail. The fraud model answers nine calls in ten; every tenth
raises (as a model server does when its accelerator runs out of memory now and then), and the
rows of a failed call go to the dead letters. Latency stays fine; a tenth of the events are lost
to the output, which ``aisp diagnose`` ranks first as ``model_errors``.

    aisp run examples/diagnose/model_errors/pipeline.py --rate 5000 --metrics-port 9464
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from scenario import FRAUD_MODEL, build_scenario  # noqa: E402

from aisp import NullSink, Pipeline, PythonRuntime  # noqa: E402

RATE = 5000
FAIL_EVERY = 10


class FlakyModel:
    """The fraud model; every ``FAIL_EVERY``-th call raises."""

    def __init__(self) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._session = ort.InferenceSession(str(FRAUD_MODEL), options, providers=["CPUExecutionProvider"])
        self._calls = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        with self._lock:
            call = next(self._calls)
        if call % FAIL_EVERY == 0:
            raise RuntimeError("out of device memory (planted)")
        (score,) = self._session.run(
            ["score"], {"features": np.asarray(inputs["features"], dtype=np.float32)}
        )
        return {"score": score}


def build(events: int = 10_000_000) -> Pipeline:
    runtime = PythonRuntime(
        FlakyModel(), input_names=["features"], output_names=["score"], name="fraud_flaky"
    )
    return build_scenario("model_errors", events=int(events), sink=NullSink(), runtime=runtime)
