"""The native gRPC transport (``serve.grpc.native``) in process, with the real clients."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from aisp.errors import BadRequest
from aisp.serve.auth import Tokens
from aisp.serve.grpc.native import auth_refusal
from aisp.serve.grpc.server import GrpcServer, grpc_transport
from aisp.serve.models.server import ModelServer
from tests.support.models import expected_score, fraud_repository

INFER = "/inference.GRPCInferenceService/ModelInfer"


def test_the_transport_a_server_runs_on() -> None:
    assert grpc_transport("auto", tls=False) == "native"
    assert grpc_transport("auto", tls=False, host="::1") == "native"
    assert grpc_transport("auto", tls=False, host="0.0.0.0") == "grpcio"  # other machines reach it  # noqa: S104
    assert grpc_transport("native", tls=False, host="0.0.0.0") == "native"  # asked for by name  # noqa: S104
    assert grpc_transport("auto", tls=True) == "grpcio"
    assert grpc_transport("grpcio", tls=False) == "grpcio"
    with pytest.raises(BadRequest, match="no TLS"):
        grpc_transport("native", tls=True)
    with pytest.raises(BadRequest, match="one of auto, native, grpcio"):
        grpc_transport("h2", tls=False)


def test_auth_refusals_by_method() -> None:
    tokens = Tokens.of(tokens=["u"], admin_tokens=["a"])
    assert auth_refusal(tokens, "/inference.GRPCInferenceService/ServerLive", None) is None
    assert auth_refusal(tokens, INFER, None) == (grpc.StatusCode.UNAUTHENTICATED, "unauthorized")
    assert auth_refusal(tokens, INFER, "Bearer u") is None
    load = "/inference.GRPCInferenceService/RepositoryModelLoad"
    assert auth_refusal(tokens, load, "Bearer u") == (grpc.StatusCode.PERMISSION_DENIED, "forbidden")
    assert auth_refusal(tokens, load, "Bearer a") is None
    assert auth_refusal(Tokens.of(), INFER, None) is None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[GrpcServer, ModelServer]]:
    models = ModelServer(fraud_repository(tmp_path, {1: 0.1}))
    models.start()
    server = GrpcServer(models, port=0, transport="native")
    server.start()
    try:
        yield server, models
    finally:
        server.stop(grace_s=5)
        models.close()


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_concurrent_calls_each_get_their_own_rows(served: tuple[GrpcServer, ModelServer], seed: int) -> None:
    """Seeded: clients, calls per client and rows per call; every answer is its request's."""
    server, _ = served
    rng = np.random.default_rng(seed)
    clients = int(rng.integers(2, 12))
    plans = [[int(rng.integers(1, 9)) for _ in range(int(rng.integers(1, 20)))] for _ in range(clients)]
    failures: list[str] = []

    def run(plan: list[int], seed_i: int) -> None:
        local = np.random.default_rng(seed_i)
        client = tc.InferenceServerClient(server.address)
        for rows in plan:
            x = local.normal(size=(rows, 18)).astype(np.float32)
            inp = tc.InferInput("features", [rows, 18], "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("fraud", [inp]).as_numpy("score").reshape(-1)
            if not np.allclose(got, expected_score(x, 0.1), rtol=1e-5):
                failures.append(f"seed {seed}: rows {rows}: {got} != {expected_score(x, 0.1)}")

    threads = [threading.Thread(target=run, args=(plan, seed * 100 + i)) for i, plan in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]


def test_failures_are_answered_with_their_status(served: tuple[GrpcServer, ModelServer]) -> None:
    server, _ = served
    client = tc.InferenceServerClient(server.address)
    assert client.is_server_live() and client.is_model_ready("fraud")
    assert client.get_model_metadata("fraud").name == "fraud"
    inp = tc.InferInput("features", [1, 18], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 18), np.float32))
    with pytest.raises(InferenceServerException) as missing:
        client.infer("nope", [inp])
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    bad = tc.InferInput("features", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as shape:
        client.infer("fraud", [bad])
    assert shape.value.status() == "StatusCode.INVALID_ARGUMENT"
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary(INFER)  # no serializers: bytes in, bytes out
        with pytest.raises(grpc.RpcError) as garbage:
            raw(b"\xff\xff\xff not a protobuf", timeout=10)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as no_inputs:
            raw(pb.ModelInferRequest(model_name="fraud").SerializeToString(), timeout=10)
        assert no_inputs.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "missing required input(s) ['features']" in no_inputs.value.details()  # type: ignore[attr-defined]
    # the calls after the failures are answered as before
    assert client.infer("fraud", [inp]).as_numpy("score").shape == (1, 1)


def test_a_message_over_the_limit_is_refused_and_the_server_goes_on(
    served: tuple[GrpcServer, ModelServer],
) -> None:
    server, _ = served
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        raw = channel.unary_unary(INFER)
        with pytest.raises(grpc.RpcError) as big:
            raw(b"\x0a\xff\xff\xff\xff\x01" + bytes(65 << 20), timeout=60)
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "larger than max" in big.value.details()  # type: ignore[attr-defined]
    client = tc.InferenceServerClient(server.address)
    inp = tc.InferInput("features", [1, 18], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 18), np.float32))
    assert client.infer("fraud", [inp]).as_numpy("score").shape == (1, 1)


def test_the_stream_goes_through_the_fallback(served: tuple[GrpcServer, ModelServer]) -> None:
    server, _ = served
    client = tc.InferenceServerClient(server.address)
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    for i in range(5):
        inp = tc.InferInput("features", [1, 18], "FP32")
        inp.set_data_from_numpy(np.full((1, 18), i, np.float32))
        client.async_stream_infer("fraud", [inp])
    client.stop_stream()
    assert len(results) == 5
    for i, r in enumerate(results):
        np.testing.assert_allclose(
            r.as_numpy("score").reshape(-1),  # type: ignore[attr-defined]
            expected_score(np.full((1, 18), i, np.float32), 0.1),
            rtol=1e-5,
        )
