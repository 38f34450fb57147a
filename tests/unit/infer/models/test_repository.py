from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from aisp.errors import ConfigError, ModelError
from aisp.infer import ModelConfig, ModelRepository, ServedModel, UnsupportedConfigWarning, VersionPolicy
from aisp.infer.models.repository import DTYPES, ModelContradictsConfig, _type_name
from aisp.infer.runtimes.base import TensorSpec
from tests.support.models import FRAUD_CONFIG, expected_score, fraud_repository, linear_model, onnx_model

# A config as Triton users write it: priorities, queue policies, several instances.
TRITON_CONFIG = """
name: "fraud"
platform: "onnxruntime_onnx"
max_batch_size: 512
input [
  {
    name: "features"
    data_type: TYPE_FP32
    dims: [ 18 ]
  }
]
output [
  {
    name: "score"
    data_type: TYPE_FP32
    dims: [ 1 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 128, 256 ]
  max_queue_delay_microseconds: 2000
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 50000
    max_queue_size: 4096
  }
  priority_queue_policy {
    key: 1
    value: { timeout_action: REJECT default_timeout_microseconds: 5000 }
  }
}
version_policy: { latest: { num_versions: 2 } }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def test_triton_config_is_honoured() -> None:
    cfg = ModelConfig.parse(TRITON_CONFIG)
    b = cfg.batcher
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == ("fraud", "onnxruntime_onnx", 512)
    assert [(t.name, t.dtype, t.dims) for t in cfg.inputs] == [("features", np.float32, (18,))]
    assert b.max_batch_size == 512 and b.preferred_batch_sizes == (128, 256)
    assert b.max_queue_delay_ms == 2.0 and not b.eager
    assert b.default_tier == 1 and cfg.priority_levels == 3
    assert b.timeout_ms == 50.0 and b.tier_timeout_ms == {2: 5.0}  # priority 1 is the top tier
    assert b.capacity_rows == 4096 and b.overload == "shed"
    assert b.instances == 2 and cfg.instances == 2
    assert cfg.version_policy == VersionPolicy("latest", num_versions=2)
    assert [cfg.tier(p) for p in (0, 1, 2, 3)] == [1, 2, 1, 0]


def test_unsupported_fields_are_warned_about_by_name() -> None:
    text = (
        FRAUD_CONFIG
        + 'model_warmup [ { name: "w" batch_size: 1 } ]\noptimization { priority: PRIORITY_MAX }\n'
    )
    with pytest.warns(UnsupportedConfigWarning) as rec:
        cfg = ModelConfig.parse(text, source="repo/fraud/config.pbtxt")
    messages = " ".join(str(w.message) for w in rec)
    for field in ("'model_warmup.name'", "'model_warmup.batch_size'", "'optimization.priority'"):
        assert field in messages
    assert "repo/fraud/config.pbtxt" in messages
    assert "model_warmup.batch_size" in cfg.ignored


def test_malformed_config_names_file_and_line() -> None:
    with pytest.raises(
        ConfigError, match=r"^x/config.pbtxt:3: malformed config.pbtxt: .*no field named \"max_batch\""
    ):
        ModelConfig.parse('name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch: 4\n', source="x/config.pbtxt")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('platform: "tensorflow_savedmodel" max_batch_size: 4', "not supported"),
        ('platform: "onnxruntime_onnx"', "max_batch_size must be >= 1"),
    ],
)
def test_unsupported_models_are_rejected(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.parse('name: "m" ' + text)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [3]),
        ("version_policy: { latest: { num_versions: 2 } }", [2, 3]),
        ("version_policy: { all: {} }", [1, 2, 3]),
        ("version_policy: { specific: { versions: [ 1, 3 ] } }", [1, 3]),
    ],
)
def test_version_policies(tmp_path: Path, policy: str, expected: list[int]) -> None:
    fraud_repository(
        tmp_path,
        {1: 0.1, 2: 0.2, 3: 0.3},
        config=FRAUD_CONFIG.replace("version_policy: { latest: { num_versions: 1 } }", policy),
    )
    (tmp_path / "fraud" / "7").mkdir()  # a version directory without a model does not count
    repo = ModelRepository(tmp_path)
    assert repo.models() == ["fraud"] and repo.versions("fraud") == [1, 2, 3]
    assert repo.serving_versions("fraud") == expected


def test_served_model_loads_newest_and_swaps(tmp_path: Path) -> None:
    fraud_repository(tmp_path, {1: 0.1})
    model = ServedModel(tmp_path, "fraud")
    x = np.random.default_rng(0).normal(size=(5, 18)).astype(np.float32)
    assert model.version == "1"
    np.testing.assert_allclose(model.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)
    assert model.refresh() is False
    linear_model(tmp_path / "fraud" / "2" / "model.onnx", 0.2)
    old = model.resolve()
    assert model.refresh() is True and model.version == "2" and model.swaps == 1
    np.testing.assert_allclose(model.run({"features": x})["score"][:, 0], expected_score(x, 0.2), rtol=1e-6)
    np.testing.assert_allclose(old.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)


def test_a_pinned_model_serves_its_version_whatever_arrives(tmp_path: Path) -> None:
    fraud_repository(tmp_path, {1: 0.1, 2: 0.2})
    model = ServedModel(tmp_path, "fraud", version=1, pin=True)
    linear_model(tmp_path / "fraud" / "3" / "model.onnx", 0.3)
    assert model.refresh() is False and model.version == "1" and model.swaps == 0
    with pytest.raises(ModelError, match="needs the version"):
        ServedModel(tmp_path, "fraud", pin=True)


def test_failed_load_keeps_the_old_version(tmp_path: Path) -> None:
    fraud_repository(tmp_path, {1: 0.1})
    model = ServedModel(tmp_path, "fraud")
    (tmp_path / "fraud" / "2").mkdir()
    (tmp_path / "fraud" / "2" / "model.onnx").write_bytes(b"not an onnx file")
    assert model.refresh() is False
    assert model.version == "1" and model.last_error is not None and "cannot load model" in model.last_error
    with pytest.raises(ModelError, match="cannot load model"):
        model.load(2)
    linear_model(tmp_path / "fraud" / "4" / "model.onnx", 0.4, input_name="x")
    with pytest.raises(ModelError, match="input .x. is not in config.pbtxt"):
        model.load(4)
    assert model.version == "1"


def test_unknown_model_and_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        ModelRepository(tmp_path / "nope")
    with pytest.raises(ModelError, match="no model 'ghost'"):
        ModelRepository(tmp_path).config("ghost")


def test_a_failed_version_is_retried_only_when_its_file_changes(tmp_path: Path) -> None:
    import os

    fraud_repository(tmp_path, {1: 0.1})
    model = ServedModel(tmp_path, "fraud")
    bad = tmp_path / "fraud" / "2" / "model.onnx"
    bad.parent.mkdir()
    bad.write_bytes(b"half-copied")
    assert model.refresh() is False and model.last_error
    model.last_error = None
    assert model.refresh() is False and model.last_error is None  # not retried
    linear_model(bad, 0.2)
    st = bad.stat()
    os.utime(bad, (st.st_atime, st.st_mtime + 5))
    assert model.refresh() is True and model.version == "2"


def test_hot_swap_under_load_loses_nothing(tmp_path: Path) -> None:
    """Rows stream through a batcher while versions swap back and forth: each row comes out once,
    computed entirely by the version it is tagged with. The stream goes on (at least 4,000 rows)
    until both versions have computed rows and the model swapped twice, however the swapper's
    thread is scheduled: a busy machine may run many batches between two swaps."""
    import threading
    import time

    from aisp.batch import Batch
    from aisp.infer import BatcherConfig, InferSpec, build_batcher

    fraud_repository(tmp_path, {1: 0.1, 2: 0.2})
    model = ServedModel(tmp_path, "fraud", version=1)
    spec = InferSpec(
        runtime=model,
        inputs={"features": "x"},
        outputs={"score": "score"},
        batcher=BatcherConfig(max_batch_size=64, capacity_rows=256),
    )
    out: list[Batch] = []
    dead: list[str] = []
    lock = threading.Lock()
    seen: set[str] = set()

    def emit(b: Batch) -> None:
        with lock:
            out.append(b)
            seen.update(b.pylist("model_version"))

    batcher = build_batcher(spec, emit=emit, dead_letter=lambda b, r: dead.append(r))
    batcher.start()
    rng = np.random.default_rng(1)
    stop = threading.Event()

    def swapper() -> None:
        v = 1
        while not stop.is_set():
            v = 3 - v
            model.load(v)

    t = threading.Thread(target=swapper)
    t.start()
    chunks: list[np.ndarray[Any, Any]] = []
    deadline = time.monotonic() + 120
    while len(chunks) < 100 or len(seen) < 2 or model.swaps < 2:
        assert time.monotonic() < deadline, f"versions {seen} computed rows, {model.swaps} swaps in 120 s"
        chunks.append(rng.normal(size=(40, 18)).astype(np.float32))
        start = 40 * (len(chunks) - 1)
        batcher.submit(Batch.from_columns({"x": chunks[-1]}, ids=np.arange(start, start + 40)))
        if len(chunks) >= 100:
            time.sleep(0.001)  # past the first 4,000 rows: leave the swapper room
    stop.set()
    t.join()
    batcher.close()
    xs = np.concatenate(chunks)
    assert not dead
    got = Batch.concat(out)
    ids = got.ids
    assert sorted(ids.tolist()) == list(range(len(xs)))
    versions = np.array(got.pylist("model_version"))
    assert set(versions.tolist()) == {"1", "2"} and model.swaps >= 2
    for v, scale in (("1", 0.1), ("2", 0.2)):
        rows = versions == v
        np.testing.assert_allclose(got.numpy("score")[rows], expected_score(xs[ids[rows]], scale), rtol=1e-5)
    assert set(got.pylist("model")) == {"fraud"}


# -- every version is checked against its config.pbtxt at load -----------------------------------

CONFIG_TYPES = ["TYPE_FP32", "TYPE_FP16", "TYPE_INT64", "TYPE_UINT8", "TYPE_BOOL", "TYPE_STRING"]


def one_tensor_config(kind: str, name: str, data_type: str, dims: list[int], max_batch_size: int) -> str:
    other = "output" if kind == "input" else "input"
    return (
        f'name: "m" max_batch_size: {max_batch_size}\n'
        f'{kind} [ {{ name: "{name}" data_type: {data_type} dims: [ {", ".join(map(str, dims))} ] }} ]\n'
        f'{other} [ {{ name: "keep" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n'
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_contradiction_between_a_model_and_its_config_is_named(data: st.DataObject) -> None:
    """A family: one tensor of the config (an input or an output, any datatype, 0-3 dims, fixed
    or -1) against a model that agrees (dynamic where the config fixes a size is agreement) or
    contradicts it in one way; the error names the tensor and both datatypes or shapes."""
    kind = data.draw(st.sampled_from(["input", "output"]))
    data_type = data.draw(st.sampled_from(CONFIG_TYPES))
    dims = data.draw(st.lists(st.one_of(st.just(-1), st.integers(1, 64)), max_size=3))
    max_batch_size = data.draw(st.integers(1, 512))
    cfg = ModelConfig.parse(one_tensor_config(kind, "x", data_type, dims, max_batch_size))
    name, dtype = "x", np.dtype(DTYPES[data_type])
    shape: list[int | None] = [None, *(None if d == -1 or data.draw(st.booleans()) else d for d in dims)]
    fault = data.draw(st.sampled_from([None, "name", "datatype", "size", "rank", "batch", "unlisted"]))
    if fault == "size" and len(dims) == 0:
        fault = "rank"
    if fault == "name":
        name = "y"
    elif fault == "datatype":
        dtype = np.dtype(DTYPES[data.draw(st.sampled_from([t for t in CONFIG_TYPES if t != data_type]))])
    elif fault == "size":
        i = data.draw(st.integers(1, len(dims)))
        shape[i] = 7 if dims[i - 1] == -1 else dims[i - 1] + data.draw(st.sampled_from([-1, 1]))
        shape[i] = shape[i] or 2  # never 0
    elif fault == "rank":
        shape = data.draw(st.sampled_from([shape[:-1], [*shape, None], [*shape, 3]])) if dims else [*shape, 3]
    elif fault == "batch":
        shape[0] = data.draw(st.sampled_from([1, max_batch_size]))
    keep = TensorSpec(np.dtype(np.float32), (None, 4))
    tensor = TensorSpec(dtype, tuple(shape))
    specs = {name: tensor, **({"extra": keep} if fault == "unlisted" and kind == "input" else {})}
    inputs, outputs = (specs, {"keep": keep}) if kind == "input" else ({"keep": keep}, specs)
    if fault is None or (fault == "unlisted" and kind == "output"):  # a model may have more outputs
        cfg.check("1", inputs, outputs)
        return
    with pytest.raises(ModelContradictsConfig) as caught:
        cfg.check("1", inputs, outputs)
    message = str(caught.value)
    assert "model 'm' version 1 contradicts" in message and len(caught.value.problems) >= 1
    if fault == "unlisted":
        assert "the model's input 'extra' is not in config.pbtxt" in message
        return
    assert f"{kind} 'x'" in message, message
    if fault == "name":
        assert f"the model has no such {kind}" in message
    elif fault == "datatype":
        assert f"{_type_name(dtype)} in the model, {data_type} in config.pbtxt" in message
    else:
        model = [-1 if d is None else d for d in shape]
        assert f"has shape {model} in the model, config.pbtxt gives {[-1, *dims]}" in message, message
        assert f"max_batch_size {max_batch_size}" in message


F = TensorProto.FLOAT
CONTRADICTIONS = {
    "an output of two values where the config says one": (
        {"size": 2, "output": ("score", F, ["N", 2])},
        "output 'score' has shape [-1, 2] in the model, config.pbtxt gives [-1, 1]",
    ),
    "an output left dynamic that answers two values": (
        {"size": 2, "output": ("score", F, ["N", "k"]), "opaque": True},
        "output 'score' answers one row with shape [1, 2] (the model declares [-1, -1]),"
        " config.pbtxt gives [-1, 1]",
    ),
    "an output of another name": (
        {"output": ("probability", F, ["N", 1])},
        "config.pbtxt lists output 'score', the model has no such output (it has ['probability'])",
    ),
    "an input of another name": (
        {"inputs": {"x": (F, ["N", 18])}},
        "config.pbtxt lists input 'features', the model has no such input (it has ['x'])",
    ),
    "an input the config does not list": (
        {"inputs": {"features": (F, ["N", 18]), "mask": (F, ["N", 18])}},
        "the model's input 'mask' is not in config.pbtxt (it lists ['features'])",
    ),
    "an output of another datatype": (
        {"output": ("score", TensorProto.DOUBLE, ["N", 1])},
        "output 'score' is TYPE_FP64 in the model, TYPE_FP32 in config.pbtxt",
    ),
    "an input of another datatype": (
        {"inputs": {"features": (TensorProto.FLOAT16, ["N", 18])}},
        "input 'features' is TYPE_FP16 in the model, TYPE_FP32 in config.pbtxt",
    ),
    "an input of other dimensions": (
        {"inputs": {"features": (F, ["N", 17])}, "width": 17},
        "input 'features' has shape [-1, 17] in the model, config.pbtxt gives [-1, 18]",
    ),
    "an input of another rank": (
        {"inputs": {"features": (F, ["N", 1, 18])}},
        "input 'features' has shape [-1, 1, 18] in the model, config.pbtxt gives [-1, 18]",
    ),
    "a fixed batch dimension": (
        {"inputs": {"features": (F, [1, 18])}},
        "input 'features' has shape [1, 18] in the model, config.pbtxt gives [-1, 18] (max_batch_size 256",
    ),
}


@pytest.mark.parametrize("case", sorted(CONTRADICTIONS))
def test_a_version_that_contradicts_its_config_is_refused_and_the_old_one_serves(
    tmp_path: Path, case: str
) -> None:
    shape, message = CONTRADICTIONS[case]
    fraud_repository(tmp_path, {1: 0.1})
    onnx_model(tmp_path / "fraud" / "2" / "model.onnx", **shape)  # type: ignore[arg-type]
    model = ServedModel(tmp_path, "fraud", version=1)
    with pytest.raises(ModelContradictsConfig) as caught:
        model.load(2)
    assert message in str(caught.value), str(caught.value)
    assert "model 'fraud' version 2 contradicts" in str(caught.value)
    assert model.version == "1" and model.refresh() is False and model.version == "1"
    with pytest.raises(ModelContradictsConfig):
        ServedModel(tmp_path, "fraud", version=2)


@pytest.mark.parametrize(
    "shape",
    [
        {"output": ("score", F, ["N", "k"]), "opaque": True},  # dynamic, answers one value
        {"inputs": {"features": (F, ["N", "w"])}},  # warmed up with the configured 18 features
        {"inputs": {"features": (F, [None, 18])}, "output": ("score", F, [None, None])},
    ],
)
def test_a_version_that_leaves_configured_sizes_dynamic_loads(tmp_path: Path, shape: dict[str, Any]) -> None:
    fraud_repository(tmp_path, {1: 0.1})
    onnx_model(tmp_path / "fraud" / "2" / "model.onnx", **shape)
    model = ServedModel(tmp_path, "fraud", version=1)
    assert model.load(2) == "2"
    x = np.ones((3, 18), dtype=np.float32)
    np.testing.assert_allclose(model.run({"features": x})["score"], np.full((3, 1), 1.8), rtol=1e-5)
