"""Triton's own QA checks, re-expressed against ``aisp serve``: tritonclient over HTTP (sync and
asyncio) and gRPC (unary and stream), and raw HTTP where the checks send raw requests.

Models as in Triton's QA: ``simple`` (INT32 INPUT0, INPUT1 [16] -> OUTPUT0 sum, OUTPUT1
difference, max_batch_size 8) and identity models of several datatypes (tests/support/models.py).
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from tests.support.models import conformance_repository
from tests.support.serving import GRPC_SERVERS, aisp_serve, conformance_server, wait_http

Served = tuple[str, str, subprocess.Popen[str]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with conformance_server(tmp_path_factory.mktemp("repo")) as server:
        yield server


@pytest.fixture(scope="module")
def grpcio_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with conformance_server(tmp_path_factory.mktemp("repo"), grpc_server="grpcio") as server:
        yield server


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def grpc_address(request: pytest.FixtureRequest, served: Served) -> str:
    """The gRPC address of the conformance server on each transport."""
    if request.param == "native":
        return served[1]
    server: Served = request.getfixturevalue("grpcio_served")
    return server[1]


def simple_inputs(
    module: object, batch: int = 1, datatype: str = "INT32", binary: bool = True
) -> list[object]:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.ones((batch, 16), dtype=np.int32)
    out = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        inp = module.InferInput(name, list(arr.shape), datatype)  # type: ignore[attr-defined]
        if module is httpclient or module is httpaio:
            inp.set_data_from_numpy(arr.astype(np.float32) if datatype == "FP32" else arr, binary_data=binary)
        else:
            inp.set_data_from_numpy(arr.astype(np.float32) if datatype == "FP32" else arr)
        out.append(inp)
    return out


def check_simple(result: object, batch: int = 1) -> None:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)  # type: ignore[attr-defined]


# -- inference over every client -----------------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False])
def test_simple_over_http(served: Served, binary: bool) -> None:
    client = httpclient.InferenceServerClient(served[0])
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    check_simple(client.infer("simple", simple_inputs(httpclient, 3, binary=binary), outputs=outputs), 3)
    check_simple(client.infer("simple", simple_inputs(httpclient, 8, binary=binary)), 8)


def test_simple_over_grpc_unary_and_stream(served: Served, grpc_address: str) -> None:
    client = grpcclient.InferenceServerClient(grpc_address)
    check_simple(client.infer("simple", simple_inputs(grpcclient, 2)), 2)
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    for _ in range(3):
        client.async_stream_infer("simple", simple_inputs(grpcclient))
    client.stop_stream()
    assert len(results) == 3
    for r in results:
        check_simple(r)


def test_simple_over_the_clients_async_calls(served: Served, grpc_address: str) -> None:
    h = httpclient.InferenceServerClient(served[0], concurrency=4)
    pending = [h.async_infer("simple", simple_inputs(httpclient, 2)) for _ in range(8)]
    for request in pending:
        check_simple(request.get_result(), 2)
    g = grpcclient.InferenceServerClient(grpc_address)
    results: list[object] = []
    done = threading.Event()

    def callback(result: object, error: object) -> None:
        results.append(error or result)
        if len(results) == 8:
            done.set()

    for _ in range(8):
        g.async_infer("simple", simple_inputs(grpcclient, 2), callback)
    assert done.wait(30)
    for r in results:
        check_simple(r, 2)


def test_simple_over_the_asyncio_clients(served: Served, grpc_address: str) -> None:
    async def run() -> None:
        h = httpaio.InferenceServerClient(served[0])
        g = grpcaio.InferenceServerClient(grpc_address)
        try:
            assert await h.is_server_live() and await g.is_model_ready("simple")
            check_simple(await h.infer("simple", simple_inputs(httpaio, 2)), 2)
            check_simple(await g.infer("simple", simple_inputs(grpcaio, 2)), 2)
            meta = await h.get_model_metadata("simple")
            assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
        finally:
            await h.close()
            await g.close()

    asyncio.run(run())


# -- request checks (each over HTTP and gRPC) --------------------------------------------------------
def both(served: Served) -> list[tuple[object, object]]:
    return [
        (httpclient, httpclient.InferenceServerClient(served[0])),
        (grpcclient, grpcclient.InferenceServerClient(served[1])),
    ]


def test_batch_larger_than_max_batch_size_is_refused(served: Served) -> None:
    for module, client in both(served):
        with pytest.raises(InferenceServerException, match="batch-size must be <= 8 for 'simple'"):
            client.infer("simple", simple_inputs(module, 9))  # type: ignore[attr-defined]


def test_wrong_datatype_is_refused_not_converted(served: Served) -> None:
    for module, client in both(served):
        with pytest.raises(
            InferenceServerException, match="data-type is 'FP32', but model 'simple' expects 'INT32'"
        ):
            client.infer("simple", simple_inputs(module, 1, datatype="FP32"))  # type: ignore[attr-defined]


def test_unknown_missing_and_duplicate_tensors(served: Served) -> None:
    for module, client in both(served):
        a, b = simple_inputs(module)
        extra = module.InferInput("INPUT2", [1, 16], "INT32")  # type: ignore[attr-defined]
        extra.set_data_from_numpy(np.zeros((1, 16), np.int32))
        with pytest.raises(InferenceServerException, match="unexpected inference input 'INPUT2'"):
            client.infer("simple", [a, b, extra])  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="expected 2 inputs but got 1 inputs"):
            client.infer("simple", [a])  # type: ignore[attr-defined]
        out = [module.InferRequestedOutput("OUTPUT0") for _ in range(2)]  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="output 'OUTPUT0' already exists in request"):
            client.infer("simple", [a, b], outputs=out)  # type: ignore[attr-defined]
        dummy = [module.InferRequestedOutput("DUMMY")]  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="unexpected inference output 'DUMMY' for model"):
            client.infer("simple", [a, b], outputs=dummy)  # type: ignore[attr-defined]
        assert client.is_server_live()  # type: ignore[attr-defined]


def test_shape_mismatch_is_refused(served: Served) -> None:
    for module, client in both(served):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = module.InferInput(name, [1, 15], "INT32")  # type: ignore[attr-defined]
            inp.set_data_from_numpy(np.zeros((1, 15), np.int32))
            inputs.append(inp)
        with pytest.raises(InferenceServerException, match=r"unexpected shape for input 'INPUT0'.*\[-1,16\]"):
            client.infer("simple", inputs)  # type: ignore[attr-defined]


def test_unknown_model_and_readiness(served: Served) -> None:
    for _, client in both(served):
        assert not client.is_model_ready("foo")  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'foo' is not found"):
            client.get_model_metadata("foo")  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'simple' version 99"):
            client.get_model_metadata("simple", "99")  # type: ignore[attr-defined]
    r = httpx.post(f"http://{served[0]}/v2/models/foo/infer", content=b"{}", timeout=10)
    assert r.status_code == 404 and "unknown model" in r.json()["error"]
    r = httpx.get(f"http://{served[0]}/v2/models/foo/ready", timeout=10)
    assert r.status_code == 404 and r.json()["error"]


# -- BYTES on every path ----------------------------------------------------------------------------
WORDS = np.array([["hello", "wörld\x00!", ""]], dtype=object)


@pytest.mark.parametrize(
    ("binary_in", "binary_out"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_bytes_round_trip_over_http(served: Served, binary_in: bool, binary_out: bool) -> None:
    client = httpclient.InferenceServerClient(served[0])
    inp = httpclient.InferInput("INPUT0", [1, 3], "BYTES")
    inp.set_data_from_numpy(WORDS, binary_data=binary_in)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)
    got = client.infer("identity_bytes", [inp], outputs=[out]).as_numpy("OUTPUT0")
    assert [x.decode() if isinstance(x, bytes) else x for x in got.ravel()] == list(WORDS.ravel())


def test_bytes_round_trip_over_grpc_raw_and_typed_contents(served: Served, grpc_address: str) -> None:
    client = grpcclient.InferenceServerClient(grpc_address)
    inp = grpcclient.InferInput("INPUT0", [1, 3], "BYTES")
    inp.set_data_from_numpy(WORDS)
    got = client.infer("identity_bytes", [inp]).as_numpy("OUTPUT0")
    assert [x.decode() for x in got.ravel()] == list(WORDS.ravel())
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_address))
    request = pb.ModelInferRequest(model_name="identity_bytes")
    t = request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 3])
    t.contents.bytes_contents.extend([w.encode() for w in WORDS.ravel()])
    response = stub.ModelInfer(request)
    raw = response.raw_output_contents[0]
    assert len(raw) == sum(4 + len(w.encode()) for w in WORDS.ravel())
    assert raw[:9] == struct.pack("<I", 5) + b"hello"


# -- raw HTTP checks ----------------------------------------------------------------------------------
def post(served: Served, model: str, body: bytes | dict[str, object], **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"http://{served[0]}/v2/models/{model}/infer", content=content, headers=headers, timeout=30
    )


def simple_json(n0: int = 16, **extra: object) -> dict[str, object]:
    inputs = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(n0))}
        for n in ("INPUT0", "INPUT1")
    ]
    return {"inputs": inputs, **extra}


def test_json_data_of_the_wrong_length_and_depth(served: Served) -> None:
    for n, reason in ((15, "shape does not match true shape"), (18, "shape does not match true shape")):
        r = post(served, "simple", simple_json(n))
        assert r.status_code == 400 and reason in r.json()["error"]

    def nested(depth: int) -> dict[str, object]:
        data: object = [2.5]
        for _ in range(depth - 1):
            data = [data]
        return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": data}]}

    r = post(served, "identity_fp32", nested(120))
    assert r.status_code == 400 and "nesting depth exceeds maximum allowed limit (100)" in r.json()["error"]
    r = post(served, "identity_fp32", nested(50))
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.5]


def test_nested_json_crash_tests_answer_400(served: Served) -> None:
    r = post(served, "simple", b"[" * 150_000)
    assert r.status_code == 400 and r.json()["error"]
    body = b'{"ready":' + b"[" * 250_000 + b"true" + b"]" * 250_000 + b"}"
    r = httpx.post(f"http://{served[0]}/v2/repository/index", content=body, timeout=30)
    assert r.status_code == 400 and "ready" in r.json()["error"]
    assert httpx.get(f"http://{served[0]}/v2/health/live", timeout=10).status_code == 200


def test_shape_overflow_and_negative_dims(served: Served) -> None:
    for shape, reason in (([16, 2**60 + 2], "exceed maximum size"), ([2**32, 2**32], "exceed maximum size")):
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": [1.0]}]}
        r = post(served, "identity_fp32", body)
        assert r.status_code == 400 and reason in r.json()["error"]
    r = post(
        served,
        "identity_fp32",
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, -5], "data": []}]},
    )
    assert r.status_code == 400 and "shape" in r.json()["error"]


def test_inference_header_content_length_checks(served: Served) -> None:
    body = json.dumps(simple_json()).encode()
    for value in ("99999999999", "-1", "abc", str(len(body) + 1)):
        r = post(served, "simple", body, **{"Inference-Header-Content-Length": value})
        assert r.status_code == 400 and r.json()["error"], value
    r = post(served, "simple", body, **{"Inference-Header-Content-Length": str(len(body))})
    assert r.status_code == 200


def test_binary_output_defaults(served: Served) -> None:
    def outputs(extra: dict[str, object]) -> dict[str, dict[str, object]]:
        r = post(served, "simple", simple_json(**extra))
        assert r.status_code == 200
        n = int(r.headers.get("Inference-Header-Content-Length", len(r.content)))
        return {o["name"]: o for o in json.loads(r.content[:n])["outputs"]}

    plain = outputs({})
    assert plain["OUTPUT0"]["data"] == [2 * i for i in range(16)] and plain["OUTPUT1"]["data"] == [0] * 16
    listed = outputs(
        {"outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]}
    )
    assert "data" not in listed["OUTPUT0"] and "data" in listed["OUTPUT1"]
    everything = outputs({"parameters": {"binary_data_output": True}})
    assert all("data" not in o and o["parameters"]["binary_data_size"] == 64 for o in everything.values())
    overridden = outputs(
        {
            "parameters": {"binary_data_output": True},
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}],
        }
    )
    assert all("data" in o for o in overridden.values())


def test_raw_binary_request(served: Served) -> None:
    data = np.arange(8, dtype=np.float32)
    r = post(served, "identity_fp32", data.tobytes(), **{"Inference-Header-Content-Length": "0"})
    assert r.status_code == 200
    n = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[n:] == data.tobytes()
    r = post(served, "identity_bytes_1", b"427", **{"Inference-Header-Content-Length": "0"})
    n = int(r.headers["Inference-Header-Content-Length"])
    assert r.status_code == 200 and r.content[n + 4 :] == b"427"
    r = post(served, "simple", b"\x00" * 64, **{"Inference-Header-Content-Length": "0"})
    assert r.status_code == 400 and "Raw request must only have 1 input" in r.json()["error"]
    r = post(served, "identity_3d", b"\x00" * 16, **{"Inference-Header-Content-Length": "0"})
    assert r.status_code == 400 and "more than one variable-sized dimension" in r.json()["error"]


def test_zero_size_tensors_round_trip(served: Served, grpc_address: str) -> None:
    h = httpclient.InferenceServerClient(served[0])
    g = grpcclient.InferenceServerClient(grpc_address)
    for shape in ([1, 0], [3, 0], [0, 5]):
        for module, client in ((httpclient, h), (grpcclient, g)):
            inp = module.InferInput("INPUT0", shape, "FP32")
            inp.set_data_from_numpy(np.zeros(shape, np.float32))
            got = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")  # type: ignore[attr-defined]
            assert got.shape == tuple(shape)
    r = post(
        served,
        "simple",
        {
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [0, 16], "data": []} for n in ("INPUT0", "INPUT1")
            ]
        },
    )
    assert r.status_code == 200 and [o["shape"] for o in r.json()["outputs"]] == [[0, 16], [0, 16]]


def test_config_json_has_numbers(served: Served) -> None:
    r = httpx.get(f"http://{served[0]}/v2/models/simple/config", timeout=10)
    assert r.status_code == 200
    cfg = r.json()
    assert cfg["max_batch_size"] == 8 and cfg["input"][0]["dims"] == [16] and cfg["output"][1]["dims"] == [16]
    assert cfg["input"][0]["data_type"] == "TYPE_INT32" and cfg["input"][0]["is_shape_tensor"] is False
    assert httpclient.InferenceServerClient(served[0]).get_model_config("simple")["max_batch_size"] == 8


def test_unmatched_routes_and_methods_answer_json(served: Served) -> None:
    base = f"http://{served[0]}"
    for r, status in (
        (httpx.get(f"{base}/v2/nope", timeout=10), 404),
        (httpx.post(f"{base}/base_path/v2/models/simple/infer", content=b"{}", timeout=10), 404),
        (httpx.get(f"{base}/v2/models/simple/versions/abc", timeout=10), 404),
        (httpx.get(f"{base}/v2/models/simple/infer", timeout=10), 405),
        (httpx.delete(f"{base}/v2/health/live", timeout=10), 405),
    ):
        assert r.status_code == status and r.json()["error"]


# -- model control and repository names -------------------------------------------------------------
TRAVERSALS = ["..", "../outside", "../outside/evil", "/etc", "a/../b", "./x", " .."]


def test_model_control_is_off_by_default_and_names_are_checked_first(
    served: Served, grpc_address: str
) -> None:
    base = f"http://{served[0]}"
    r = httpx.post(f"{base}/v2/repository/models/simple/load", timeout=10)
    assert r.status_code == 403 and "explicit model load / unload is not allowed" in r.json()["error"]
    for path in ("%2E%2E", "..%2Foutside", "%2Fetc"):
        r = httpx.post(f"{base}/v2/repository/models/{path}/load", timeout=10)
        assert r.status_code in (400, 404) and r.json()["error"], path
    r = httpx.post(f"{base}/v2/repository/models/%2E%2E/load", timeout=10)
    assert r.status_code == 400 and "path traversal" in r.json()["error"]
    client = grpcclient.InferenceServerClient(grpc_address)
    for name in TRAVERSALS:
        with pytest.raises(InferenceServerException, match="path traversal") as info:
            client.load_model(name)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed") as info:
        client.unload_model("simple")
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    assert client.is_model_ready("simple")


def test_model_control_when_allowed(tmp_path: Path) -> None:
    repo = conformance_repository(tmp_path / "repo")
    outside = tmp_path / "outside" / "evil"
    outside.mkdir(parents=True)
    (outside / "config.pbtxt").write_text(
        (repo / "simple" / "config.pbtxt").read_text().replace("simple", "evil")
    )
    with aisp_serve(repo, http=True, grpc=True, extra_args=("--allow-model-control",)) as (addresses, _):
        wait_http(addresses["http"])
        h = httpclient.InferenceServerClient(addresses["http"])
        g = grpcclient.InferenceServerClient(addresses["grpc"])
        h.unload_model("simple")
        assert not h.is_model_ready("simple") and not g.is_model_ready("simple")
        g.load_model("simple")
        check_simple(g.infer("simple", simple_inputs(grpcclient)))
        with pytest.raises(InferenceServerException, match="no model 'nothing'"):
            h.load_model("nothing")
        for name in TRAVERSALS:
            with pytest.raises(InferenceServerException, match="path traversal"):
                h.load_model(name)
            with pytest.raises(InferenceServerException, match="path traversal"):
                g.load_model(name)
        assert "evil" not in {m["name"] for m in h.get_model_repository_index()}
        stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(addresses["grpc"]))
        request = pb.RepositoryModelLoadRequest(model_name="simple")
        request.parameters["version"].string_param = "one"
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelLoad(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


# -- headers ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "9" * 400, "-5", "0", "soon"])
def test_deadline_header_is_parsed_strictly(served: Served, value: str) -> None:
    r = post(served, "simple", simple_json(), **{"X-Request-Deadline-Ms": value})
    assert r.status_code == 400 and "X-Request-Deadline-Ms" in r.json()["error"]


def test_bad_requests_never_hold_up_good_ones(served: Served) -> None:
    """200 concurrent valid requests with 10 of zero rows among them: all answered."""
    good = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    )
    empty = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0, 3], "data": []}]})
    odd = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 5], "data": [1] * 5}]})

    bodies = [empty if i % 20 == 0 else odd if i % 7 == 0 else good for i in range(200)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            url = f"http://{served[0]}/v2/models/identity_fp32/infer"
            return await asyncio.gather(*(client.post(url, content=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    shapes = {good: [1, 3], empty: [0, 3], odd: [1, 5]}
    assert [r.json()["outputs"][0]["shape"] for r in responses] == [shapes[b] for b in bodies]


def test_a_request_the_http_parser_refuses_is_answered_in_json(served: Served) -> None:
    import socket

    host, port = served[0].rsplit(":", 1)
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v2/models/simple/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(raw)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
        assert json.loads(body)["error"]
