"""PyTorch runtime (optional extra): TorchScript and eager, side by side with ONNX in one pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the `torch` extra; .ci/run installs a CPU build when one is on disk

from aisp import CollectSink, Pipeline, WorkloadFSource, run  # noqa: E402
from aisp.errors import ModelError  # noqa: E402
from aisp.infer.runtimes.base import OnnxRuntime, TensorSpec  # noqa: E402
from aisp.infer.runtimes.torch import TorchRuntime  # noqa: E402
from tests.support.models import expected_score, linear_model  # noqa: E402

SPECS = {"features": TensorSpec(np.dtype(np.float32), (None, 18))}


class Linear(torch.nn.Module):  # type: ignore[misc,name-defined]
    def __init__(self, scale: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((18, 1), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[name-defined]
        return torch.sigmoid(x @ self.w)


def scripted(tmp_path: Path, scale: float) -> Path:
    """A TorchScript archive (the format is deprecated upstream but still loads)."""
    import warnings

    path = tmp_path / "linear.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Linear(scale)).save(str(path))
    return path


def exported(tmp_path: Path, scale: float) -> Path:
    """A torch.export program (.pt2), the current way to ship a model without its code."""
    path = tmp_path / "linear.pt2"
    batch = torch.export.Dim("batch")
    program = torch.export.export(Linear(scale), (torch.zeros(4, 18),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))
    return path


def test_exported_program_matches_the_reference(tmp_path: Path) -> None:
    rt = TorchRuntime(
        exported(tmp_path, 0.25), input_names=["features"], output_names=["score"], input_specs=SPECS
    )
    rt.warmup([1, 64])
    x = np.random.default_rng(3).normal(size=(5, 18)).astype(np.float32)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.25), rtol=1e-5)


def test_torchscript_model_matches_the_reference(tmp_path: Path) -> None:
    rt = TorchRuntime(
        scripted(tmp_path, 0.2), input_names=["features"], output_names=["score"], input_specs=SPECS
    )
    rt.warmup([1, 64])
    x = np.random.default_rng(0).normal(size=(9, 18)).astype(np.float32)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.2), rtol=1e-5)
    assert rt.provider == "torch:cpu" and rt.name == "linear"


def test_eager_module_with_weights_only_state_dict(tmp_path: Path) -> None:
    weights = tmp_path / "w.pt"
    torch.save(Linear(0.3).state_dict(), weights)
    rt = TorchRuntime(Linear(), weights=weights, input_names=["features"], output_names=["score"])
    x = np.ones((2, 18), np.float32)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.3), rtol=1e-5)


def test_a_pickled_object_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"w": object()}, evil)  # an arbitrary object: only loadable with weights_only=False
    with pytest.raises(ModelError, match="cannot load weights"):
        TorchRuntime(Linear(), weights=evil, input_names=["features"], output_names=["score"])


def test_torch_and_onnx_side_by_side_in_one_pipeline(tmp_path: Path) -> None:
    onnx_rt = OnnxRuntime(linear_model(tmp_path / "m.onnx", 0.1), name="onnx_linear")
    torch_rt = TorchRuntime(
        scripted(tmp_path, 0.1),
        input_names=["features"],
        output_names=["score"],
        input_specs=SPECS,
        name="torch_linear",
    )
    p = Pipeline("mixed")
    out = CollectSink(columns=["id", "score", "model", "features"])
    feats = p.source("events", WorkloadFSource(events=3000)).map_batch(
        "x",
        lambda b: b.with_columns(
            {"features": np.hstack([b.numpy("f"), np.ones((b.num_rows, 2))]).astype(np.float32)}
        ),
    )
    branch = feats.route("split", ["a", "b"], predicates={"a": lambda b: b.numpy("id") % 2 == 0}, default="b")
    a = branch["a"].infer("onnx", onnx_rt, inputs={"features": "features"}, outputs={"score": "score"})
    b = branch["b"].infer("torch", torch_rt, inputs={"features": "features"}, outputs={"score": "score"})
    p.union("merge", a, b).sink("out", out)
    run(p)
    assert sorted(r["id"] for r in out.rows) == list(range(3000))
    for r in out.rows:
        assert r["model"] == ("onnx_linear" if r["id"] % 2 == 0 else "torch_linear")
        x = np.asarray(r["features"], dtype=np.float32)[None, :]
        assert abs(r["score"] - expected_score(x, 0.1)[0]) < 1e-5
