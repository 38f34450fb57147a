from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aisp.errors import ModelError
from aisp.infer import CostModel, OnnxRuntime, PythonRuntime, Runtime, TensorSpec
from aisp.infer.runtimes.base import default_providers

N_FEATURES = 18


def make_model(path: Path, *, seed: int = 0, collapse_rows: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Write ``score = sigmoid(features @ w + b)`` (features float32 [N, 18], score [N, 1]).

    With ``collapse_rows`` the graph sums over the batch, so it returns one row whatever N is.
    """
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_FEATURES, 1)).astype(np.float32)
    b = rng.standard_normal(1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["sig" if collapse_rows else "score"]),
    ]
    if collapse_rows:
        nodes.append(helper.make_node("ReduceSum", ["sig", "axes"], ["score"], keepdims=1))
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if collapse_rows:
        inits.append(numpy_helper.from_array(np.array([0], dtype=np.int64), "axes"))
    graph = helper.make_graph(
        nodes,
        "score",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", N_FEATURES])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, [None, 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return w, b


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(x.astype(np.float32) @ w + b)))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    path = tmp_path_factory.mktemp("model") / "score.onnx"
    w, b = make_model(path)
    return path, w, b


def test_onnx_runtime_metadata(model_path: tuple[Path, Any, Any]) -> None:
    rt = OnnxRuntime(model_path[0], version="7")
    assert isinstance(rt, Runtime)
    assert (rt.name, rt.version, rt.provider) == ("score", "7", "CPUExecutionProvider")
    assert rt.input_names == ("features",)
    assert rt.output_names == ("score",)
    assert rt.input_specs["features"] == TensorSpec(np.dtype(np.float32), (None, N_FEATURES))
    assert "score" in repr(rt)


def test_onnx_runtime_matches_reference(model_path: tuple[Path, Any, Any]) -> None:
    path, w, b = model_path
    rt = OnnxRuntime(path, providers=["CPUExecutionProvider"], name="fraud")
    x = np.random.default_rng(1).standard_normal((37, N_FEATURES)).astype(np.float32)
    out = rt.run({"features": x})
    assert rt.name == "fraud"
    assert out["score"].shape == (37, 1)
    np.testing.assert_allclose(out["score"], reference(x, w, b), rtol=1e-5, atol=1e-6)


def test_onnx_runtime_warmup_runs_each_size(model_path: tuple[Path, Any, Any]) -> None:
    OnnxRuntime(model_path[0]).warmup([1, 64, 64, 512])


def test_onnx_runtime_rejects_changed_row_count(tmp_path: Path) -> None:
    path = tmp_path / "collapse.onnx"
    make_model(path, collapse_rows=True)
    rt = OnnxRuntime(path)
    with pytest.raises(ModelError, match="returned 1 rows in output 'score' for 5 input rows"):
        rt.run({"features": np.zeros((5, N_FEATURES), dtype=np.float32)})


def test_onnx_runtime_call_failure_is_model_error(model_path: tuple[Path, Any, Any]) -> None:
    rt = OnnxRuntime(model_path[0])
    with pytest.raises(ModelError, match="model 'score' failed"):
        rt.run({"features": np.zeros((2, 3), dtype=np.float32)})


def test_onnx_runtime_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ModelError, match=r"cannot load model .*nope\.onnx"):
        OnnxRuntime(missing)


def test_onnx_runtime_garbage_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError, match=r"bad\.onnx.*: \w+"):
        OnnxRuntime(bad)


def test_default_providers_prefers_gpu() -> None:
    assert default_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert default_providers(
        ["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"]
    ) == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_python_runtime_runs_and_checks() -> None:
    rt = PythonRuntime(lambda xs: {"y": xs["x"] + 1}, input_names=["x"], output_names=["y"], name="inc")
    assert isinstance(rt, Runtime)
    assert rt.provider == "python"
    assert rt.input_specs == {"x": TensorSpec()}
    assert rt.run({"x": np.arange(3)})["y"].tolist() == [1, 2, 3]

    missing = PythonRuntime(lambda xs: {}, input_names=["x"], output_names=["y"], name="m")
    with pytest.raises(ModelError, match="returned no output"):
        missing.run({"x": np.arange(3)})

    short = PythonRuntime(lambda xs: {"y": xs["x"][:1]}, input_names=["x"], output_names=["y"], name="s")
    with pytest.raises(ModelError, match="returned 1 rows"):
        short.run({"x": np.arange(3)})


def test_python_runtime_warmup() -> None:
    seen: list[tuple[tuple[int, ...], np.dtype[Any]]] = []

    def fn(xs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append((xs["x"].shape, xs["x"].dtype))
        return {"y": xs["x"][:, :1]}

    spec = TensorSpec(np.dtype(np.float32), (None, None, 4))
    rt = PythonRuntime(fn, input_names=["x"], output_names=["y"], name="w", input_specs={"x": spec})
    rt.warmup([2, 8, 2])
    assert seen == [((2, 1, 4), np.float32), ((8, 1, 4), np.float32)]

    unknown = PythonRuntime(fn, input_names=["x"], output_names=["y"], name="w")
    unknown.warmup([2])
    assert len(seen) == 2  # no specs: warm-up has nothing to build


def test_cost_model_fits_fixed_and_per_row() -> None:
    m = CostModel()
    assert m.expected_ns(100) == 0
    m.observe(10, 10_000 + 10 * 50)
    assert m.expected_ns(20) == 2 * m.expected_ns(10)  # one size seen: proportional
    for _ in range(50):
        m.observe(10, 10_000 + 10 * 50)
        m.observe(100, 10_000 + 100 * 50)
    assert m.fixed_ns == pytest.approx(10_000, rel=1e-3)
    assert m.per_row_ns == pytest.approx(50, rel=1e-3)
    assert m.expected_ns(512) == pytest.approx(10_000 + 512 * 50, rel=1e-3)


def test_cost_model_never_negative() -> None:
    m = CostModel()
    m.observe(1, 1_000)
    m.observe(100, 500)  # bigger batch faster: noise; fall back to the mean
    assert m.per_row_ns >= 0 and m.fixed_ns >= 0
    assert m.expected_ns(1) > 0


def test_weights_in_external_data_files_are_in_the_hash(tmp_path: Path) -> None:
    """A model whose weights live in an external-data file (as a model over 2 GB must): the hash
    covers that file, so a changed weight there is a changed model (a restore refuses it); a
    model that holds its weights hashes as its file."""
    from aisp.infer.runtimes.base import file_sha256, onnx_weights_sha256
    from tests.support.models import linear_model

    inline = linear_model(tmp_path / "inline.onnx", 0.1)
    assert onnx_weights_sha256(inline) == file_sha256(inline)
    model = onnx.load(str(inline))
    split = tmp_path / "split" / "model.onnx"
    split.parent.mkdir()
    onnx.save(model, str(split), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)  # fmt: skip
    before = OnnxRuntime(split).weights_sha256
    assert before == onnx_weights_sha256(split) != file_sha256(split)
    file_before = file_sha256(split)
    weights = split.parent / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[0] ^= 1  # one weight changed, the model file not touched
    weights.write_bytes(bytes(data))
    assert onnx_weights_sha256(split) != before
    assert file_sha256(split) == file_before  # the .onnx file itself did not change


def test_onnx_runtime_knows_its_precision(tmp_path: Path) -> None:
    """fp32 as written; int8 once ONNX Runtime's dynamic quantization has rewritten its MatMuls;
    fp16 when its inputs and outputs are float16."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fraud = Path(__file__).resolve().parents[4] / "examples" / "fraud" / "model.onnx"
    assert OnnxRuntime(fraud).precision == "fp32"
    quantize_dynamic(
        fraud, tmp_path / "int8.onnx", op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8
    )
    assert OnnxRuntime(tmp_path / "int8.onnx").precision == "int8"
    half = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 4])],
    )  # fmt: skip
    model = helper.make_model(half, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "half.onnx"))
    assert OnnxRuntime(tmp_path / "half.onnx").precision == "fp16"
