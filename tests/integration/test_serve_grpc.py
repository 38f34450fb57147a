"""`aisp serve REPOSITORY` with the unmodified tritonclient gRPC client."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.support.models import expected_score, fraud_repository, linear_model
from tests.support.serving import GRPC_SERVERS, aisp_serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    repo = fraud_repository(tmp_path_factory.mktemp("repo"), {1: 0.1})
    args = ("--allow-model-control",)
    with aisp_serve(repo, http=False, grpc=True, extra_args=args, grpc_server=request.param) as (
        addresses,
        proc,
    ):
        yield addresses["grpc"], repo, proc


def test_health_metadata_config_and_infer(served: tuple[str, Path, subprocess.Popen[str]]) -> None:
    url, _, _ = served
    client = tc.InferenceServerClient(url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("fraud")
    meta = client.get_model_metadata("fraud", as_json=True)
    assert meta["inputs"][0] == {"name": "features", "datatype": "FP32", "shape": ["-1", "18"]}
    assert client.get_model_config("fraud", as_json=True)["config"]["max_batch_size"] == 256
    x = np.random.default_rng(0).normal(size=(4, 18)).astype(np.float32)
    inp = tc.InferInput("features", [4, 18], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("fraud", [inp])
    np.testing.assert_allclose(result.as_numpy("score")[:, 0], expected_score(x, 0.1), rtol=1e-6)
    stats = client.get_inference_statistics("fraud", as_json=True)["model_stats"][0]
    assert stats["name"] == "fraud" and int(stats["inference_count"]) >= 4
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    with pytest.raises(InferenceServerException, match="unknown model: 'nope' is not found"):
        client.get_inference_statistics("nope")


def test_stream_infer(served: tuple[str, Path, subprocess.Popen[str]]) -> None:
    url, _, _ = served
    client = tc.InferenceServerClient(url)
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    xs = [np.full((1, 18), i / 10, dtype=np.float32) for i in range(5)]
    for x in xs:
        inp = tc.InferInput("features", [1, 18], "FP32")
        inp.set_data_from_numpy(x)
        client.async_stream_infer("fraud", [inp])
    client.stop_stream()
    assert len(results) == 5
    got = sorted(float(r.as_numpy("score")[0, 0]) for r in results)  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, sorted(float(expected_score(x, 0.1)[0]) for x in xs), rtol=1e-6)


def test_bad_requests_get_clear_errors(served: tuple[str, Path, subprocess.Popen[str]]) -> None:
    url, _, _ = served
    client = tc.InferenceServerClient(url)
    inp = tc.InferInput("wrong", [1, 18], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 18), np.float32))
    with pytest.raises(InferenceServerException, match="unexpected inference input 'wrong'"):
        client.infer("fraud", [inp])
    with pytest.raises(InferenceServerException, match="unknown model: 'ghost' is not found"):
        client.get_model_metadata("ghost")
    assert client.is_server_live()


def test_load_a_new_version_then_unload(served: tuple[str, Path, subprocess.Popen[str]]) -> None:
    url, repo, _ = served
    client = tc.InferenceServerClient(url)
    linear_model(repo / "fraud" / "2" / "model.onnx", 0.2)
    client.load_model("fraud")
    x = np.ones((1, 18), np.float32)
    inp = tc.InferInput("features", [1, 18], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("fraud", [inp])
    assert result.get_response().model_version == "2"
    np.testing.assert_allclose(result.as_numpy("score")[:, 0], expected_score(x, 0.2), rtol=1e-6)
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {"name": "fraud", "version": "2", "state": "READY"} in index
    client.unload_model("fraud")
    assert not client.is_model_ready("fraud")
    client.load_model("fraud")
    assert client.is_model_ready("fraud")


def test_sigterm_exits_cleanly(served: tuple[str, Path, subprocess.Popen[str]]) -> None:
    _, _, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
