"""Small real ONNX models made in tests, and Triton-style repositories holding them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FRAUD_CONFIG = """
name: "fraud"
platform: "onnxruntime_onnx"
max_batch_size: 256
input [ { name: "features" data_type: TYPE_FP32 dims: [ 18 ] } ]
output [ { name: "score" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching {
  preferred_batch_size: [ 64, 128 ]
  max_queue_delay_microseconds: 500
}
version_policy: { latest: { num_versions: 1 } }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def linear_model(path: Path, scale: float, *, width: int = 18, input_name: str = "features") -> Path:
    """score = sigmoid(scale * sum(features)): versions differ by ``scale``."""
    w = numpy_helper.from_array(np.full((width, 1), scale, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "w"], ["z"]), helper.make_node("Sigmoid", ["z"], ["score"])],
        "linear",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def fraud_repository(root: Path, versions: dict[int, float], config: str = FRAUD_CONFIG) -> Path:
    """``root/fraud/config.pbtxt`` and one linear model per version (version -> scale)."""
    (root / "fraud").mkdir(parents=True, exist_ok=True)
    (root / "fraud" / "config.pbtxt").write_text(config)
    for version, scale in versions.items():
        linear_model(root / "fraud" / str(version) / "model.onnx", scale)
    return root


def expected_score(features: np.ndarray, scale: float) -> np.ndarray:
    z = features.astype(np.float32).sum(axis=1) * np.float32(scale)
    return (1.0 / (1.0 + np.exp(-z.astype(np.float64)))).astype(np.float32)
