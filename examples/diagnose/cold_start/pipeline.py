"""Planted: a model that warms up under traffic. The scored model compiles a kernel the first time
it sees a batch size (as TensorRT with dynamic shapes, ``torch.compile`` or XLA do: 250 ms here),
and declares no input shapes, so AISP cannot warm it up before the first events arrive. For its
first seconds every new batch size stalls the step; rows pile up behind it, the next batch has
yet another size, and the pipeline misses its target until the sizes it meets have all been
compiled. ``aisp diagnose`` names ``cold_start``: calls with a long tail on a version that began
serving moments ago.

    aisp run examples/diagnose/cold_start/pipeline.py --rate 5000 --metrics-port 9464
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from scenario import FRAUD_MODEL, build_scenario  # noqa: E402

from aisp import NullSink, Pipeline, PythonRuntime  # noqa: E402

RATE = 5000
COMPILE_S = 0.25


class CompilingModel:
    """The fraud model behind a per-shape compile: the first call at each batch size waits
    ``COMPILE_S``."""

    def __init__(self) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._session = ort.InferenceSession(str(FRAUD_MODEL), options, providers=["CPUExecutionProvider"])
        self._compiled: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        features = np.asarray(inputs["features"], dtype=np.float32)
        with self._lock:
            new = len(features) not in self._compiled
            self._compiled.add(len(features))
        if new:
            time.sleep(COMPILE_S)
        (score,) = self._session.run(["score"], {"features": features})
        return {"score": score}


def build(events: int = 10_000_000) -> Pipeline:
    runtime = PythonRuntime(
        CompilingModel(), input_names=["features"], output_names=["score"], name="fraud_jit"
    )
    return build_scenario("cold_start", events=int(events), sink=NullSink(), runtime=runtime)
