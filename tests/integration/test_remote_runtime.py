"""The remote OIP v2 runtime against a real AISP gRPC server, through a fault proxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aisp import CollectSink, Pipeline, RunOptions, WorkloadFSource, run
from aisp.errors import ModelError
from aisp.faults import FaultProxy
from aisp.infer.runtimes.endpoints import BreakerConfig, RetryPolicy
from aisp.infer.runtimes.remote import RemoteRuntime
from aisp.serve.grpc.server import GrpcServer
from aisp.serve.models.server import ModelServer
from tests.support.models import expected_score, fraud_repository


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    root = fraud_repository(tmp_path_factory.mktemp("repo"), {1: 0.1})
    models = ModelServer(root)
    models.start()
    grpc_server = GrpcServer(models, port=0)
    grpc_server.start()
    yield grpc_server
    grpc_server.stop(0)
    models.close()


@pytest.fixture
def proxy(server: GrpcServer) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", server.port)) as p:
        yield p


def features(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 18)).astype(np.float32)


def remote(proxy: FaultProxy, **kw: object) -> RemoteRuntime:
    kw.setdefault("retry", RetryPolicy(attempts=4, base_ms=5, max_ms=50))
    return RemoteRuntime(f"127.0.0.1:{proxy.port}", "fraud", **kw)  # type: ignore[arg-type]


def test_results_equal_the_model_and_metadata_comes_from_the_server(proxy: FaultProxy) -> None:
    rt = remote(proxy)
    assert rt.input_names == ("features",) and rt.output_names == ("score",) and rt.version == "1"
    x = features(7)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 255, 256, 257, 600, 1025])
def test_a_batch_over_the_server_s_limit_goes_in_requests_it_takes(proxy: FaultProxy, rows: int) -> None:
    """The server's model takes at most 256 rows a request (its config): a larger batch goes as
    requests of at most 256, answered as one, in order (a pipeline's batcher may be set larger
    than a server it calls)."""
    rt = remote(proxy)
    assert rt.max_batch_size == 256
    before = rt.attempts
    x = features(rows, seed=rows)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)
    assert rt.attempts - before == -(-rows // 256)


def test_a_reset_connection_is_retried(proxy: FaultProxy) -> None:
    rt = remote(proxy)
    rt.run({"features": features(2)})
    proxy.reset_connections()
    before = rt.attempts
    x = features(3, seed=1)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)
    assert rt.attempts >= before + 1


def test_delays_beyond_the_timeout_fail_after_retries_then_recover(proxy: FaultProxy) -> None:
    rt = remote(proxy, timeout_ms=100, breaker=BreakerConfig(failures=100))
    rt.run({"features": features(1)})
    proxy.set(delay_ms=400)
    with pytest.raises(ModelError, match=r"failed after 4 attempt\(s\): .*DEADLINE_EXCEEDED"):
        rt.run({"features": features(1)})
    proxy.clear()
    x = features(4, seed=2)
    np.testing.assert_allclose(rt.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6)


def test_the_breaker_opens_fails_fast_and_closes_after_a_good_trial(proxy: FaultProxy) -> None:
    now = [0.0]
    rt = remote(proxy, timeout_ms=200, breaker=BreakerConfig(failures=3, reset_s=10.0), clock=lambda: now[0])
    rt.run({"features": features(1)})
    proxy.set(refuse=True)
    proxy.reset_connections()
    with pytest.raises(ModelError, match="failed after"):
        rt.run({"features": features(1)})
    assert rt.breaker.state == "open"
    attempts = rt.attempts
    with pytest.raises(ModelError, match="circuit open"):
        rt.run({"features": features(1)})
    assert rt.attempts == attempts, "an open breaker must not call the server"
    proxy.clear()
    now[0] = 11.0  # after reset_s: one trial call, which succeeds and closes the breaker
    rt.run({"features": features(1)})
    assert rt.breaker.state == "closed" and rt.breaker.opened == 1


def test_rows_that_fail_remotely_go_to_the_dead_letter_file(proxy: FaultProxy, tmp_path: Path) -> None:
    import msgspec

    rt = remote(proxy, timeout_ms=200, breaker=BreakerConfig(failures=2, reset_s=60.0))
    p = Pipeline("remote")
    out = CollectSink(columns=["id", "score"])
    (
        p.source("events", WorkloadFSource(events=2000))
        .map_batch("x", lambda b: b.with_columns({"features": np.zeros((b.num_rows, 18), np.float32)}))
        .infer("remote", rt, inputs={"features": "features"}, outputs={"score": "score"})
        .sink("out", out)
    )
    dl = tmp_path / "dl.jsonl"
    proxy.set(refuse=True)
    proxy.reset_connections()
    summary = run(p, RunOptions(dead_letter=str(dl)))
    dead = [msgspec.json.decode(x) for x in dl.read_text().splitlines()]
    assert summary.events_out == 0 and len(dead) == 2000
    assert all(d["step"] == "remote" and "EndpointUnavailable" in d["reason"] for d in dead)  # a ModelError
    assert any("circuit open" in d["reason"] for d in dead)


def test_a_server_still_starting_is_waited_for_and_one_that_stays_away_fails_clearly(
    server: GrpcServer,
) -> None:
    import threading

    with FaultProxy(("127.0.0.1", server.port)) as p:
        p.set(refuse=True)  # the server is not up yet
        threading.Timer(0.8, p.clear).start()
        rt = RemoteRuntime(
            f"127.0.0.1:{p.port}", "fraud", retry=RetryPolicy(attempts=2, base_ms=5, max_ms=20)
        )
        assert rt.input_names == ("features",)
        p.set(refuse=True)
        with pytest.raises(ModelError, match="waited 0.5 s for the server at start"):
            RemoteRuntime(
                f"127.0.0.1:{p.port}",
                "fraud",
                retry=RetryPolicy(attempts=2, base_ms=5, max_ms=20),
                connect_timeout_s=0.5,
            )
