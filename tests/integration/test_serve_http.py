"""`aisp serve` over OIP v2 HTTP/REST, with unmodified tritonclient.http and raw httpx requests."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as th

from tests.support.models import expected_score, fraud_repository
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    repo = fraud_repository(tmp_path_factory.mktemp("repo"), {1: 0.1})
    with aisp_serve(repo, http=True, grpc=False) as (addresses, proc):
        wait_http(addresses["http"])
        yield addresses["http"], proc


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_infer(served: tuple[str, subprocess.Popen[str]], binary: bool) -> None:
    address, _ = served
    client = th.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("fraud")
    meta = client.get_model_metadata("fraud")
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 18]}]
    assert client.get_model_config("fraud")["max_batch_size"] == 256
    x = np.random.default_rng(1).normal(size=(6, 18)).astype(np.float32)
    inp = th.InferInput("features", [6, 18], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = th.InferRequestedOutput("score", binary_data=binary)
    result = client.infer("fraud", [inp], outputs=[out])
    np.testing.assert_allclose(result.as_numpy("score")[:, 0], expected_score(x, 0.1), rtol=1e-6)
    assert result.get_response()["model_version"] == "1"
    stats = client.get_inference_statistics("fraud")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("fraud", "1")]
    assert stats[0]["inference_stats"]["success"]["count"] >= 1 and stats[0]["inference_count"] >= 6
    assert stats[0]["execution_count"] >= 1 and stats[0]["batch_stats"][0]["compute_infer"]["ns"] > 0
    assert client.get_inference_statistics()["model_stats"][0]["name"] == "fraud"  # every model


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "JSON is malformed"),
        (b'{"inputs": []}', "missing required input(s) ['features']"),
        (
            b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 18], "data": [1, 2]}]}',
            "shape does not match",
        ),
        (b'{"inputs": [{"name": "features", "datatype": "BF99", "shape": [1, 18], "data": []}]}', "datatype"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}',
            "unexpected inference input 'x'",
        ),
    ],
)
def test_bad_requests_get_400_with_a_reason(
    served: tuple[str, subprocess.Popen[str]], body: bytes, reason: str
) -> None:
    address, _ = served
    r = httpx.post(f"http://{address}/v2/models/fraud/infer", content=body, timeout=10)
    assert r.status_code == 400 and reason in r.json()["error"]


def test_unknown_model_is_404_and_server_keeps_serving(served: tuple[str, subprocess.Popen[str]]) -> None:
    address, _ = served
    assert httpx.get(f"http://{address}/v2/models/ghost", timeout=10).status_code == 404
    assert httpx.get(f"http://{address}/v2/health/ready", timeout=10).status_code == 200


def test_metrics_endpoint_parses_and_counts(served: tuple[str, subprocess.Popen[str]]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    address, _ = served
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 18], "data": [0.1] * 36}]}
    assert httpx.post(f"http://{address}/v2/models/fraud/infer", json=body, timeout=10).status_code == 200
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["aisp_requests"]
    ok = [s for s in requests.samples if s.name == "aisp_requests_total" and s.labels["code"] == "200"]
    assert ok and ok[0].labels == {"protocol": "http", "model": "fraud", "code": "200"} and ok[0].value >= 1
    assert any(
        s.name == "aisp_request_latency_seconds_count"
        for s in families["aisp_request_latency_seconds"].samples
    )
    assert any(
        s.name == "aisp_batch_size_rows_sum" and s.value >= 2
        for s in families["aisp_batch_size_rows"].samples
    )
    assert [s.labels for s in families["aisp_model_queue_rows"].samples] == [{"model": "fraud"}]


def test_sigterm_exits_cleanly(served: tuple[str, subprocess.Popen[str]]) -> None:
    _, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
