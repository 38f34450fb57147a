"""Triton's system shared-memory extension against ``aisp serve --allow-shared-memory``, with
tritonclient's own shared-memory helpers over HTTP and gRPC (unary and stream), and raw
requests for what clients would not send; a server without the flag refuses registration.
"""

from __future__ import annotations

import base64
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from tests.support.serving import GRPC_SERVERS, conformance_server

Served = tuple[str, str, subprocess.Popen[str]]
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), dtype=np.int32)
NBYTES = A.nbytes  # 64


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with conformance_server(tmp_path_factory.mktemp("repo"), "--allow-shared-memory") as server:
        yield server


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def grpc_served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, served: Served
) -> Iterator[Served]:
    """The server on each gRPC transport (the module's own for the default one)."""
    if request.param == "native":
        yield served
        return
    root = tmp_path_factory.mktemp("repo")
    with conformance_server(root, "--allow-shared-memory", grpc_server=request.param) as server:
        yield server


@contextmanager
def registered(http_address: str) -> Iterator[tuple[object, object, str]]:
    """An input region holding A then B and an output region of two tensors, registered under
    fresh names; unregistered and destroyed afterwards."""
    tag = uuid.uuid4().hex[:8]
    inp = shm.create_shared_memory_region(f"in-{tag}", f"/aisp-test-in-{tag}", 2 * NBYTES)
    out = shm.create_shared_memory_region(f"out-{tag}", f"/aisp-test-out-{tag}", 2 * NBYTES)
    shm.set_shared_memory_region(inp, [A, B])
    client = httpclient.InferenceServerClient(http_address)
    client.register_system_shared_memory(f"in-{tag}", f"/aisp-test-in-{tag}", 2 * NBYTES)
    client.register_system_shared_memory(f"out-{tag}", f"/aisp-test-out-{tag}", 2 * NBYTES)
    try:
        yield inp, out, tag
    finally:
        client.unregister_system_shared_memory(f"in-{tag}")
        client.unregister_system_shared_memory(f"out-{tag}")
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)


@pytest.fixture
def regions(served: Served) -> Iterator[tuple[object, object, str]]:
    with registered(served[0]) as r:
        yield r


def shm_io(module: object, tag: str) -> tuple[list[object], list[object]]:
    inputs, outputs = [], []
    for i, name in enumerate(("INPUT0", "INPUT1")):
        inp = module.InferInput(name, [1, 16], "INT32")  # type: ignore[attr-defined]
        inp.set_shared_memory(f"in-{tag}", NBYTES, offset=i * NBYTES)
        inputs.append(inp)
    for i, name in enumerate(("OUTPUT0", "OUTPUT1")):
        out = module.InferRequestedOutput(name)  # type: ignore[attr-defined]
        out.set_shared_memory(f"out-{tag}", NBYTES, offset=i * NBYTES)
        outputs.append(out)
    return inputs, outputs


def check_outputs(out_region: object) -> None:
    got0 = shm.get_contents_as_numpy(out_region, np.int32, [1, 16])
    got1 = shm.get_contents_as_numpy(out_region, np.int32, [1, 16], offset=NBYTES)
    np.testing.assert_array_equal(got0, A + 1)
    np.testing.assert_array_equal(got1, A - 1)


def clear(region: object) -> None:
    shm.set_shared_memory_region(region, [np.zeros((2, 16), dtype=np.int32)])


def test_inputs_and_outputs_in_shared_memory_over_http(
    served: Served, regions: tuple[object, object, str]
) -> None:
    inp, out, tag = regions
    client = httpclient.InferenceServerClient(served[0])
    inputs, outputs = shm_io(httpclient, tag)
    result = client.infer("simple", inputs, outputs=outputs)
    check_outputs(out)
    entry = result.get_output("OUTPUT1")
    assert entry["shape"] == [1, 16] and entry["datatype"] == "INT32"
    assert "parameters" not in entry  # Triton's clients read any output parameters as binary data
    assert "data" not in entry


def test_inputs_and_outputs_in_shared_memory_over_grpc(grpc_served: Served) -> None:
    with registered(grpc_served[0]) as regions:
        _over_grpc(grpc_served[1], regions)


def _over_grpc(address: str, regions: tuple[object, object, str]) -> None:
    inp, out, tag = regions
    client = grpcclient.InferenceServerClient(address)
    inputs, outputs = shm_io(grpcclient, tag)
    result = client.infer("simple", inputs, outputs=outputs)
    check_outputs(out)
    output = result.get_output("OUTPUT0")
    assert output.parameters["shared_memory_region"].string_param == f"out-{tag}"
    assert output.parameters["shared_memory_byte_size"].int64_param == NBYTES
    clear(out)
    received: list[object] = []
    client.start_stream(callback=lambda result, error: received.append(error or result))
    client.async_stream_infer("simple", inputs, outputs=outputs)
    client.stop_stream()
    assert len(received) == 1 and not isinstance(received[0], Exception), received
    check_outputs(out)


def test_shared_memory_mixes_with_data_in_the_request(
    served: Served, regions: tuple[object, object, str]
) -> None:
    """One input in shared memory and one in the request (gRPC: raw contents index only the
    inputs sent in the request); one output to shared memory, the other answered."""
    inp, out, tag = regions
    for module, address in ((httpclient, served[0]), (grpcclient, served[1])):
        clear(out)
        first = module.InferInput("INPUT0", [1, 16], "INT32")
        first.set_data_from_numpy(A)
        second = module.InferInput("INPUT1", [1, 16], "INT32")
        second.set_shared_memory(f"in-{tag}", NBYTES, offset=NBYTES)
        to_shm = module.InferRequestedOutput("OUTPUT0")
        to_shm.set_shared_memory(f"out-{tag}", NBYTES)
        client = module.InferenceServerClient(address)
        result = client.infer(
            "simple", [second, first], outputs=[to_shm, module.InferRequestedOutput("OUTPUT1")]
        )
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16]), A + 1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - 1)


def test_status_and_unregister(served: Served) -> None:
    tag = uuid.uuid4().hex[:8]
    region = shm.create_shared_memory_region(f"s-{tag}", f"/aisp-test-s-{tag}", 256)
    http = httpclient.InferenceServerClient(served[0])
    grpc = grpcclient.InferenceServerClient(served[1])
    try:
        grpc.register_system_shared_memory(f"s-{tag}", f"/aisp-test-s-{tag}", 128, offset=64)
        assert http.get_system_shared_memory_status(f"s-{tag}") == [
            {"name": f"s-{tag}", "key": f"/aisp-test-s-{tag}", "offset": 64, "byte_size": 128}
        ]
        status = grpc.get_system_shared_memory_status(f"s-{tag}")
        assert status.regions[f"s-{tag}"].byte_size == 128 and status.regions[f"s-{tag}"].offset == 64
        assert any(r["name"] == f"s-{tag}" for r in http.get_system_shared_memory_status())
        with pytest.raises(InferenceServerException, match="already registered"):
            http.register_system_shared_memory(f"s-{tag}", f"/aisp-test-s-{tag}", 8)
        http.unregister_system_shared_memory(f"s-{tag}")
        assert all(r["name"] != f"s-{tag}" for r in http.get_system_shared_memory_status())
        response = httpx.get(f"http://{served[0]}/v2/systemsharedmemory/region/s-{tag}/status")
        assert response.status_code == 404 and "unable to find" in response.json()["error"]
        meta = httpx.get(f"http://{served[0]}/v2").json()
        assert "system_shared_memory" in meta["extensions"]
    finally:
        shm.destroy_shared_memory_region(region)


def post(served: Served, path: str, body: object) -> httpx.Response:
    return httpx.post(f"http://{served[0]}{path}", json=body, timeout=10)


def simple_request(
    in_params: dict[str, object], out_params: dict[str, object] | None = None
) -> dict[str, object]:
    body: dict[str, object] = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": in_params},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
        ]
    }
    if out_params is not None:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": out_params}]
    return body


def test_mistakes_are_400_with_a_reason(served: Served, regions: tuple[object, object, str]) -> None:
    _, _, tag = regions
    region = {"shared_memory_region": f"in-{tag}"}
    cases = [
        ({"shared_memory_region": "nope", "shared_memory_byte_size": NBYTES}, None, "unable to find"),
        (region, None, "'shared_memory_byte_size' must be specified"),
        ({"shared_memory_byte_size": NBYTES}, None, "without 'shared_memory_region'"),
        ({**region, "shared_memory_byte_size": 32}, None, "byte size mismatch"),
        (
            {**region, "shared_memory_byte_size": NBYTES, "shared_memory_offset": 2 * NBYTES},
            None,
            "past the end",
        ),
        ({**region, "shared_memory_byte_size": -1}, None, "'shared_memory_byte_size' must be an integer"),
        ({**region, "shared_memory_byte_size": "64"}, None, "must be an integer"),
        ({**region, "shared_memory_byte_size": NBYTES, "binary_data_size": NBYTES}, None, "neither"),
        (
            {**region, "shared_memory_byte_size": NBYTES},
            {"shared_memory_region": f"out-{tag}", "shared_memory_byte_size": 8},
            "should be at least 64 bytes",
        ),
        (
            {**region, "shared_memory_byte_size": NBYTES},
            {"shared_memory_region": f"out-{tag}", "shared_memory_byte_size": NBYTES, "binary_data": True},
            "only one of",
        ),
    ]
    for in_params, out_params, reason in cases:
        response = post(served, "/v2/models/simple/infer", simple_request(in_params, out_params))
        assert response.status_code == 400, (in_params, out_params, response.text)
        assert reason in response.json()["error"], (reason, response.json())
    good = post(
        served, "/v2/models/simple/infer", simple_request({**region, "shared_memory_byte_size": NBYTES})
    )
    assert good.status_code == 200 and good.json()["outputs"][0]["data"] == list(range(1, 17))


def test_registration_mistakes(served: Served, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    region = shm.create_shared_memory_region(f"r-{tag}", f"/aisp-test-r-{tag}", 64)
    link = f"aisp-test-link-{tag}"
    os.symlink(f"/dev/shm/aisp-test-r-{tag}", f"/dev/shm/{link}")
    try:
        cases = [
            ({"key": f"/nope-{tag}", "byte_size": 8}, 400, "does not exist"),
            ({"key": "/../etc/passwd", "byte_size": 8}, 400, "invalid shared memory key"),
            ({"key": "..", "byte_size": 8}, 400, "invalid shared memory key"),
            ({"key": f"/{link}", "byte_size": 8}, 400, "unable to open"),
            ({"key": f"/aisp-test-r-{tag}", "byte_size": 65}, 400, "past the end"),
            ({"key": f"/aisp-test-r-{tag}", "byte_size": 8, "offset": 60}, 400, "past the end"),
            ({"key": f"/aisp-test-r-{tag}", "byte_size": -8}, 400, "'byte_size'"),
            ({"key": f"/aisp-test-r-{tag}"}, 400, "byte_size"),
            ({"key": f"/aisp-test-r-{tag}", "byte_size": 8, "extra": 1}, 400, "extra"),
        ]
        for body, status, reason in cases:
            response = post(served, f"/v2/systemsharedmemory/region/x-{tag}/register", body)
            assert response.status_code == status, (body, response.text)
            assert reason in response.json()["error"], (body, response.json())
        grpc = grpcclient.InferenceServerClient(served[1])
        with pytest.raises(InferenceServerException, match="does not exist"):
            grpc.register_system_shared_memory(f"x-{tag}", f"/nope-{tag}", 8)
        assert all(
            r["name"] != f"x-{tag}"
            for r in httpclient.InferenceServerClient(served[0]).get_system_shared_memory_status()
        )
    finally:
        os.unlink(f"/dev/shm/{link}")
        shm.destroy_shared_memory_region(region)


def test_a_region_shrunk_after_registration_fails_the_request_not_the_server(served: Served) -> None:
    tag = uuid.uuid4().hex[:8]
    region = shm.create_shared_memory_region(f"t-{tag}", f"/aisp-test-t-{tag}", 2 * NBYTES)
    shm.set_shared_memory_region(region, [A, B])
    client = httpclient.InferenceServerClient(served[0])
    client.register_system_shared_memory(f"t-{tag}", f"/aisp-test-t-{tag}", 2 * NBYTES)
    try:
        os.truncate(f"/dev/shm/aisp-test-t-{tag}", 16)
        params = {
            "shared_memory_region": f"t-{tag}",
            "shared_memory_byte_size": NBYTES,
            "shared_memory_offset": NBYTES,
        }
        response = post(served, "/v2/models/simple/infer", simple_request(params))
        assert response.status_code == 400 and "shrunk" in response.json()["error"]
        assert httpx.get(f"http://{served[0]}/v2/health/live").status_code == 200
    finally:
        client.unregister_system_shared_memory(f"t-{tag}")
        shm.destroy_shared_memory_region(region)


_param_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.text(max_size=12),
    st.floats(allow_nan=False, allow_infinity=False),
)
_shm_params = st.dictionaries(
    st.sampled_from(
        ["shared_memory_region", "shared_memory_byte_size", "shared_memory_offset", "binary_data"]
    ),
    _param_values,
    max_size=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    in_params=_shm_params,
    out_params=st.none() | _shm_params,
    register=st.dictionaries(st.sampled_from(["key", "byte_size", "offset"]), _param_values, max_size=3),
)
def test_fuzzed_shared_memory_parameters_get_4xx_json(
    served: Served,
    in_params: dict[str, object],
    out_params: dict[str, object] | None,
    register: dict[str, object],
) -> None:
    for path, body in (
        ("/v2/models/simple/infer", simple_request(in_params, out_params)),
        ("/v2/systemsharedmemory/region/fuzz/register", register),
    ):
        response = post(served, path, body)
        assert response.status_code < 500, (body, response.text)
        if response.status_code != 200:
            assert isinstance(response.json()["error"], str)
    httpclient.InferenceServerClient(served[0]).unregister_system_shared_memory("fuzz")


def test_registration_is_refused_without_the_flag(tmp_path: Path) -> None:
    with conformance_server(tmp_path) as (http_address, grpc_address, _):
        response = post(
            (http_address, grpc_address, None),
            "/v2/systemsharedmemory/region/r/register",
            {"key": "/k", "byte_size": 8},
        )  # type: ignore[arg-type]
        assert response.status_code == 403 and "--allow-shared-memory" in response.json()["error"]
        with pytest.raises(InferenceServerException, match="allow-shared-memory"):
            grpcclient.InferenceServerClient(grpc_address).register_system_shared_memory("r", "/k", 8)
        assert httpx.get(f"http://{http_address}/v2/systemsharedmemory/status").json() == []
        assert "system_shared_memory" not in httpx.get(f"http://{http_address}/v2").json()["extensions"]
        params = {"shared_memory_region": "r", "shared_memory_byte_size": NBYTES}
        response = post((http_address, grpc_address, None), "/v2/models/simple/infer", simple_request(params))  # type: ignore[arg-type]
        assert response.status_code == 400 and "--allow-shared-memory" in response.json()["error"]


def test_cuda_shared_memory_lists_none_and_refuses_registration(served: Served) -> None:
    """As a Triton server with no CUDA region: clients (perf_analyzer) that clean up both kinds
    of region at the end succeed; registering one is refused with the reason."""
    http = httpclient.InferenceServerClient(served[0])
    grpc = grpcclient.InferenceServerClient(served[1])
    assert http.get_cuda_shared_memory_status() == []
    assert not grpc.get_cuda_shared_memory_status().regions
    http.unregister_cuda_shared_memory()
    grpc.unregister_cuda_shared_memory()
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
        http.register_cuda_shared_memory("c", b"handle", 0, 8)
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
        grpc.register_cuda_shared_memory("c", base64.b64encode(b"h" * 64), 0, 8)
