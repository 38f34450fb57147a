"""The OIP validation layer without a server: conversion, range checks, the request checks, the
HTTP and gRPC codecs, headers and the config JSON; property tests that hostile input only ever
raises ``BadRequest``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from aisp.admission.tiers import parse_tier
from aisp.errors import BadRequest
from aisp.serve.headers import parse_deadline_ms
from aisp.serve.http.models import config_json
from aisp.serve.oip.grpc_codec import parse_request as parse_grpc
from aisp.serve.oip.http_codec import encode_response, parse_request
from aisp.serve.oip.request import (
    DATATYPES,
    InferInput,
    InferRequest,
    RequestedOutput,
    Signature,
    TensorSignature,
    array_from_bytes,
    array_from_json,
    check_request,
    decode_bytes,
    encode_bytes,
)
from aisp.serve.oip.shm import NO_REGIONS

SIMPLE = Signature(
    "simple",
    8,
    (TensorSignature("INPUT0", "INT32", (16,)), TensorSignature("INPUT1", "INT32", (16,))),
    (TensorSignature("OUTPUT0", "INT32", (16,)), TensorSignature("OUTPUT1", "INT32", (16,))),
)
RANGES = {"INT8": (-128, 127), "UINT8": (0, 255), "INT16": (-(2**15), 2**15 - 1), "UINT64": (0, 2**64 - 1)}


def simple_request(**change: object) -> InferRequest:
    inputs = [InferInput(n, "INT32", (1, 16), np.zeros((1, 16), np.int32)) for n in ("INPUT0", "INPUT1")]
    return InferRequest(inputs, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize("datatype", sorted(RANGES))
@given(value=st.integers(-(2**70), 2**70))
def test_integer_values_are_range_checked(datatype: str, value: int) -> None:
    lo, hi = RANGES[datatype]
    data = json.dumps([value]).encode()
    if lo <= value <= hi:
        assert array_from_json("x", datatype, [1], data).tolist() == [value]
    else:
        with pytest.raises(BadRequest, match="data"):
            array_from_json("x", datatype, [1], data)


def test_json_data_kinds_are_strict() -> None:
    with pytest.raises(BadRequest):
        array_from_json("x", "INT32", [1], b"[0.5]")  # FP32 0.5 is not an INT32
    with pytest.raises(BadRequest):
        array_from_json("x", "BOOL", [1], b"[1]")
    with pytest.raises(BadRequest, match="out of range for FP16"):
        array_from_json("x", "FP16", [1], b"[1e6]")
    with pytest.raises(BadRequest, match="out of range for FP32"):
        array_from_json("x", "FP32", [1], b"[1e300]")
    assert array_from_json("x", "FP64", [2, 2], b"[[1, 2], [3, 4.5]]").tolist() == [[1, 2], [3, 4.5]]
    assert array_from_json("x", "BYTES", [1, 2], b'["a", "\\u00fc"]').tolist() == [["a", "ü"]]


@given(st.lists(st.text(max_size=20), max_size=20))
def test_bytes_tensors_round_trip(words: list[str]) -> None:
    arr = np.array(words, dtype=object)
    assert decode_bytes("x", encode_bytes(arr), len(words), "m").tolist() == words


@given(st.binary(max_size=64), st.integers(0, 8))
def test_any_bytes_tensor_decodes_or_is_a_bad_request(blob: bytes, count: int) -> None:
    try:
        out = decode_bytes("x", blob, count, "m")
    except BadRequest as exc:
        assert "string" in str(exc)
    else:
        assert len(out) == count and encode_bytes(out) == blob


def test_binary_tensors_must_have_their_exact_size() -> None:
    with pytest.raises(BadRequest, match="Expected 64, got 60"):
        array_from_bytes("INPUT0", "INT32", [1, 16], bytes(60), "simple")
    with pytest.raises(BadRequest, match="exceed maximum size"):
        array_from_bytes("INPUT0", "INT32", [2**32, 2**32], b"", "simple")  # the product would wrap to 0
    flags = array_from_bytes("x", "BOOL", [3], b"\x00\x01\x07", "m")
    assert flags.tolist() == [False, True, True]


def test_check_request_in_triton_order() -> None:
    assert check_request(simple_request(), SIMPLE)["INPUT0"].shape == (1, 16)
    outputs = [RequestedOutput("OUTPUT0"), RequestedOutput("OUTPUT0")]
    with pytest.raises(BadRequest, match="output 'OUTPUT0' already exists"):
        check_request(simple_request(outputs=outputs), SIMPLE)
    with pytest.raises(BadRequest, match="unexpected inference output 'X'"):
        check_request(simple_request(outputs=[RequestedOutput("X")]), SIMPLE)
    req = simple_request()
    req.inputs.append(InferInput("INPUT0", "INT32", (1, 16), np.zeros((1, 16), np.int32)))
    with pytest.raises(BadRequest, match="input 'INPUT0' already exists"):
        check_request(req, SIMPLE)
    req = simple_request()
    req.inputs[1] = InferInput("INPUT1", "FP32", (1, 16), np.zeros((1, 16), np.float32))
    with pytest.raises(BadRequest, match="data-type is 'FP32', but model 'simple' expects 'INT32'"):
        check_request(req, SIMPLE)
    req = simple_request()
    req.inputs = [InferInput(n, "INT32", (9, 16), np.zeros((9, 16), np.int32)) for n in ("INPUT0", "INPUT1")]
    with pytest.raises(BadRequest, match="batch-size must be <= 8"):
        check_request(req, SIMPLE)
    req.inputs = [InferInput(n, "INT32", (1, 16), np.zeros((1, 16), np.int32)) for n in ("INPUT0", "INPUT1")]
    req.inputs[1] = InferInput("INPUT1", "INT32", (2, 16), np.zeros((2, 16), np.int32))
    with pytest.raises(BadRequest, match="batch size does not match"):
        check_request(req, SIMPLE)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300)
@given(json_values, st.one_of(st.none(), st.integers(-3, 200).map(str), st.text(max_size=4)))
def test_any_http_body_parses_or_is_a_bad_request(body: object, header: str | None) -> None:
    raw = json.dumps(body).encode()
    try:
        req = parse_request(raw, header, SIMPLE)
        check_request(req, SIMPLE)
    except BadRequest as exc:
        assert str(exc)


@settings(max_examples=200)
@given(st.binary(max_size=200))
def test_any_bytes_as_a_body_parse_or_are_a_bad_request(raw: bytes) -> None:
    for header in (None, "0", str(len(raw) // 2)):
        try:
            parse_request(raw, header, SIMPLE)
        except BadRequest:
            pass


def test_deeply_nested_bodies_are_bad_requests() -> None:
    for body in (b"[" * 150_000, b'{"inputs":' + b"[" * 5000 + b"]" * 5000 + b"}"):
        with pytest.raises(BadRequest):
            parse_request(body, None, SIMPLE)
    deep = (
        b'{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":'
        + b"[" * 3000
        + b"]" * 3000
        + b"}]}"
    )
    with pytest.raises(BadRequest, match="nested too deeply|nesting depth"):
        parse_request(deep, None, SIMPLE)


def test_request_parameters_are_checked() -> None:
    base = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}]}
    for params, reason in (
        ([], "object"),
        ({"priority": "abc"}, "'priority'"),
        ({"priority": -1}, "'priority'"),
        ({"priority": None}, "invalid type"),
        ({"timeout": 1.5}, "'timeout'"),
        ({"binary_data_output": 1}, "binary_data_output"),
    ):
        with pytest.raises(BadRequest, match=reason):
            parse_request(json.dumps({**base, "parameters": params}).encode(), None, SIMPLE)
    body = json.dumps({**base, "inputs": [{**base["inputs"][0], "parameters": {"binary_data_size": 72.0}}]})  # type: ignore[dict-item]
    with pytest.raises(BadRequest, match="binary_data_size"):
        parse_request(body.encode() + bytes(72), str(len(body)), SIMPLE)
    with pytest.raises(BadRequest, match="outputs"):
        parse_request(json.dumps({**base, "outputs": {"name": "OUTPUT0"}}).encode(), None, SIMPLE)


def test_response_encoding_binary_and_json() -> None:
    req = simple_request(
        outputs=[RequestedOutput("OUTPUT0", binary=True), RequestedOutput("OUTPUT1")], id="7"
    )
    out = {"OUTPUT0": np.arange(16, dtype=np.int32).reshape(1, 16), "OUTPUT1": np.ones((1, 16), np.int32)}
    body, headers = encode_response(req, SIMPLE, "1", out)
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    assert head["id"] == "7" and head["outputs"][0]["parameters"]["binary_data_size"] == 64
    assert body[n:] == out["OUTPUT0"].tobytes() and head["outputs"][1]["data"] == [1] * 16


def test_grpc_typed_contents_are_range_checked() -> None:
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="x", datatype="INT8", shape=[1, 2])
    t.contents.int_contents.extend([5, 1000])
    sig = Signature("m", 8, (TensorSignature("x", "INT8", (2,)),), ())
    with pytest.raises(BadRequest, match="out of range for INT8"):
        parse_grpc(request, sig)
    t.contents.int_contents[1] = -7
    assert parse_grpc(request, sig).inputs[0].array.tolist() == [[5, -7]]
    t.contents.fp32_contents.append(1.0)
    with pytest.raises(BadRequest, match="of type 'FP32', expected datatype 'INT8'"):
        parse_grpc(request, sig)
    fp16 = pb.ModelInferRequest(model_name="m")
    fp16.inputs.add(name="x", datatype="FP16", shape=[1])
    with pytest.raises(BadRequest, match="FP16 has no typed contents"):
        parse_grpc(fp16, sig)
    neg = pb.ModelInferRequest(model_name="m")
    neg.inputs.add(name="x", datatype="INT8", shape=[-1, 2])
    with pytest.raises(BadRequest, match="non-negative"):
        parse_grpc(neg, sig)


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "9" * 400, "-1", "0", "abc", "3600001"])
def test_deadlines_are_finite_and_bounded(value: str) -> None:
    with pytest.raises(BadRequest, match="X-Request-Deadline-Ms"):
        parse_deadline_ms(value)
    assert parse_deadline_ms("0.5") == 0.5 and parse_tier("gold") is not None


def test_config_json_renders_64_bit_integers_as_numbers() -> None:
    msg = mc.ModelConfig(name="m", max_batch_size=8)
    msg.input.add(name="x", data_type=mc.TYPE_INT32, dims=[16, -1])
    msg.dynamic_batching.max_queue_delay_microseconds = 42
    msg.dynamic_batching.priority_queue_policy[2].default_timeout_microseconds = 2**64 - 1
    msg.version_policy.specific.versions.append(3)
    out = config_json(msg)
    assert out["input"][0]["dims"] == [16, -1] and out["max_batch_size"] == 8
    assert out["dynamic_batching"]["max_queue_delay_microseconds"] == 42
    assert out["dynamic_batching"]["priority_queue_policy"]["2"]["default_timeout_microseconds"] == 2**64 - 1
    assert out["version_policy"]["specific"]["versions"] == [3]
    assert out["input"][0]["is_shape_tensor"] is False  # fields at their defaults are rendered


def test_every_datatype_has_an_array_dtype() -> None:
    assert set(DATATYPES) == {
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    }


_TYPES = [
    *("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT16", "UINT32", "UINT64"),
    *("FP16", "FP32", "FP64", "BYTES"),
]
_VALUES = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=2),
)
TYPED_ANSWERS: list[bool] = []
_DATA = st.one_of(  # mostly of one kind, as a client sends them; sometimes mixed or nested
    st.lists(st.booleans(), max_size=8),
    st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=8),
    st.lists(st.integers(min_value=0, max_value=300), max_size=8),
    st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=8),
    st.lists(st.floats(min_value=-1e6, max_value=1e6), max_size=8),
    st.lists(st.text(max_size=3), max_size=8),
    st.lists(_VALUES, max_size=8),
)


@settings(max_examples=600, deadline=None)
@given(
    datatype=st.sampled_from([*_TYPES, "FP8", "fp32"]),
    data=_DATA,
    shape_of=st.sampled_from(["flat", "row", "other"]),
    other=st.lists(st.integers(min_value=0, max_value=3), max_size=3),
    extra=st.sampled_from([{}, {"id": "r1"}, {"parameters": {"priority": 3}}, {"parameters": {"x": [1]}}]),
    params=st.sampled_from(
        [
            None,
            {},
            {"binary_data_size": 4},
            {"a": 1.5},
            {"a": None},
            {"shared_memory_region": "r", "shared_memory_byte_size": 4},
        ]
    ),
)
def test_the_one_pass_decode_agrees_with_the_general_one(
    datatype: str,
    data: list[Any],
    shape_of: str,
    other: list[int],
    extra: dict[str, Any],
    params: Any,
) -> None:
    """``parse_request`` decodes plain JSON requests in one pass (typed ``data``) and falls back
    to the general path for anything else: both give the same request, or the same error."""
    from aisp.serve.oip import http_codec as oip_http

    shape = {"flat": [len(data)], "row": [1, len(data)], "other": other}[shape_of]
    tensor: dict[str, Any] = {"name": "x", "datatype": datatype, "shape": shape, "data": data}
    if params is not None:
        tensor["parameters"] = params
    body = json.dumps({"inputs": [tensor], **extra}).encode()

    def outcome(parse: Any) -> Any:
        try:
            req = parse()
        except BadRequest as exc:
            return ("error", str(exc))
        if req is None:
            return None
        arrays = [(t.name, t.datatype, t.shape, t.array.dtype, t.array.tolist()) for t in req.inputs]
        return (arrays, req.outputs, req.id, req.priority, req.timeout_us, req.binary_output)

    typed = outcome(lambda: oip_http._typed_request(body, NO_REGIONS))
    TYPED_ANSWERS.append(typed is not None)
    general = outcome(lambda: oip_http._general_request(body, None, SIMPLE, NO_REGIONS))
    if typed is not None:  # the one-pass path answered: exactly as the general one would
        assert typed == general


def test_the_one_pass_decode_answered_many_of_them() -> None:
    """(After the property above, in this module's order.) It was not vacuous."""
    if not TYPED_ANSWERS:
        pytest.skip("the property did not run first")
    assert sum(TYPED_ANSWERS) >= 50
