"""Bearer-token auth on both transports of `aisp serve`, with the real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from aisp.serve.auth import Tokens
from tests.support.models import fraud_repository
from tests.support.serving import GRPC_SERVERS, aisp_serve, wait_http

USER = {"Authorization": "Bearer user-token"}
ADMIN = {"Authorization": "Bearer admin-token"}


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def addresses(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    repo = fraud_repository(tmp_path_factory.mktemp("repo"), {1: 0.1})
    env = {"AISP_TOKENS": "user-token", "AISP_ADMIN_TOKENS": "admin-token"}
    with aisp_serve(repo, http=True, grpc=True, extra_env=env, grpc_server=request.param) as (addrs, _):
        wait_http(addrs["http"])
        yield addrs


def test_http_tokens_and_scopes(addresses: dict[str, str]) -> None:
    base = f"http://{addresses['http']}"
    assert httpx.get(f"{base}/v2/health/ready").status_code == 200  # probes need no token
    r = httpx.get(f"{base}/v2/models/fraud")
    assert (
        r.status_code == 401
        and r.json() == {"error": "unauthorized"}
        and r.headers["WWW-Authenticate"] == "Bearer"
    )
    assert httpx.get(f"{base}/v2/models/fraud", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/v2/models/fraud", headers=USER).status_code == 200
    r = httpx.post(f"{base}/v2/repository/models/fraud/load", headers=USER)
    assert r.status_code == 403 and r.json() == {"error": "forbidden"}
    assert httpx.post(f"{base}/v2/repository/models/fraud/load", headers=ADMIN).status_code == 200
    client = th.InferenceServerClient(addresses["http"])
    inp = th.InferInput("features", [1, 18], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 18), np.float32))
    # (a copy: the client adds its Inference-Header-Content-Length to the dict it is given)
    assert client.infer("fraud", [inp], headers=dict(USER)).as_numpy("score").shape == (1, 1)
    with pytest.raises(InferenceServerException):
        client.infer("fraud", [inp])


def test_grpc_tokens_and_scopes(addresses: dict[str, str]) -> None:
    client = tc.InferenceServerClient(addresses["grpc"])
    assert client.is_server_live()
    with pytest.raises(InferenceServerException, match="unauthorized"):
        client.get_model_metadata("fraud")
    assert client.get_model_metadata("fraud", headers={"authorization": "Bearer user-token"}).name == "fraud"
    with pytest.raises(InferenceServerException, match="forbidden"):
        client.load_model("fraud", headers={"authorization": "Bearer user-token"})
    client.load_model("fraud", headers={"authorization": "Bearer admin-token"})


def test_tokens_from_a_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "aisp.toml"
    cfg.write_text('[auth]\ntokens = ["a"]\nadmin_tokens = ["b"]\n')
    t = Tokens.load(cfg, environ={})
    assert (t.check("Bearer a", "infer"), t.check("Bearer a", "admin"), t.check("Bearer b", "admin")) == (
        200,
        403,
        200,
    )
    assert not Tokens.load(None, environ={}).enabled
