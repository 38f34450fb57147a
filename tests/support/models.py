"""Small real ONNX models made in tests, and Triton-style repositories holding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def slow_linear_model(path: Path, scale: float, *, work: int = 1200, width: int = 18) -> Path:
    """``linear_model``'s scores, after a ``work`` x ``work`` matrix product per model call that
    depends on the input (so it is not folded away) and adds nothing to the score: a version that
    is slower per batch, whatever the batch size."""
    w = numpy_helper.from_array(np.full((width, 1), scale, dtype=np.float32), "w")
    big = numpy_helper.from_array(np.full((work, work), 1e-9, dtype=np.float32), "big")
    shape = numpy_helper.from_array(np.array([work, work], dtype=np.int64), "shape")
    zero = numpy_helper.from_array(np.zeros((), dtype=np.float32), "zero")
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["p"]),
        helper.make_node("ReduceSum", ["features"], ["s"], keepdims=0),
        helper.make_node("Expand", ["s", "shape"], ["square"]),
        helper.make_node("MatMul", ["square", "big"], ["product"]),
        helper.make_node("ReduceSum", ["product"], ["busy"], keepdims=0),
        helper.make_node("Mul", ["busy", "zero"], ["nothing"]),
        helper.make_node("Add", ["p", "nothing"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow_linear",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[w, big, shape, zero],
    )
    return _save(graph, path)


def picky_model(path: Path) -> Path:
    """score = table[int(features[:, 0])] for a table of two entries: a row whose first feature
    is 2 or more makes the call fail (ONNX Runtime refuses an index out of bounds)."""
    table = numpy_helper.from_array(np.array([[0.25], [0.75]], dtype=np.float32), "table")
    start, end = (numpy_helper.from_array(np.array([v], dtype=np.int64), n) for v, n in ((0, "s"), (1, "e")))
    axis = numpy_helper.from_array(np.array([1], dtype=np.int64), "axis")
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["features", "s", "e", "axis"], ["first"]),
            helper.make_node("Cast", ["first"], ["index"], to=TensorProto.INT64),
            helper.make_node("Squeeze", ["index", "axis"], ["flat"]),
            helper.make_node("Gather", ["table", "flat"], ["score"], axis=0),
        ],
        "picky",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 18])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[table, start, end, axis],
    )
    return _save(graph, path)


def onnx_model(
    path: Path,
    *,
    inputs: dict[str, tuple[int, list[Any]]] | None = None,
    output: tuple[str, int, list[Any]] = ("score", TensorProto.FLOAT, ["N", 1]),
    width: int = 18,
    size: int = 1,
    opaque: bool = False,
) -> Path:
    """An ONNX model: the float sum of its inputs (``name -> (type, shape)``, each ``[N, width]``)
    times a ``[width, size]`` matrix, cast to the output's type; shapes are declared as given.
    ``opaque``: the product is reshaped to ``[N, -1]`` by a shape computed in the graph, so
    ONNX Runtime cannot tell the output's size before running it."""
    inputs = inputs or {"features": (TensorProto.FLOAT, ["N", width])}
    nodes, floats = [], []
    for name in inputs:
        floats.append(f"{name}_f")
        nodes.append(helper.make_node("Cast", [name], [floats[-1]], to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Sum", floats, ["total"]))
    nodes.append(helper.make_node("MatMul", ["total", "w"], ["z"]))
    consts = {"w": np.full((width, size), 0.1, dtype=np.float32)}
    if opaque:
        consts |= {k: np.array([v], dtype=np.int64) for k, v in (("zero", 0), ("one", 1), ("rest", -1))}
        nodes += [
            helper.make_node("Shape", ["z"], ["z_shape"]),
            helper.make_node("Slice", ["z_shape", "zero", "one"], ["rows"]),
            helper.make_node("Concat", ["rows", "rest"], ["shape"], axis=0),
            helper.make_node("Reshape", ["z", "shape"], ["z_again"]),
        ]
    nodes.append(helper.make_node("Cast", ["z_again" if opaque else "z"], [output[0]], to=output[1]))
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(*output)],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return _save(graph, path)


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


_ONNX_TYPES = {
    "INT32": TensorProto.INT32,
    "INT8": TensorProto.INT8,
    "UINT8": TensorProto.UINT8,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BOOL": TensorProto.BOOL,
    "BYTES": TensorProto.STRING,
}
_CONFIG_TYPES = {k: f"TYPE_{'STRING' if k == 'BYTES' else k}" for k in _ONNX_TYPES}


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _dims(dims: list[int]) -> list[str | int]:
    return ["batch", *(d if d >= 0 else f"d{i}" for i, d in enumerate(dims))]


def simple_repository_model(root: Path, *, max_batch_size: int = 8) -> None:
    """Triton's QA model ``simple``: INT32 INPUT0, INPUT1 [16] -> OUTPUT0 = sum, OUTPUT1 = difference."""
    shape = _dims([16])
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    _save(graph, root / "simple" / "1" / "model.onnx")
    tensors = ", ".join(f'{{ name: "{n}" data_type: TYPE_INT32 dims: [ 16 ] }}' for n in ("INPUT0", "INPUT1"))
    outputs = ", ".join(
        f'{{ name: "{n}" data_type: TYPE_INT32 dims: [ 16 ] }}' for n in ("OUTPUT0", "OUTPUT1")
    )
    (root / "simple" / "config.pbtxt").write_text(
        f'name: "simple"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        f"input [ {tensors} ]\noutput [ {outputs} ]\n"
    )


def identity_repository_model(
    root: Path, name: str, datatype: str, dims: list[int], *, max_batch_size: int = 8
) -> None:
    """``name``: OUTPUT0 = INPUT0, of ``datatype`` and ``dims`` (-1: any) after the batch."""
    shape = _dims(dims)
    t = _ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", t, shape)],
        [helper.make_tensor_value_info("OUTPUT0", t, shape)],
    )
    _save(graph, root / name / "1" / "model.onnx")
    d = ", ".join(map(str, dims))
    cfg = _CONFIG_TYPES[datatype]
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "INPUT0" data_type: {cfg} dims: [ {d} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: {cfg} dims: [ {d} ] }} ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 500 }\n"
    )


def conformance_repository(root: Path) -> Path:
    """The models the OIP conformance and fuzz tests use (shapes as Triton's QA models have them)."""
    simple_repository_model(root)
    identity_repository_model(root, "identity_fp32", "FP32", [-1])
    identity_repository_model(root, "identity_fp16", "FP16", [-1])
    identity_repository_model(root, "identity_int8", "INT8", [16])
    identity_repository_model(root, "identity_uint8", "UINT8", [-1])
    identity_repository_model(root, "identity_int64", "INT64", [-1])
    identity_repository_model(root, "identity_bool", "BOOL", [-1])
    identity_repository_model(root, "identity_bytes", "BYTES", [-1])
    identity_repository_model(root, "identity_bytes_1", "BYTES", [1])
    identity_repository_model(root, "identity_3d", "FP32", [-1, -1])
    return root
