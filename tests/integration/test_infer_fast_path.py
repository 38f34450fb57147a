"""The infer route answered below the framework (``http_models.InferFastPath``) answers like the
rest of the server: versions in the path, JSON errors with their statuses, the body limit,
tokens, and the requests it does not own left to the router. A real ``aisp serve``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.models import expected_score, fraud_repository
from tests.support.serving import aisp_serve, wait_http

ROW = np.linspace(-1, 1, 18, dtype=np.float32)
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 18], "data": ROW.tolist()}]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fraud_repository(tmp_path_factory.mktemp("repo"), {1: 0.1, 2: 0.2})  # serves the latest


@pytest.fixture(scope="module")
def base(repo: Path) -> Iterator[str]:
    with aisp_serve(repo, http=True, grpc=False) as (addresses, _):
        wait_http(addresses["http"])
        yield f"http://{addresses['http']}"


def test_the_latest_version_and_a_version_in_the_path(base: str) -> None:
    latest = httpx.post(f"{base}/v2/models/fraud/infer", json=BODY, timeout=10)
    assert latest.status_code == 200 and latest.json()["model_version"] == "2"
    assert latest.json()["outputs"][0]["data"][0] == pytest.approx(
        float(expected_score(ROW[None, :], 0.2)[0]), abs=1e-5
    )
    assert latest.headers["content-type"] == "application/json"
    explicit = httpx.post(f"{base}/v2/models/fraud/versions/02/infer", json=BODY, timeout=10)
    assert explicit.status_code == 200 and explicit.json()["model_version"] == "2"
    old = httpx.post(f"{base}/v2/models/fraud/versions/1/infer", json=BODY, timeout=10)
    assert old.status_code in (400, 404) and "version" in old.json()["error"]


def test_errors_are_json_with_their_status(base: str) -> None:
    ghost = httpx.post(f"{base}/v2/models/ghost/infer", json=BODY, timeout=10)
    assert ghost.status_code == 404 and "unknown model" in ghost.json()["error"]
    bad = httpx.post(f"{base}/v2/models/fraud/infer", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "invalid inference request" in bad.json()["error"]
    tier = httpx.post(f"{base}/v2/models/fraud/infer", json=BODY, headers={"X-Tier": "platinum"}, timeout=10)
    assert tier.status_code == 400 and "X-Tier" in tier.json()["error"]
    get = httpx.get(f"{base}/v2/models/fraud/infer", timeout=10)  # not the fast path's: the router's 405
    assert get.status_code == 405 and get.json()["error"]
    assert httpx.get(f"{base}/v2/models/fraud", timeout=10).json()["name"] == "fraud"


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v2/models/fraud/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b'"error"' in answer, answer


def test_tokens_guard_the_fast_path(repo: Path) -> None:
    with aisp_serve(repo, http=True, grpc=False, extra_env={"AISP_TOKENS": "t0k"}) as (addresses, _):
        url = f"http://{addresses['http']}/v2/models/fraud/infer"
        wait_http(addresses["http"])
        assert httpx.post(url, json=BODY, timeout=10).status_code == 401
        assert (
            httpx.post(url, json=BODY, headers={"Authorization": "Bearer t0k"}, timeout=10).status_code == 200
        )
