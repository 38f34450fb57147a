"""Admission control and limits of the OIP v2 HTTP app, over a real model server (ASGI in process)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from aisp.infer import BatcherConfig
from aisp.serve.http.app import create_app
from aisp.serve.models.server import ModelServer
from benchmarks.workload import mlp_model
from tests.support.models import FRAUD_CONFIG

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 18], "data": [0.5] * 18}]}


@pytest.fixture
def heavy(tmp_path: Path) -> Path:
    (tmp_path / "fraud").mkdir()
    (tmp_path / "fraud" / "config.pbtxt").write_text(FRAUD_CONFIG)
    mlp_model(tmp_path / "fraud" / "1" / "model.onnx")
    return tmp_path


async def burst(app: object, n: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
        return await asyncio.gather(*(client.post("/v2/models/fraud/infer", json=BODY) for _ in range(n)))


def test_overload_answers_429_with_retry_after_and_no_5xx(heavy: Path) -> None:
    models = ModelServer(heavy, batching={"fraud": BatcherConfig(max_batch_size=2, capacity_rows=2)})
    models.start()
    try:
        app = create_app(models)
        responses = asyncio.run(burst(app, 200))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) > 0
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["Retry-After"] == "1" and "overloaded" in refused.json()["error"]
        ok = next(r for r in responses if r.status_code == 200)
        assert len(ok.json()["outputs"][0]["data"]) == 1
        assert [r.status_code for r in asyncio.run(burst(app, 1))] == [200]  # recovers
    finally:
        models.close()


def test_oversized_body_is_413(heavy: Path) -> None:
    models = ModelServer(heavy)
    models.start()
    try:
        app = create_app(models, max_body_bytes=1000)

        async def post() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
                big = dict(BODY, inputs=[dict(BODY["inputs"][0], shape=[100, 18], data=[0.5] * 1800)])
                return await client.post("/v2/models/fraud/infer", json=big)

        r = asyncio.run(post())
        assert r.status_code == 413 and "exceeds the limit of 1000" in r.json()["error"]
        assert np.isfinite(
            models.infer("fraud", {"features": np.zeros((1, 18), np.float32)}).outputs["score"]
        ).all()
    finally:
        models.close()


def test_request_deadline_header(heavy: Path) -> None:
    """Rows still queued when the client's deadline passes are dropped: 504, and bad headers 400."""
    models = ModelServer(heavy, batching={"fraud": BatcherConfig(max_batch_size=1, capacity_rows=4096)})
    models.start()
    try:
        app = create_app(models)

        async def go() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
                url = "/v2/models/fraud/infer"
                tight = [
                    client.post(url, json=BODY, headers={"X-Request-Deadline-Ms": "0.5"}) for _ in range(50)
                ]
                bad = client.post(url, json=BODY, headers={"X-Request-Deadline-Ms": "soon"})
                return await asyncio.gather(*tight, bad)

        *tight, bad = asyncio.run(go())
        codes = [r.status_code for r in tight]
        assert set(codes) <= {200, 504} and 504 in codes
        assert "deadline" in next(r for r in tight if r.status_code == 504).json()["error"]
        assert bad.status_code == 400 and "milliseconds" in bad.json()["error"]
    finally:
        models.close()


def test_rate_limits_per_key_and_tier(heavy: Path) -> None:
    from aisp.admission.ratelimit import RateLimits

    models = ModelServer(heavy)
    models.start()
    try:
        app = create_app(models, limits=RateLimits(per_key_rps=0, per_tier_rps={0: 3}, burst_s=1.0))

        async def go() -> tuple[list[int], list[int], int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
                url = "/v2/models/fraud/infer"
                bronze = [
                    (await client.post(url, json=BODY, headers={"X-Tier": "bronze"})).status_code
                    for _ in range(6)
                ]
                gold = [
                    (await client.post(url, json=BODY, headers={"X-Tier": "gold"})).status_code
                    for _ in range(6)
                ]
                bad = (await client.post(url, json=BODY, headers={"X-Tier": "platinum"})).status_code
                return bronze, gold, bad

        bronze, gold, bad = asyncio.run(go())
        assert bronze[:3] == [200, 200, 200] and 429 in bronze[3:]
        assert gold == [200] * 6  # gold is not limited
        assert bad == 400
    finally:
        models.close()


def test_overload_over_a_real_server_stays_4xx_bounded_and_answers_every_accepted_request(
    tmp_path: Path,
) -> None:
    """300 concurrent requests against `aisp serve` with a queue of 8 rows and a slow model."""
    import psutil

    from tests.support.serving import aisp_serve, wait_http

    (tmp_path / "fraud").mkdir()
    config = FRAUD_CONFIG.replace("max_batch_size: 256", "max_batch_size: 4").replace(
        "preferred_batch_size: [ 64, 128 ]", "default_queue_policy { max_queue_size: 8 }"
    )
    (tmp_path / "fraud" / "config.pbtxt").write_text(config)
    mlp_model(tmp_path / "fraud" / "1" / "model.onnx")
    with aisp_serve(tmp_path, http=True, grpc=False) as (addresses, proc):
        wait_http(addresses["http"])
        url = f"http://{addresses['http']}/v2/models/fraud/infer"
        rss_before = psutil.Process(proc.pid).memory_info().rss

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=300)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                return await asyncio.gather(*(client.post(url, json=BODY) for _ in range(300)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) > 0
        assert all(r.headers["Retry-After"] for r in responses if r.status_code == 429)
        assert all(len(r.json()["outputs"][0]["data"]) == 1 for r in responses if r.status_code == 200)
        growth_mb = (psutil.Process(proc.pid).memory_info().rss - rss_before) / 2**20
        assert growth_mb < 100, f"RSS grew by {growth_mb:.0f} MB under overload"
        assert httpx.post(url, json=BODY, timeout=30).status_code == 200  # and it recovers


def test_grpc_rate_limits_by_tier(tmp_path: Path) -> None:
    """`[limits]` of the config file apply to gRPC infer (RESOURCE_EXHAUSTED) as to HTTP."""
    import grpc
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    from tests.support.models import fraud_repository
    from tests.support.serving import aisp_serve

    repo = fraud_repository(tmp_path / "repo", {1: 0.1})
    config = tmp_path / "aisp.toml"
    config.write_text("[limits]\nburst_s = 1.0\n[limits.tiers]\nbronze = 3\n")
    with aisp_serve(repo, http=False, grpc=True, extra_args=("--config", str(config))) as (addresses, _):
        client = tc.InferenceServerClient(addresses["grpc"])
        inp = tc.InferInput("features", [1, 18], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 18), np.float32))

        def call(tier: str) -> str:
            try:
                client.infer("fraud", [inp], headers={"x-tier": tier})
            except InferenceServerException as exc:
                return str(exc.status())
            return "OK"

        bronze = [call("bronze") for _ in range(6)]
        assert bronze[:3] == ["OK"] * 3 and str(grpc.StatusCode.RESOURCE_EXHAUSTED) in bronze[3:]
        assert [call("gold") for _ in range(6)] == ["OK"] * 6  # gold is not limited
        assert call("platinum") == str(grpc.StatusCode.INVALID_ARGUMENT)
