"""``aisp.serve.oip.http_codec``: OIP v2 infer requests and responses over HTTP/REST.

Checks, on the pure functions ``parse_request`` and ``encode_response`` (no server): every
datatype's tensors come through JSON ``data`` (flat and nested), Triton's binary tensor
extension (``Inference-Header-Content-Length``, ``binary_data_size``, BYTES length-prefixed) and
the raw form (header length 0) unchanged, and the forms agree; the request's parameters and
requested outputs are read as given; responses decode back to the arrays, in JSON and in binary;
shared-memory inputs and outputs go through their region; and malformed requests are refused
with a ``BadRequest`` whose message names the tensor or field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import BadRequest
from aisp.serve.oip.http_codec import HEADER_LENGTH, MAX_TIMEOUT_US, encode_response, parse_request
from aisp.serve.oip.request import (
    InferRequest,
    RequestedOutput,
    Signature,
    TensorSignature,
    array_from_bytes,
    encode_bytes,
)
from aisp.serve.oip.shm import SharedMemoryRegions, ShmRef
from tests.support.oip_tensors import array_of, raw_of, tensors

SIG = Signature(
    "m",
    8,
    (TensorSignature("x", "FP32", (-1,)),),
    (TensorSignature("y", "FP32", (-1,)), TensorSignature("z", "INT32", (-1,))),
)
Named = tuple[str, str, npt.NDArray[Any]]


# -- helpers -----------------------------------------------------------------------------------------


def json_body(*named: Named, nested: bool = False, **extra: Any) -> bytes:
    inputs = [
        {
            "name": n,
            "datatype": dt,
            "shape": list(a.shape),
            "data": a.tolist() if nested else a.reshape(-1).tolist(),
        }
        for n, dt, a in named
    ]
    return json.dumps({"inputs": inputs, **extra}).encode()


def binary_body(*named: Named, **extra: Any) -> tuple[bytes, str]:
    """A body of the binary extension (every input binary) and its header length."""
    raws = [raw_of(dt, a) for _, dt, a in named]
    inputs = [
        {"name": n, "datatype": dt, "shape": list(a.shape), "parameters": {"binary_data_size": len(raw)}}
        for (n, dt, a), raw in zip(named, raws, strict=True)
    ]
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(raws), str(len(header))


def assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tolist() == want.tolist()
    if want.dtype != object:
        assert got.tobytes() == want.tobytes()  # bit for bit (-0.0 stays -0.0)


def decode_response(body: bytes, headers: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON head of a response and its outputs as arrays, as a client reads them."""
    n = int(headers.get(HEADER_LENGTH, len(body)))
    head = json.loads(body[:n])
    blob, pos, arrays = body[n:], 0, {}
    for o in head["outputs"]:
        size = o.get("parameters", {}).get("binary_data_size")
        if size is not None:
            arrays[o["name"]] = array_from_bytes(
                o["name"], o["datatype"], o["shape"], blob[pos : pos + size], "m"
            )
            pos += size
        else:
            data = o["data"]
            arrays[o["name"]] = array_of(o["datatype"], data, tuple(o["shape"]))
    assert pos == len(blob)
    return head, arrays


def refused(body: bytes, header: str | None, message: str, sig: Signature = SIG) -> None:
    with pytest.raises(BadRequest, match="^" + re.escape(message) + "$"):
        parse_request(body, header, sig)


# -- requests: round trips ------------------------------------------------------------------------------
@settings(max_examples=75, deadline=None)
@given(tensors())
def test_json_data_round_trips_every_datatype(tensor: tuple[str, npt.NDArray[Any]]) -> None:
    datatype, arr = tensor
    req = parse_request(json_body(("x", datatype, arr)), None, SIG)
    [t] = req.inputs
    assert (t.name, t.datatype, t.shape) == ("x", datatype, arr.shape)
    assert_same(t.array, arr)
    assert (req.outputs, req.id, req.priority, req.timeout_us, req.binary_output) == (
        None,
        None,
        0,
        None,
        False,
    )


@settings(max_examples=75, deadline=None)
@given(tensors(min_dims=1))
def test_nested_json_data_is_read_row_major(tensor: tuple[str, npt.NDArray[Any]]) -> None:
    datatype, arr = tensor
    nested = parse_request(json_body(("x", datatype, arr), nested=True), None, SIG).inputs[0]
    assert_same(nested.array, arr)


@settings(max_examples=75, deadline=None)
@given(tensors(), tensors())
def test_binary_extension_round_trips_and_agrees_with_json(
    first: tuple[str, npt.NDArray[Any]], second: tuple[str, npt.NDArray[Any]]
) -> None:
    named = (("a", first[0], first[1]), ("b", second[0], second[1]))
    body, length = binary_body(*named)
    binary = parse_request(body, length, SIG)
    as_json = parse_request(json_body(*named), None, SIG)
    for t, j, (name, datatype, arr) in zip(binary.inputs, as_json.inputs, named, strict=True):
        assert (t.name, t.datatype, t.shape) == (j.name, j.datatype, j.shape) == (name, datatype, arr.shape)
        assert_same(t.array, arr)
        assert_same(j.array, t.array)


def test_json_and_binary_inputs_in_one_request_take_their_blobs_in_order() -> None:
    a = np.array([[1, -2, 3]], np.int16)
    b = np.array([["héllo", "", "w"]], dtype=object)
    c = np.array([[0.5, -1.25]], np.float64)
    raw_b, raw_c = encode_bytes(b), c.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "b",
                    "datatype": "BYTES",
                    "shape": [1, 3],
                    "parameters": {"binary_data_size": len(raw_b)},
                },
                {"name": "a", "datatype": "INT16", "shape": [1, 3], "data": [1, -2, 3]},
                {"name": "c", "datatype": "FP64", "shape": [1, 2], "parameters": {"binary_data_size": 16}},
            ]
        }
    ).encode()
    req = parse_request(header + raw_b + raw_c, str(len(header)), SIG)
    assert [t.name for t in req.inputs] == ["b", "a", "c"]
    assert_same(req.inputs[0].array, b)
    assert_same(req.inputs[1].array, a)
    assert_same(req.inputs[2].array, c)
    assert raw_b == b"\x06\x00\x00\x00h\xc3\xa9llo\x00\x00\x00\x00\x01\x00\x00\x00w"


def test_binary_bool_is_one_byte_each_and_any_nonzero_is_true() -> None:
    header = b'{"inputs":[{"name":"x","datatype":"BOOL","shape":[4],"parameters":{"binary_data_size":4}}]}'
    req = parse_request(header + b"\x00\x01\xff\x00", str(len(header)), SIG)
    assert req.inputs[0].array.tolist() == [False, True, True, False]
    assert req.inputs[0].array.dtype == np.bool_


def test_binary_fp16_is_little_endian_half_floats() -> None:
    header = b'{"inputs":[{"name":"x","datatype":"FP16","shape":[1,3],"parameters":{"binary_data_size":6}}]}'
    raw = b"\x00\x3c\x00\xc0\x00\x7c"  # 1.0, -2.0, inf as IEEE half, little-endian
    arr = parse_request(header + raw, str(len(header)), SIG).inputs[0].array
    assert arr.dtype == np.float16
    assert arr.tolist() == [[1.0, -2.0, float("inf")]]


def test_zero_element_tensors_need_no_data() -> None:
    req = parse_request(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[0,3]}]}', None, SIG)
    assert req.inputs[0].array.shape == (0, 3) and req.inputs[0].array.dtype == np.float32


# -- the raw form (header length 0) ----------------------------------------------------------------------
def raw_sig(datatype: str, dims: tuple[int, ...], inputs: int = 1) -> Signature:
    return Signature("rawm", 8, tuple(TensorSignature(f"in{k}", datatype, dims) for k in range(inputs)), ())


def test_raw_request_is_the_models_one_input_its_variable_dim_deduced() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    req = parse_request(arr.tobytes(), "0", raw_sig("FP32", (-1, 2)))
    [t] = req.inputs
    assert (t.name, t.datatype, t.shape) == ("in0", "FP32", (1, 3, 2))
    assert_same(t.array, arr)
    assert req.binary_output is True


def test_raw_request_of_fixed_dims() -> None:
    arr = np.array([[[1, 2], [3, 4]]], np.uint16)
    req = parse_request(arr.tobytes(), "0", raw_sig("UINT16", (2, 2)))
    assert req.inputs[0].shape == (1, 2, 2)
    assert_same(req.inputs[0].array, arr)


def test_raw_bytes_request_is_one_element() -> None:
    req = parse_request("ünïcode text".encode(), "0", raw_sig("BYTES", (1,)))
    [t] = req.inputs
    assert t.shape == (1, 1)
    assert t.array.tolist() == [["ünïcode text"]]


@pytest.mark.parametrize(
    ("body", "sig", "message"),
    [
        (
            b"\x00" * 8,
            raw_sig("FP32", (2,), inputs=2),
            "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'rawm' model"
            " configuration",
        ),
        (
            b"abc",
            raw_sig("BYTES", (2,)),
            "For BYTE datatype raw input 'in0', the model must have input shape [1]",
        ),
        (
            b"\x00" * 8,
            raw_sig("FP32", (-1, -1)),
            "The shape of the raw input 'in0' can not be deduced because there are more than one"
            " variable-sized dimension",
        ),
        (
            b"\x00" * 10,
            raw_sig("FP32", (-1, 2)),
            "input byte size mismatch for input 'in0' for model 'rawm'. Expected 8, got 10",
        ),
        (
            b"\xff\xfe",
            raw_sig("BYTES", (1,)),
            "string element 0 for inference input 'in0' for model 'rawm' is not UTF-8 text (string tensors"
            " hold text)",
        ),
    ],
)
def test_raw_requests_that_cannot_be_read_are_refused(body: bytes, sig: Signature, message: str) -> None:
    refused(body, "0", message, sig)


# -- requests: parameters and outputs -------------------------------------------------------------------
def test_request_parameters_and_outputs_are_read_as_given() -> None:
    x = ("x", "INT32", np.array([[1, 2]], np.int32))
    extra: dict[str, Any] = {
        "id": "req-1",
        "parameters": {"priority": 3, "timeout": 2_500_000, "binary_data_output": True, "rollout_key": 42},
        "outputs": [{"name": "z"}, {"name": "y", "parameters": {"binary_data": True}}],
    }
    body, length = binary_body(x, **extra)
    for req in (parse_request(json_body(x, **extra), None, SIG), parse_request(body, length, SIG)):
        assert req.id == "req-1"
        assert req.priority == 3
        assert req.timeout_us == 2_500_000
        assert req.binary_output is True
        assert req.rollout_key == "42"
        assert req.outputs == [RequestedOutput("z"), RequestedOutput("y", binary=True)]


def test_the_longest_timeout_is_accepted() -> None:
    body = json_body(("x", "INT32", np.zeros(1, np.int32)), parameters={"timeout": MAX_TIMEOUT_US})
    assert parse_request(body, None, SIG).timeout_us == 3_600_000_000


def test_a_string_rollout_key_is_kept() -> None:
    body = json_body(("x", "INT32", np.zeros(1, np.int32)), parameters={"rollout_key": "user-7"})
    assert parse_request(body, None, SIG).rollout_key == "user-7"


ONE = {"name": "x", "datatype": "INT32", "shape": [1], "data": [1]}


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            {"inputs": [ONE], "parameters": {"rollout_key": True}},
            "parameter 'rollout_key' must be a string or an integer, got bool",
        ),
        (
            {"inputs": [ONE], "parameters": {"timeout": MAX_TIMEOUT_US + 1}},
            "parameter 'timeout' must be an integer from 0 to 3600000000, got 3600000001",
        ),
        (
            {"inputs": [ONE], "parameters": {"priority": -1}},
            "parameter 'priority' must be an integer from 0 to 18446744073709551615, got -1",
        ),
        (
            {"inputs": [ONE], "parameters": {"binary_data_output": "yes"}},
            "request: parameter 'binary_data_output' must be true or false, got 'yes'",
        ),
        (
            {"inputs": [ONE], "outputs": [{"name": "y", "parameters": {"classification": 2}}]},
            "output 'y': the classification extension is not supported",
        ),
        (
            {"inputs": [ONE], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
            "output 'y': parameter 'binary_data' must be true or false, got 1",
        ),
        (
            {"inputs": [{**ONE, "parameters": {"p": [1]}}]},
            "input 'x': parameter 'p' has invalid type; it should be int, bool or string",
        ),
    ],
)
def test_bad_parameters_are_refused_naming_them(request_: dict[str, Any], message: str) -> None:
    refused(json.dumps(request_).encode(), None, message)


# -- requests: bad tensors ---------------------------------------------------------------------------------
def tensor(**fields: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 2], **fields}]}).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            tensor(datatype="FP8", data=[1, 2]),
            "invalid datatype 'FP8' for input 'x'; one of ['BOOL', 'BYTES', 'FP16', 'FP32', 'FP64', 'INT16',"
            " 'INT32', 'INT64', 'INT8', 'UINT16', 'UINT32', 'UINT64', 'UINT8']",
        ),
        (tensor(data=[1]), "input 'x': failed to parse 'data' field: shape does not match true shape"),
        (
            tensor(data=[1, 2, 3]),
            "input 'x': unable to parse 'data': shape does not match true shape of 'data'",
        ),
        (
            tensor(data=[[1], [2], [3]]),
            "input 'x': unable to parse 'data': shape does not match true shape of 'data'",
        ),
        (tensor(), "input 'x' must set one of 'data' and 'binary_data_size'"),
        (
            tensor(data=[1.5, 2]),
            "input 'x': unable to parse 'data': Expected `int`, got `float` - at `data[0]`",
        ),
        (
            tensor(datatype="INT8", data=[1, 128]),
            "input 'x': unable to parse 'data': Expected `int` <= 127 - at `data[1]`",
        ),
        (
            tensor(datatype="BOOL", data=[1, 0]),
            "input 'x': unable to parse 'data': Expected `bool`, got `int` - at `data[0]`",
        ),
        (
            tensor(datatype="FP16", data=[1.0, 70000.0]),
            "input 'x': a value of 'data' is out of range for FP16",
        ),
        (tensor(datatype="FP32", data=[1e39, 0]), "input 'x': a value of 'data' is out of range for FP32"),
        (
            tensor(datatype="UINT64", data=[2**64, 0]),
            "input 'x': a value of 'data' is out of range for UINT64",
        ),
        (tensor(data="12"), "input 'x': unable to parse 'data': Expected `array`, got `str`"),
        (
            tensor(shape=[2**32, 2], data=[]),
            "invalid shape for input 'x': shape [4294967296,2] causes total element count to exceed"
            " maximum size of 4294967296",
        ),
        (
            tensor(shape=[-1, 2], data=[1, 2]),
            "invalid inference request: Expected `int` >= 0 - at `request.inputs[0].shape[0]`",
        ),
        (
            tensor(data=[1, 2], parameters={"binary_data_size": 8}),
            "input 'x' must set only one of 'data' and 'binary_data_size'",
        ),
        (b"{}", "invalid inference request: Object missing required field `inputs`"),
    ],
)
def test_bad_json_tensors_are_refused_naming_the_input(body: bytes, message: str) -> None:
    refused(body, None, message)


def test_binary_extension_sizes_are_checked() -> None:
    def header(size: Any, shape: list[int] | None = None) -> bytes:
        return json.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "INT32",
                        "shape": shape or [1, 2],
                        "parameters": {"binary_data_size": size},
                    }
                ]
            }
        ).encode()

    h = header(8)
    refused(
        h + bytes(4), str(len(h)), "unexpected size for input 'x', expecting 4 additional bytes for model 'm'"
    )
    refused(h + bytes(12), str(len(h)), "unexpected additional input data for model 'm'")
    h = header(4)
    refused(
        h + bytes(4), str(len(h)), "input byte size mismatch for input 'x' for model 'm'. Expected 8, got 4"
    )
    h = header(-1)
    refused(
        h,
        str(len(h)),
        "input 'x': 'binary_data_size' must be an integer from 0 to 18446744073709551615, got -1",
    )
    h = header(True)
    refused(
        h + bytes(1),
        str(len(h)),
        "input 'x': 'binary_data_size' must be an integer from 0 to 18446744073709551615, got True",
    )
    h = b'{"inputs":[{"name":"s","datatype":"BYTES","shape":[2],"parameters":{"binary_data_size":6}}]}'
    refused(
        h + b"\x02\x00\x00\x00ab",
        str(len(h)),
        "expected 2 string elements for inference input 's' for model 'm', got 1",
    )


def test_binary_data_after_a_json_only_request_is_refused() -> None:
    body = tensor(data=[1, 2])
    refused(body + b"\x00", str(len(body)), "unexpected additional input data for model 'm'")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("abc", "Inference-Header-Content-Length must be a non-negative integer, got 'abc'"),
        ("-5", "Inference-Header-Content-Length must be a non-negative integer, got '-5'"),
        ("12345678901", "Inference-Header-Content-Length must be a non-negative integer, got '12345678901'"),
        ("99", "inference header size should be in range (0, 10), got: 99"),
    ],
)
def test_header_lengths_are_checked(value: str, message: str) -> None:
    refused(b"0123456789", value, message)


# -- shared memory -----------------------------------------------------------------------------------------
@pytest.fixture
def regions(tmp_path: Path) -> Any:
    (tmp_path / "obj").write_bytes(bytes(64))
    shm = SharedMemoryRegions(directory=str(tmp_path))
    shm.register("r", "obj", 16, 48)
    yield shm
    shm.close()


def test_inputs_are_read_from_and_outputs_written_to_shared_memory(tmp_path: Path, regions: Any) -> None:
    arr = np.array([[1.5, -2.0]], np.float32)
    with open(tmp_path / "obj", "r+b") as f:
        f.seek(16 + 8)
        f.write(arr.tobytes())
    params = {"shared_memory_region": "r", "shared_memory_offset": 8, "shared_memory_byte_size": 8}
    body = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": params}],
            "outputs": [{"name": "y", "parameters": {**params, "shared_memory_offset": 24}}],
        }
    ).encode()
    req = parse_request(body, None, SIG, regions)
    assert_same(req.inputs[0].array, arr)
    assert req.outputs == [RequestedOutput("y", shm=ShmRef("r", 24, 8))]
    out = np.array([[7.0, 8.0]], np.float32)
    response, headers = encode_response(req, SIG, "3", {"y": out}, regions)
    assert (
        response
        == b'{"model_name":"m","model_version":"3","outputs":[{"name":"y","datatype":"FP32","shape":[1,2]}]}'
    )
    assert headers == {"content-type": "application/json"}
    assert (tmp_path / "obj").read_bytes()[16 + 24 : 16 + 32] == out.tobytes()


def test_shared_memory_outputs_are_checked_before_the_model_runs(regions: Any) -> None:
    body = json.dumps(
        {
            "inputs": [ONE],
            "outputs": [
                {
                    "name": "y",
                    "parameters": {
                        "shared_memory_region": "r",
                        "shared_memory_offset": 40,
                        "shared_memory_byte_size": 16,
                    },
                }
            ],
        }
    ).encode()
    with pytest.raises(BadRequest, match=re.escape("output 'y': offset 40 + byte_size 16 is past the end")):
        parse_request(body, None, SIG, regions)


def test_an_input_in_shared_memory_with_data_is_refused(regions: Any) -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    refused(
        json.dumps({"inputs": [{**ONE, "parameters": params}]}).encode(),
        None,
        "input 'x' in shared memory must set neither 'data' nor 'binary_data_size'",
    )


# -- responses ---------------------------------------------------------------------------------------------
def test_json_response_exact_bytes() -> None:
    req = InferRequest([], id="r-1")
    out = {"y": np.array([[1.5, -2.0]], np.float32), "z": np.array([[3, 4]], np.int32)}
    body, headers = encode_response(req, SIG, "2", out)
    assert body == (
        b'{"model_name":"m","model_version":"2","outputs":['
        b'{"name":"y","datatype":"FP32","shape":[1,2],"data":[1.5,-2.0]},'
        b'{"name":"z","datatype":"INT32","shape":[1,2],"data":[3,4]}],"id":"r-1"}'
    )
    assert headers == {"content-type": "application/json"}


def test_binary_response_exact_bytes_and_headers() -> None:
    req = InferRequest([], outputs=[RequestedOutput("z", binary=True), RequestedOutput("y")])
    out = {"y": np.array([True, False]), "z": np.array([[1, 2]], np.int16)}
    body, headers = encode_response(req, SIG, "1", out)
    head = (
        b'{"model_name":"m","model_version":"1","outputs":['
        b'{"name":"z","datatype":"INT16","shape":[1,2],"parameters":{"binary_data_size":4}},'
        b'{"name":"y","datatype":"BOOL","shape":[2],"data":[true,false]}]}'
    )
    assert body == head + b"\x01\x00\x02\x00"
    assert headers == {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def test_without_requested_outputs_the_signatures_outputs_are_answered_in_its_order() -> None:
    out: dict[str, npt.NDArray[Any]] = {
        "z": np.zeros(1, np.int32),
        "y": np.zeros(1, np.float32),
        "extra": np.zeros(1, np.int8),
    }
    body, _ = encode_response(InferRequest([]), SIG, "1", out)
    assert [o["name"] for o in json.loads(body)["outputs"]] == ["y", "z"]
    body, _ = encode_response(InferRequest([]), SIG, "1", {"z": np.zeros(1, np.int32)})
    assert [o["name"] for o in json.loads(body)["outputs"]] == ["z"]


def test_an_output_without_an_oip_datatype_is_refused() -> None:
    with pytest.raises(BadRequest, match="^numpy dtype complex64 has no Open Inference Protocol datatype$"):
        encode_response(InferRequest([]), SIG, "1", {"y": np.zeros(2, np.complex64)})


@settings(max_examples=75, deadline=None)
@given(tensors(), tensors(), st.booleans())
def test_responses_decode_back_to_the_outputs_in_json_and_binary(
    y: tuple[str, npt.NDArray[Any]], z: tuple[str, npt.NDArray[Any]], binary: bool
) -> None:
    outputs = {"y": y[1], "z": z[1]}
    as_json = decode_response(*encode_response(InferRequest([], id="q"), SIG, "5", outputs))
    body, headers = encode_response(InferRequest([], binary_output=binary), SIG, "5", outputs)
    as_asked = decode_response(body, headers)
    for head, arrays in (as_json, as_asked):
        assert head["model_name"] == "m" and head["model_version"] == "5"
        assert [(o["name"], o["datatype"], o["shape"]) for o in head["outputs"]] == [
            ("y", y[0], list(y[1].shape)),
            ("z", z[0], list(z[1].shape)),
        ]
        assert_same(arrays["y"], y[1])
        assert_same(arrays["z"], z[1])
    assert as_json[0]["id"] == "q" and "id" not in as_asked[0]
    has_blob = binary and (y[1].size > 0 or z[1].size > 0)
    assert (HEADER_LENGTH in headers) is has_blob
    assert headers["content-type"] == ("application/octet-stream" if has_blob else "application/json")
