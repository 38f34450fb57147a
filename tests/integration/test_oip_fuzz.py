"""Hostile requests against a real ``aisp serve``: mutated OIP requests over HTTP (JSON and the
binary extension) and gRPC (unary and stream), and hostile NDJSON into a served pipeline.

Every answer is a 2xx or a 4xx with a JSON ``error`` (gRPC: never UNKNOWN or INTERNAL), valid
requests sent between and after the hostile ones are answered correctly, and the server is alive
after each phase and exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from benchmarks.workload import parse_valid
from tests.support.hostile import HOSTILE_LINES, hostile_chunks, mixed_lines
from tests.support.serving import GRPC_SERVERS, ROOT, aisp_serve, conformance_server, wait_http

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)

Served = tuple[str, str, subprocess.Popen[str]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with conformance_server(tmp_path_factory.mktemp("repo")) as (http_address, grpc_address, proc):
        yield http_address, grpc_address, proc
        assert_alive(http_address, grpc_address)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{served[0]}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def grpcio_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with conformance_server(tmp_path_factory.mktemp("repo"), grpc_server="grpcio") as server:
        yield server
        assert_alive(server[0], server[1])


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def stub(request: pytest.FixtureRequest, served: Served) -> Iterator[Any]:
    """A stub of the conformance server on each gRPC transport."""
    address = served[1] if request.param == "native" else request.getfixturevalue("grpcio_served")[1]
    channel = grpc.insecure_channel(address)
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


VALID = {
    "simple": {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
            for n in ("INPUT0", "INPUT1")
        ],
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}],
    },
    "identity_fp32": {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]
    },
    "identity_int8": {
        "inputs": [{"name": "INPUT0", "datatype": "INT8", "shape": [1, 16], "data": [-3] * 16}]
    },
    "identity_bytes": {
        "inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}]
    },
    "identity_bool": {
        "inputs": [{"name": "INPUT0", "datatype": "BOOL", "shape": [1, 2], "data": [True, False]}]
    },
}


def assert_alive(http_address: str, grpc_address: str) -> None:
    """The server answers valid requests correctly over both transports."""
    r = httpx.post(f"http://{http_address}/v2/models/simple/infer", json=VALID["simple"], timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2 * i for i in range(16)]
    response = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_address)).ModelInfer(
        simple_proto()
    )
    assert np.frombuffer(response.raw_output_contents[1], np.int32).tolist() == [0] * 16


def check_http(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json")
        assert isinstance(r.json()["error"], str) and r.json()["error"]


def bytes_header(size: int) -> bytes:
    """The JSON header of a binary request with one BYTES input [1, 2] of ``size`` bytes."""
    inputs = [
        {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], "parameters": {"binary_data_size": size}}
    ]
    return json.dumps({"inputs": inputs}).encode()


# -- HTTP JSON --------------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    model = draw(st.sampled_from(sorted(VALID)))
    body: Any = json.loads(json.dumps(VALID[model]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(body)))
        kind = draw(st.integers(0, 3))
        if not where:
            body = draw(json_values) if kind == 0 else body
            continue
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        if kind == 3 and isinstance(parent, dict):
            parent.pop(where[-1], None)
        elif kind == 2 and isinstance(parent, list):
            parent.append(draw(json_values))
        else:
            parent[where[-1]] = draw(
                st.one_of(
                    json_values,
                    st.sampled_from([[True, 18], [2**32, 2**32], [0, 18], [-1], 72.0, "abc", {}, [], 1e300]),
                )
            )
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 3)) == 0:
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=6)) + raw[cut + draw(st.integers(0, 4)) :]
    headers = {}
    if draw(st.integers(0, 3)) == 0:
        headers["X-Request-Deadline-Ms"] = draw(
            st.sampled_from(["inf", "1e300", "-1", "x", "9" * 400, "5000"])
        )
    if draw(st.integers(0, 3)) == 0:
        headers["Inference-Header-Content-Length"] = str(draw(st.integers(-5, len(raw) + 5)))
    return model, raw, headers


@FUZZ
@given(mutated_requests())
def test_mutated_json_requests_get_4xx_never_5xx(
    http: httpx.Client, request_: tuple[str, bytes, dict[str, str]]
) -> None:
    model, body, headers = request_
    check_http(http.post(f"/v2/models/{model}/infer", content=body, headers=headers))


# -- HTTP binary extension ------------------------------------------------------------------------------
@st.composite
def mutated_binary(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    a = np.arange(16, dtype=np.int32).tobytes()
    inputs = [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}
        for n in ("INPUT0", "INPUT1")
    ]
    for t in inputs:
        if draw(st.booleans()):
            t["parameters"]["binary_data_size"] = draw(
                st.one_of(st.integers(-10, 200), st.sampled_from([72.0, "64", None, True, 2**70]))
            )
        if draw(st.integers(0, 4)) == 0:
            t["shape"] = draw(st.lists(st.integers(-3, 2**40), max_size=3))
        if draw(st.integers(0, 4)) == 0:
            t["datatype"] = draw(st.sampled_from(["FP32", "INT8", "BYTES", "FP16", "X"]))
    header = json.dumps({"inputs": inputs}).encode()
    blob = a + a
    blob = blob[: draw(st.integers(0, len(blob) + 10))] + draw(st.binary(max_size=10))
    length = len(header) + draw(st.integers(-3, 3)) if draw(st.booleans()) else len(header)
    return header + blob, {"Inference-Header-Content-Length": str(length)}


@FUZZ
@given(mutated_binary())
def test_mutated_binary_requests_get_4xx_never_5xx(
    http: httpx.Client, request_: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = request_
    check_http(http.post("/v2/models/simple/infer", content=body, headers=headers))


@FUZZ
@given(
    st.binary(max_size=300),
    st.sampled_from(["identity_bytes", "identity_bytes_1", "identity_fp16", "simple"]),
)
def test_arbitrary_bytes_in_every_binary_form(http: httpx.Client, blob: bytes, model: str) -> None:
    check_http(
        http.post(f"/v2/models/{model}/infer", content=blob, headers={"Inference-Header-Content-Length": "0"})
    )
    header = bytes_header(len(blob))
    check_http(
        http.post(
            f"/v2/models/{model}/infer",
            content=header + blob,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
    )


# -- gRPC ---------------------------------------------------------------------------------------------
def simple_proto() -> Any:
    request = pb.ModelInferRequest(model_name="simple")
    for n in ("INPUT0", "INPUT1"):
        request.inputs.add(name=n, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return request


CONTENT_FIELDS = [
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
]


@st.composite
def mutated_protos(draw: st.DrawFn) -> Any:
    model = draw(
        st.sampled_from(["simple", "identity_int8", "identity_fp16", "identity_bytes", "identity_uint8"])
    )
    request = pb.ModelInferRequest(
        model_name=model, model_version=draw(st.sampled_from(["", "", "1", "7", "x"]))
    )
    typed = draw(st.booleans())
    for i in range(draw(st.integers(0, 3))):
        t = request.inputs.add(
            name=draw(st.sampled_from(["INPUT0", "INPUT1", "X"])) if i else "INPUT0",
            datatype=draw(st.sampled_from(["INT32", "INT8", "UINT8", "FP16", "BYTES", "FP32", "BOOL", "Q"])),
            shape=draw(st.lists(st.integers(-(2**40), 2**40) | st.integers(-2, 20), max_size=3)),
        )
        if typed:
            field = draw(st.sampled_from(CONTENT_FIELDS))
            n = draw(st.integers(0, 20))
            if field == "bytes_contents":
                getattr(t.contents, field).extend(
                    draw(st.lists(st.binary(max_size=5), min_size=n, max_size=n))
                )
            elif field == "bool_contents":
                getattr(t.contents, field).extend([True] * n)
            elif field in ("uint_contents", "uint64_contents"):
                getattr(t.contents, field).extend(
                    draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
                )
            elif field in ("int_contents",):
                getattr(t.contents, field).extend(
                    draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
                )
            elif field == "int64_contents":
                getattr(t.contents, field).extend(
                    draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
                )
            else:
                getattr(t.contents, field).extend([0.5] * n)
        else:
            request.raw_input_contents.append(draw(st.binary(max_size=80)))
    if draw(st.booleans()):
        p = request.parameters[draw(st.sampled_from(["priority", "timeout", "other"]))]
        which = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "uint64_param"]))
        setattr(
            p,
            which,
            {"int64_param": -3, "string_param": "abc", "bool_param": True, "uint64_param": 2**63}[which],
        )
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "OUTPUT0", "NOPE"])))
        request.outputs.add(name="OUTPUT0")
    return request


BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@FUZZ
@given(mutated_protos())
def test_mutated_grpc_requests_get_clear_statuses(stub: Any, request_: Any) -> None:
    try:
        stub.ModelInfer(request_, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD_CODES, (exc.code(), exc.details())  # type: ignore[attr-defined]
        assert exc.details()  # type: ignore[attr-defined]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(st.lists(mutated_protos(), min_size=1, max_size=8))
def test_a_stream_answers_every_message_and_goes_on(stub: Any, requests: list[Any]) -> None:
    messages = [simple_proto(), *requests, simple_proto()]
    responses = list(stub.ModelStreamInfer(iter(messages), timeout=60))
    assert len(responses) == len(messages)
    for r in (responses[0], responses[-1]):
        assert not r.error_message
        assert np.frombuffer(r.infer_response.raw_output_contents[0], np.int32).tolist() == [
            2 * i for i in range(16)
        ]
    assert all(r.error_message or r.infer_response.outputs for r in responses)


# -- NDJSON into a served pipeline ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    target = ROOT / "examples" / "fraud" / "pipeline.py"
    with aisp_serve(target, http=True, grpc=True) as (addresses, proc):  # type: ignore[arg-type]
        wait_http(addresses["http"])
        yield addresses["http"], addresses["grpc"], proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def check_results(lines: list[bytes], answer: bytes, first_line: int = 1) -> None:
    """Each non-blank line's result, in order: its output row, or an error with its line
    number (counted over the request or stream, from ``first_line``)."""
    sent = [line for line in lines if line]  # blank lines are skipped
    results = [json.loads(x) for x in answer.splitlines()]
    assert len(results) == len(sent)
    for n, (line, result) in enumerate(zip(sent, results, strict=True), first_line):
        event = parse_valid(line)
        if event is None:
            assert result["error"] and result.get("line") == n, (line[:80], result)
        else:
            assert result["id"] == event["id"] and 0.0 <= result["score"] <= 1.0, result


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(hostile_chunks(max_lines=300))
def test_hostile_ndjson_into_a_served_pipeline(pipeline: Served, lines: list[bytes]) -> None:
    r = httpx.post(
        f"http://{pipeline[0]}/v1/pipelines/fraud/events", content=b"\n".join(lines) + b"\n", timeout=60
    )
    if not any(lines):
        assert r.status_code == 200 and r.content == b""
        return
    assert r.status_code == 200, r.text[:300]
    check_results(lines, r.content)


def test_every_corpus_line_alone_and_in_large_requests(pipeline: Served) -> None:
    """Each corpus line alone, then in requests of 600 lines (the decoder process's size)."""
    url = f"http://{pipeline[0]}/v1/pipelines/fraud/events"
    for line in HOSTILE_LINES.values():
        r = httpx.post(url, content=line + b"\n", timeout=60)
        assert r.status_code == 200, r.text[:200]
        check_results([line], r.content)
    for seed in range(3):
        lines = mixed_lines(600, bad_every=3, seed=seed)
        r = httpx.post(url, content=b"\n".join(lines), timeout=60)
        assert r.status_code == 200
        check_results(lines, r.content)


def test_hostile_ndjson_over_the_grpc_stream(pipeline: Served) -> None:
    channel = grpc.insecure_channel(pipeline[1])
    call = channel.stream_stream("/aisp.v1.Pipelines/Events")
    messages = [b"\n".join(mixed_lines(50, bad_every=2, seed=s)) for s in range(6)]
    messages.insert(3, b"\n".join(HOSTILE_LINES.values()))
    answers = list(call(iter(messages), timeout=60))
    assert len(answers) == len(messages)
    for message, answer in zip(messages, answers, strict=True):
        lines = [x for x in message.split(b"\n") if x]
        results = [json.loads(x) for x in answer.splitlines()]
        assert len(results) == len(lines)
        assert all(
            ("error" in r) == (parse_valid(line) is None) for line, r in zip(lines, results, strict=True)
        )
    channel.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(st.lists(hostile_chunks(max_lines=60), min_size=1, max_size=4))
def test_hostile_ndjson_over_a_websocket(pipeline: Served, messages: list[list[bytes]]) -> None:
    """Hostile lines in several messages: each line answered in order (a row or an error with
    its line number over the whole socket), then the server closes normally."""
    from websockets.sync.client import connect

    answer: list[bytes] = []
    with connect(f"ws://{pipeline[0]}/v1/pipelines/fraud/ws", max_size=None) as ws:
        for lines in messages:
            if any(lines):  # an empty message would end the input
                ws.send(b"\n".join(lines))
        ws.send("")
        for message in ws:
            answer.append(message.encode() if isinstance(message, str) else message)
    assert ws.close_code == 1000
    check_results([line for lines in messages if any(lines) for line in lines], b"".join(answer))


def test_odd_headers_on_the_ingest_route(pipeline: Served) -> None:
    url = f"http://{pipeline[0]}/v1/pipelines/fraud/events"
    for headers in (
        {"X-Request-Deadline-Ms": "inf"},
        {"X-Request-Deadline-Ms": "1e300"},
        {"X-Tier": "platinum"},
    ):
        r = httpx.post(url, content=b'{"id":1}\n', headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]
    r = httpx.post(url, content=b"x" * (2 << 20), timeout=30)
    assert r.status_code == 413 and r.json()["error"]
    r = httpx.post(f"http://{pipeline[0]}/v1/pipelines/nope/events", content=b"{}", timeout=30)
    assert r.status_code == 404 and r.json()["error"]
    r = httpx.post(url + "?mode=blast", content=b"{}", timeout=30)
    assert r.status_code == 400 and r.json()["error"]


def test_whitespace_only_request(pipeline: Served) -> None:
    r = httpx.post(f"http://{pipeline[0]}/v1/pipelines/fraud/events", content=b"   \n", timeout=30)
    assert r.status_code == 200 and json.loads(r.content)["error"] == "empty line"


def test_bytes_length_prefixes_are_checked(http: httpx.Client) -> None:
    for blob in (
        b"\x05\x00\x00\x00ab",
        b"\x01\x00",
        struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b" + b"\x00",
    ):
        header = bytes_header(len(blob))
        r = http.post(
            "/v2/models/identity_bytes/infer",
            content=header + blob,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        assert r.status_code == 400 and "string" in r.json()["error"], blob


def test_a_killed_decoder_process_fails_one_message_clearly_and_is_replaced(pipeline: Served) -> None:
    """Over the gRPC stream (one message is one block for the decoder process): the message in
    flight when the decoder child dies is answered with a clear error, the next one decodes."""
    import threading

    import psutil

    lines = mixed_lines(600, bad_every=5, seed=9)
    body = b"\n".join(lines)
    server = psutil.Process(pipeline[2].pid)
    killed = threading.Event()

    def messages() -> Iterator[bytes]:
        yield body
        killed.wait(30)
        yield body
        yield body

    channel = grpc.insecure_channel(pipeline[1])
    answers = channel.stream_stream("/aisp.v1.Pipelines/Events")(messages(), timeout=60)
    check_results(lines, next(answers))
    decoders = [c for s in server.children() for c in s.children()]
    assert decoders, "no decoder process"
    for d in decoders:
        d.kill()
        d.wait(10)
    killed.set()
    failed = [json.loads(x) for x in next(answers).splitlines()]
    assert len(failed) == sum(1 for line in lines if line)
    assert all("decoder process died" in r["error"] for r in failed)
    sent = sum(1 for line in lines if line)
    check_results(lines, next(answers), first_line=2 * sent + 1)  # a new child decodes it
    assert [c for s in server.children() for c in s.children()]
    channel.close()
