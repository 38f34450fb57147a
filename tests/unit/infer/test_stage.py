from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pytest
from onnx import TensorProto, helper, numpy_helper

import aisp.infer
from aisp.batch import Batch, matrix_column
from aisp.errors import ConfigError, ModelError
from aisp.infer import (
    BatcherConfig,
    InferSpec,
    OnnxRuntime,
    PythonRuntime,
    TensorSpec,
    build_batcher,
    build_io,
)


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["logit"]),
            helper.make_node("Sigmoid", ["logit"], ["score"]),
        ],
        "fraud",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 18])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 1])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((18, 1)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(1).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("stage") / "fraud.onnx"
    onnx.save(model, str(path))
    return path


def direct(path: Path, features: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path))
    return sess.run(["score"], {"features": features.astype(np.float32)})[0][:, 0]


def test_public_api_is_sorted_and_complete() -> None:
    names = aisp.infer.__all__
    assert list(names) == sorted(names)
    assert all(hasattr(aisp.infer, n) for n in names)


def test_spec_validation(onnx_model: Path) -> None:
    rt = OnnxRuntime(onnx_model)
    with pytest.raises(ConfigError, match=r"inputs must map every input of model 'fraud' \['features'\]"):
        InferSpec(runtime=rt, inputs={}, outputs={"score": "s"})
    with pytest.raises(ConfigError, match=r"outputs must name outputs of model 'fraud'"):
        InferSpec(runtime=rt, inputs={"features": "f"}, outputs={"prob": "s"})
    two = PythonRuntime(lambda xs: xs, input_names=["a"], output_names=["a", "b"], name="two")
    with pytest.raises(ConfigError, match="output columns must be distinct"):
        InferSpec(runtime=two, inputs={"a": "x"}, outputs={"a": "y", "b": "y"})


def test_prepare_casts_to_float32_and_finish_adds_1d_score(onnx_model: Path) -> None:
    features = np.random.default_rng(0).standard_normal((20, 18))  # float64 column
    spec = InferSpec(runtime=OnnxRuntime(onnx_model), inputs={"features": "f"}, outputs={"score": "score"})
    prepare, finish = build_io(spec)
    batch = Batch.from_columns({"f": matrix_column(features)}).slice(5, 10)  # an offset slice
    inputs = prepare(batch)
    assert inputs["features"].dtype == np.float32
    assert inputs["features"].shape == (10, 18)
    out = finish(batch, spec.runtime.run(inputs))
    assert out.column("score").type == pa.float32()
    np.testing.assert_allclose(out.numpy("score"), direct(onnx_model, features[5:15]), rtol=1e-6)


def test_1d_column_feeds_rank_2_input_and_wide_output_becomes_a_list_column() -> None:
    def fn(xs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert xs["x"].shape[1:] == (1,) and xs["x"].dtype == np.float32
        return {"pair": np.hstack([xs["x"], -xs["x"]]), "flat": xs["x"][:, 0]}

    spec_x = TensorSpec(np.dtype(np.float32), (None, 1))
    rt = PythonRuntime(
        fn, input_names=["x"], output_names=["pair", "flat"], name="p", input_specs={"x": spec_x}
    )
    prepare, finish = build_io(
        InferSpec(runtime=rt, inputs={"x": "a"}, outputs={"pair": "pair", "flat": "flat"})
    )
    batch = Batch.from_columns({"a": np.arange(3, dtype=np.int64)})
    out = finish(batch, rt.run(prepare(batch)))
    assert out.column("pair").type == pa.list_(pa.float32(), 2)
    assert out.numpy("pair").tolist() == [[0, 0], [1, -1], [2, -2]]
    assert out.numpy("flat").tolist() == [0, 1, 2]


def test_rank_mismatch_and_3d_outputs_are_model_errors() -> None:
    spec_x = TensorSpec(np.dtype(np.float32), (None, 2, 2))
    rt = PythonRuntime(
        lambda xs: {"y": np.zeros((len(xs["x"]), 2, 2))},
        input_names=["x"],
        output_names=["y"],
        name="cube",
        input_specs={"x": spec_x},
    )
    prepare, finish = build_io(InferSpec(runtime=rt, inputs={"x": "a"}, outputs={"y": "y"}))
    batch = Batch.from_columns({"a": np.arange(3.0)})
    with pytest.raises(ModelError, match="wants rank 3"):
        prepare(batch)
    with pytest.raises(ModelError, match="expected \\[N\\] or \\[N, k\\]"):
        finish(batch, {"y": np.zeros((3, 2, 2))})


def test_build_batcher_end_to_end(onnx_model: Path) -> None:
    features = np.random.default_rng(1).standard_normal((300, 18)).astype(np.float32)
    spec = InferSpec(
        runtime=OnnxRuntime(onnx_model),
        inputs={"features": "f"},
        outputs={"score": "score"},
        batcher=BatcherConfig(max_batch_size=64),
    )
    out: list[Batch] = []
    lock = threading.Lock()

    def emit(batch: Batch) -> None:
        with lock:
            out.append(batch)

    dead: list[str] = []
    with build_batcher(spec, emit=emit, dead_letter=lambda b, r: dead.append(r)) as batcher:
        for start in range(0, 300, 30):
            ids = np.arange(start, start + 30, dtype=np.int64)
            batcher.submit(Batch.from_columns({"f": matrix_column(features[start : start + 30])}, ids=ids))
    assert dead == []
    result = Batch.concat(out)
    order = np.argsort(result.ids)
    assert result.ids[order].tolist() == list(range(300))
    np.testing.assert_allclose(result.numpy("score")[order], direct(onnx_model, features), rtol=1e-6)
