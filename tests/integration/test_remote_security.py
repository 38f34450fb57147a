"""Models on secured OIP v2 servers: a gRPC server with bearer tokens and TLS (a CA made here), as
``aisp serve --config ... --tls-cert ... --tls-key ...`` runs it. A remote runtime and a model pool
reach it with a token from a variable or a file and the CA; a wrong token or an untrusted
certificate fails at once and says which, never with the token in it; the fraud example scores
every event through it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from aisp.errors import ModelError
from aisp.infer.runtimes.endpoints import EndpointAccess, RetryPolicy
from aisp.infer.runtimes.pool import RemotePool
from aisp.infer.runtimes.remote import EndpointRefused, RemoteRuntime
from aisp.serve.auth import Tokens
from aisp.serve.grpc.server import GrpcServer
from aisp.serve.models.server import ModelServer
from benchmarks.workload import write_events
from tests.integration.test_exactly_once import ENV, PIPELINE
from tests.support.models import FRAUD_CONFIG, expected_score, fraud_repository
from tests.support.tls import Pair, issue, make_ca

TOKEN = f"tok-{uuid.uuid4().hex}"  # drawn: a scan for it finds only what leaked


@dataclass(frozen=True)
class Secured:
    address: str
    ca: Pair
    stranger: Pair  # a CA the server's certificate does not chain to


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    d = tmp_path_factory.mktemp("oip-tls")
    ca = make_ca(d)
    cert = issue(ca, d, "server", server=True)
    config = FRAUD_CONFIG.replace("max_batch_size: 256", "max_batch_size: 1024")  # the example's 512 fit
    models = ModelServer(fraud_repository(d / "repo", {1: 0.1}, config))
    models.start()
    server = GrpcServer(
        models, port=0, tokens=Tokens.of(tokens=[TOKEN]), tls=(cert.cert.read_bytes(), cert.key.read_bytes())
    )
    server.start()
    try:
        yield Secured(f"127.0.0.1:{server.port}", ca, make_ca(d / "other", "stranger"))
    finally:
        server.stop(0)
        models.close()


def features(n: int) -> np.ndarray:
    return np.random.default_rng(n).normal(size=(n, 18)).astype(np.float32)


def test_a_token_from_a_variable_or_a_file_and_the_ca_reach_the_model(
    secured: Secured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISP_TEST_MODEL_TOKEN", TOKEN)
    by_env = EndpointAccess.of(api_key_env="AISP_TEST_MODEL_TOKEN", ca=str(secured.ca.cert))
    (tmp_path / "token").write_text(TOKEN + "\n")
    by_file = EndpointAccess.of(api_key_file=str(tmp_path / "token"), ca=str(secured.ca.cert))
    x = features(9)
    for access in (by_env, by_file):
        rt = RemoteRuntime(secured.address, "fraud", access=access)
        np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)
        assert TOKEN not in repr(rt) + repr(access)
    pool = RemotePool([secured.address], "fraud", access=by_env)
    np.testing.assert_allclose(pool.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("wrong token", "authentication failed"),
        ("no token", "authentication failed"),
        ("untrusted certificate", "TLS handshake failed"),
        ("plain client", None),  # the server speaks only TLS: an outage to the client, retried
    ],
)
def test_a_refused_client_fails_at_once_and_says_why(secured: Secured, case: str, says: str | None) -> None:
    """Well before the 30 s a server that is still starting is waited for; a pool whose every
    endpoint refuses gives up as soon; the token is in no message."""
    access = {
        "wrong token": EndpointAccess.of(api_key=TOKEN + "x", ca=str(secured.ca.cert)),
        "no token": EndpointAccess.of(ca=str(secured.ca.cert)),
        "untrusted certificate": EndpointAccess.of(api_key=TOKEN, ca=str(secured.stranger.cert)),
        "plain client": EndpointAccess.of(api_key=TOKEN),
    }[case]
    started = time.monotonic()
    with pytest.raises(ModelError) as caught:
        RemoteRuntime(secured.address, "fraud", access=access, connect_timeout_s=2 if says is None else 30)
    took = time.monotonic() - started
    if says is None:
        assert not isinstance(caught.value, EndpointRefused)
        return
    assert isinstance(caught.value, EndpointRefused) and says in str(caught.value)
    assert secured.address in str(caught.value) and TOKEN not in str(caught.value)
    started_pool = time.monotonic()
    with pytest.raises(ModelError, match="every endpoint refused") as pooled:
        RemotePool([secured.address], "fraud", access=access, retry=RetryPolicy(attempts=1))
    assert took < 15 and time.monotonic() - started_pool < 15
    assert says in str(pooled.value) and TOKEN not in str(pooled.value)


def test_the_fraud_example_scores_every_event_on_the_secured_server(secured: Secured, tmp_path: Path) -> None:
    data, out, dead = tmp_path / "events.jsonl", tmp_path / "out.jsonl", tmp_path / "dl.jsonl"
    write_events(data, 2_000, seed=4, bad_every=0)
    env = {**ENV, "AISP_TEST_MODEL_TOKEN": TOKEN}
    cmd = [
        sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live", "--input", str(data),
        "--output", str(out), "--dead-letter", str(dead), "--param", f"model_url={secured.address}",
        "--param", "model_api_key_env=AISP_TEST_MODEL_TOKEN", "--param", f"model_ca={secured.ca.cert}",
    ]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 2_000
    assert not dead.exists() or dead.read_text() == ""
    assert TOKEN not in res.stdout + res.stderr + out.read_text()
    wrong = subprocess.run(cmd, env={**env, "AISP_TEST_MODEL_TOKEN": "nope"}, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert wrong.returncode != 0 and "authentication failed" in wrong.stderr, wrong.stderr[-2000:]
    assert "Traceback" not in wrong.stderr
    assert os.environ.get("AISP_TEST_MODEL_TOKEN") is None
