"""``aisp.serve.oip.grpc_codec``: OIP v2 infer requests and responses over gRPC.

Checks, on ``parse_request`` and ``encode_response`` with tritonclient's ``service_pb2`` messages
(no server): every datatype's tensors come through ``raw_input_contents`` and through their typed
``contents`` field unchanged, and the two agree; the request's id, parameters and requested outputs
are read as given; responses carry each output in ``raw_output_contents`` and decode back to the
arrays; shared-memory inputs and outputs go through their region; and malformed requests are
refused with a ``BadRequest`` naming the tensor or parameter. UINT64 typed contents that mix values
from 2**63 with smaller ones keep every bit, and a 0-d output keeps its empty shape (both once
bugs found here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from tritonclient.grpc import service_pb2 as pb

from aisp.errors import BadRequest
from aisp.serve.oip.grpc_codec import CONTENTS_FIELD, encode_response, parse_request
from aisp.serve.oip.request import (
    DATATYPES,
    InferInput,
    InferRequest,
    RequestedOutput,
    Signature,
    TensorSignature,
    array_from_bytes,
)
from aisp.serve.oip.shm import SharedMemoryRegions, ShmRef
from tests.support.oip_tensors import DATATYPE_NAMES, raw_of, tensors

TYPED_NAMES = sorted(CONTENTS_FIELD)  # every datatype but FP16
SIG = Signature(
    "m",
    8,
    (TensorSignature("x", "FP32", (-1,)),),
    (TensorSignature("y", "FP32", (-1,)), TensorSignature("z", "INT32", (-1,))),
)


# -- helpers -----------------------------------------------------------------------------------------


def raw_request(*named: tuple[str, str, npt.NDArray[Any]]) -> Any:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, arr in named:
        request.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        request.raw_input_contents.append(raw_of(datatype, arr))
    return request


def typed_request(*named: tuple[str, str, npt.NDArray[Any]]) -> Any:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, arr in named:
        t = request.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        values = arr.reshape(-1).tolist()
        if datatype == "BYTES":
            values = [v.encode() for v in values]
        getattr(t.contents, CONTENTS_FIELD[datatype]).extend(values)
    return request


def assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tolist() == want.tolist()
    if want.dtype != object:
        assert got.tobytes() == want.tobytes()  # bit for bit (-0.0 stays -0.0)


def refused(request: Any, message: str) -> None:
    with pytest.raises(BadRequest, match="^" + re.escape(message) + "$"):
        parse_request(request, SIG)


# -- requests: round trips ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(tensors(DATATYPE_NAMES), tensors(DATATYPE_NAMES))
def test_raw_input_contents_round_trip_every_datatype(
    a: tuple[str, npt.NDArray[Any]], b: tuple[str, npt.NDArray[Any]]
) -> None:
    req = parse_request(raw_request(("a", *a), ("b", *b)), SIG)
    assert [(t.name, t.datatype, t.shape) for t in req.inputs] == [
        ("a", a[0], a[1].shape),
        ("b", b[0], b[1].shape),
    ]
    assert_same(req.inputs[0].array, a[1])
    assert_same(req.inputs[1].array, b[1])
    assert (req.outputs, req.id, req.priority, req.timeout_us, req.rollout_key) == (None, None, 0, None, None)


@settings(max_examples=100, deadline=None)
@given(tensors(TYPED_NAMES))
def test_typed_contents_round_trip_and_agree_with_raw(tensor: tuple[str, npt.NDArray[Any]]) -> None:
    datatype, arr = tensor
    [typed] = parse_request(typed_request(("x", datatype, arr)), SIG).inputs
    [raw] = parse_request(raw_request(("x", datatype, arr)), SIG).inputs
    assert (typed.name, typed.datatype, typed.shape) == ("x", datatype, arr.shape)
    assert_same(typed.array, arr)
    assert_same(typed.array, raw.array)


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("INT8", [-128, 127]),
        ("INT16", [-(2**15), 2**15 - 1]),
        ("INT32", [-(2**31), 2**31 - 1]),
        ("INT64", [-(2**63), 2**63 - 1]),
        ("UINT8", [0, 255]),
        ("UINT16", [0, 2**16 - 1]),
        ("UINT32", [0, 2**32 - 1]),
        ("UINT64", [2**63, 2**64 - 1]),  # all from 2**63: numpy keeps them as uint64
    ],
)
def test_typed_contents_take_their_datatypes_extremes(datatype: str, values: list[int]) -> None:
    arr = np.array(values, dtype=DATATYPES[datatype])
    [t] = parse_request(typed_request(("x", datatype, arr)), SIG).inputs
    assert t.array.dtype == DATATYPES[datatype]
    assert t.array.tolist() == values


@pytest.mark.parametrize("values", [[2**63 + 1, 1], [2**64 - 1, 0]])
def test_typed_uint64_contents_keep_every_value(values: list[int]) -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="UINT64", shape=[2]).contents.uint64_contents.extend(values)
    arr = parse_request(request, SIG).inputs[0].array
    assert arr.dtype == np.uint64
    assert arr.tolist() == values


def test_typed_fp16_and_bool_and_bytes() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="b", datatype="BOOL", shape=[1, 3]).contents.bool_contents.extend(
        [True, False, True]
    )
    request.inputs.add(name="s", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
        ["ü".encode(), b""]
    )
    b, s = parse_request(request, SIG).inputs
    assert b.array.dtype == np.bool_ and b.array.tolist() == [[True, False, True]]
    assert s.array.dtype == object and s.array.tolist() == ["ü", ""]
    fp16 = pb.ModelInferRequest(model_name="m")
    fp16.inputs.add(name="h", datatype="FP16", shape=[2])
    fp16.raw_input_contents.append(np.array([1.0, -0.5], np.float16).tobytes())
    [h] = parse_request(fp16, SIG).inputs
    assert h.array.dtype == np.float16 and h.array.tolist() == [1.0, -0.5]


def test_zero_element_typed_tensors_take_their_datatype() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="INT16", shape=[0, 4])
    [t] = parse_request(request, SIG).inputs
    assert t.array.dtype == np.int16 and t.array.shape == (0, 4)


# -- requests: id, parameters, outputs --------------------------------------------------------------------
def test_id_parameters_and_outputs_are_read_as_given() -> None:
    request = raw_request(("x", "FP32", np.zeros((1, 2), np.float32)))
    request.id = "req-9"
    request.parameters["priority"].uint64_param = 2**64 - 1
    request.parameters["timeout"].int64_param = 3_600_000_000
    request.parameters["rollout_key"].string_param = "user-3"
    request.outputs.add(name="z")
    request.outputs.add(name="y")
    req = parse_request(request, SIG)
    assert req.id == "req-9"
    assert req.priority == 2**64 - 1
    assert req.timeout_us == 3_600_000_000
    assert req.rollout_key == "user-3"
    assert req.outputs == [RequestedOutput("z"), RequestedOutput("y")]
    assert req.binary_output is False


@pytest.mark.parametrize(("which", "value"), [("int64_param", -5), ("uint64_param", 2**64 - 1)])
def test_an_integer_rollout_key_becomes_its_decimal_text(which: str, value: int) -> None:
    request = pb.ModelInferRequest(model_name="m")
    setattr(request.parameters["rollout_key"], which, value)
    assert parse_request(request, SIG).rollout_key == str(value)


def test_a_priority_of_zero_is_zero() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.parameters["priority"].int64_param = 0
    assert parse_request(request, SIG).priority == 0


def with_parameter(key: str, which: str, value: Any) -> Any:
    request = pb.ModelInferRequest(model_name="m")
    setattr(request.parameters[key], which, value)
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            with_parameter("priority", "string_param", "high"),
            "invalid value type for 'priority' parameter, expected int64_param or uint64_param",
        ),
        (
            with_parameter("priority", "int64_param", -1),
            "invalid value for 'priority': expected an integer from 0 to 18446744073709551615, got -1",
        ),
        (
            with_parameter("timeout", "uint64_param", 3_600_000_001),
            "invalid value for 'timeout': expected an integer from 0 to 3600000000, got 3600000001",
        ),
        (
            with_parameter("timeout", "bool_param", True),
            "invalid value type for 'timeout' parameter, expected int64_param or uint64_param",
        ),
        (
            with_parameter("rollout_key", "bool_param", True),
            "parameter 'rollout_key' must be a string or an integer",
        ),
        (
            with_parameter("rollout_key", "double_param", 1.5),
            "parameter 'rollout_key' must be a string or an integer",
        ),
    ],
)
def test_bad_parameters_are_refused_naming_them(request_: Any, message: str) -> None:
    refused(request_, message)


def test_outputs_asking_for_classification_are_refused() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.outputs.add(name="y").parameters["classification"].int64_param = 2
    refused(request, "output 'y': the classification extension is not supported")


# -- requests: bad tensors ---------------------------------------------------------------------------------
def one_input(datatype: str = "INT32", shape: tuple[int, ...] = (1, 2)) -> tuple[Any, Any]:
    request = pb.ModelInferRequest(model_name="m")
    return request, request.inputs.add(name="x", datatype=datatype, shape=list(shape))


def test_an_unknown_datatype_is_refused_naming_the_input() -> None:
    request, _ = one_input("FP8")
    refused(
        request,
        "invalid datatype 'FP8' for input 'x'; one of ['BOOL', 'BYTES', 'FP16', 'FP32', 'FP64', 'INT16',"
        " 'INT32', 'INT64', 'INT8', 'UINT16', 'UINT32', 'UINT64', 'UINT8']",
    )


def test_typed_contents_of_the_wrong_count_are_refused() -> None:
    request, t = one_input("FP32")
    t.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    refused(request, "input 'x': 3 values in fp32_contents for shape [1, 2]")
    request, t = one_input("BYTES")
    t.contents.bytes_contents.append(b"a")
    refused(request, "input 'x': 1 values in bytes_contents for shape [1, 2]")
    request, _ = one_input("INT32")
    refused(request, "input 'x': 0 values in int_contents for shape [1, 2]")


def test_typed_contents_of_another_datatype_are_refused() -> None:
    request, t = one_input("INT64")
    t.contents.int_contents.extend([1, 2])
    refused(
        request,
        "unexpected explicit tensor data for input tensor 'x' for model 'm' of type 'INT32', expected"
        " datatype 'INT64'",
    )
    request, t = one_input("FP16")
    refused(request, "input 'x': FP16 has no typed contents; send it in raw_input_contents")


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("INT8", [0, 128]),
        ("INT8", [-129, 0]),
        ("INT16", [2**15, 0]),
        ("UINT8", [256, 0]),
        ("UINT16", [0, 2**16]),
    ],
)
def test_typed_values_out_of_their_datatypes_range_are_refused(datatype: str, values: list[int]) -> None:
    request, t = one_input(datatype)
    getattr(t.contents, CONTENTS_FIELD[datatype]).extend(values)
    refused(request, f"input 'x': a value is out of range for {datatype}")


def test_typed_bytes_must_be_utf8() -> None:
    request, t = one_input("BYTES")
    t.contents.bytes_contents.extend([b"ok", b"\xff\xfe"])
    refused(request, "input 'x': element 1 is not UTF-8 text")


def test_negative_dims_are_refused() -> None:
    request, t = one_input("INT32", (-1, 2))
    refused(request, "input 'x': shape [-1, 2] must be non-negative integers")


def test_raw_contents_are_checked() -> None:
    request = raw_request(("x", "INT32", np.zeros((1, 2), np.int32)))
    request.inputs.add(name="y", datatype="INT32", shape=[1])
    refused(request, "unable to find data for input tensor 'y' for model 'm'")
    request = raw_request(("x", "INT32", np.zeros((1, 2), np.int32)))
    request.inputs[0].contents.int_contents.extend([1, 2])
    refused(
        request, "contents field must not be specified when using raw_input_contents for 'x' for model 'm'"
    )
    request = raw_request(("x", "INT32", np.zeros((1, 2), np.int32)))
    request.raw_input_contents[0] = bytes(6)
    refused(request, "input byte size mismatch for input 'x' for model 'm'. Expected 8, got 6")
    request = raw_request(("s", "BYTES", np.array(["ab"], dtype=object)))
    request.raw_input_contents[0] = b"\x05\x00\x00\x00ab"
    refused(
        request, "string element 0 for inference input 's' for model 'm' declares 5 bytes but only 2 remain"
    )


# -- shared memory -----------------------------------------------------------------------------------------
@pytest.fixture
def regions(tmp_path: Path) -> Any:
    (tmp_path / "obj").write_bytes(bytes(64))
    shm = SharedMemoryRegions(directory=str(tmp_path))
    shm.register("r", "obj", 0, 64)
    yield shm
    shm.close()


def test_an_input_in_shared_memory_leaves_raw_contents_to_the_others(tmp_path: Path, regions: Any) -> None:
    shared = np.array([[3, -4]], np.int32)
    other = np.array([0.5], np.float64)
    with open(tmp_path / "obj", "r+b") as f:
        f.seek(8)
        f.write(shared.tobytes())
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="a", datatype="INT32", shape=[1, 2])
    t.parameters["shared_memory_region"].string_param = "r"
    t.parameters["shared_memory_offset"].int64_param = 8
    t.parameters["shared_memory_byte_size"].int64_param = 8
    request.inputs.add(name="b", datatype="FP64", shape=[1])
    request.raw_input_contents.append(other.tobytes())
    a, b = parse_request(request, SIG, regions).inputs
    assert_same(a.array, shared)
    assert_same(b.array, other)


def test_an_input_in_shared_memory_with_contents_is_refused(regions: Any) -> None:
    request, t = one_input("INT32")
    t.parameters["shared_memory_region"].string_param = "r"
    t.parameters["shared_memory_byte_size"].int64_param = 8
    t.contents.int_contents.extend([1, 2])
    with pytest.raises(
        BadRequest, match="^contents field must not be specified for input 'x' in shared memory$"
    ):
        parse_request(request, SIG, regions)


def test_outputs_to_shared_memory_are_written_there(tmp_path: Path, regions: Any) -> None:
    request = pb.ModelInferRequest(model_name="m")
    o = request.outputs.add(name="y")
    o.parameters["shared_memory_region"].string_param = "r"
    o.parameters["shared_memory_offset"].int64_param = 16
    o.parameters["shared_memory_byte_size"].int64_param = 12
    request.outputs.add(name="z")
    req = parse_request(request, SIG, regions)
    assert req.outputs == [RequestedOutput("y", shm=ShmRef("r", 16, 12)), RequestedOutput("z")]
    y = np.array([1.0, 2.0], np.float32)
    z = np.array([[5, 6]], np.int32)
    response = encode_response(pb, req, SIG, "1", {"y": y, "z": z}, regions)
    assert list(response.raw_output_contents) == [b"", z.tobytes()]
    params = response.outputs[0].parameters
    assert params["shared_memory_region"].string_param == "r"
    assert params["shared_memory_byte_size"].int64_param == 8
    assert params["shared_memory_offset"].int64_param == 16
    assert not response.outputs[1].parameters
    assert (tmp_path / "obj").read_bytes()[16:24] == y.tobytes()


def test_an_output_to_a_region_too_small_is_refused_before_the_model_runs(regions: Any) -> None:
    request = pb.ModelInferRequest(model_name="m")
    o = request.outputs.add(name="y")
    o.parameters["shared_memory_region"].string_param = "r"
    o.parameters["shared_memory_offset"].int64_param = 60
    o.parameters["shared_memory_byte_size"].int64_param = 8
    with pytest.raises(BadRequest, match=re.escape("output 'y': offset 60 + byte_size 8 is past the end")):
        parse_request(request, SIG, regions)


# -- responses ---------------------------------------------------------------------------------------------
def test_response_fields_exactly() -> None:
    req = InferRequest([InferInput("x", "FP32", (1,), np.zeros(1, np.float32))], id="q-1")
    out: dict[str, npt.NDArray[Any]] = {
        "z": np.array([[1, 2]], np.int32),
        "y": np.array([0.5], np.float32),
        "extra": np.zeros(1),
    }
    response = encode_response(pb, req, SIG, "4", out)
    assert (response.model_name, response.model_version, response.id) == ("m", "4", "q-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [1]),
        ("z", "INT32", [1, 2]),
    ]  # the signature's outputs, in its order; others left out
    assert list(response.raw_output_contents) == [b"\x00\x00\x00\x3f", b"\x01\x00\x00\x00\x02\x00\x00\x00"]


def test_response_of_requested_outputs_in_their_order_without_an_id() -> None:
    req = InferRequest([], outputs=[RequestedOutput("z")])
    response = encode_response(pb, req, SIG, "1", {"y": np.zeros(1, np.float32), "z": np.zeros(1, np.int32)})
    assert [o.name for o in response.outputs] == ["z"]
    assert response.id == ""


def test_an_output_without_an_oip_datatype_is_refused() -> None:
    with pytest.raises(BadRequest, match="^numpy dtype complex128 has no Open Inference Protocol datatype$"):
        encode_response(pb, InferRequest([]), SIG, "1", {"y": np.zeros(2, np.complex128)})


@settings(max_examples=100, deadline=None)
@given(tensors(DATATYPE_NAMES), tensors(DATATYPE_NAMES))
def test_responses_decode_back_to_the_outputs(
    y: tuple[str, npt.NDArray[Any]], z: tuple[str, npt.NDArray[Any]]
) -> None:
    response = encode_response(pb, InferRequest([]), SIG, "1", {"y": y[1], "z": z[1]})
    assert [(o.name, o.datatype, tuple(o.shape)) for o in response.outputs] == [
        ("y", y[0], y[1].shape),
        ("z", z[0], z[1].shape),
    ]
    for o, raw, (_, want) in zip(response.outputs, response.raw_output_contents, (y, z), strict=True):
        assert_same(array_from_bytes(o.name, o.datatype, list(o.shape), raw, "m"), want)
    assert len(response.raw_output_contents) == 2


def test_a_scalar_output_keeps_its_empty_shape() -> None:
    response = encode_response(pb, InferRequest([]), SIG, "1", {"y": np.array(2.5, np.float32)})
    assert list(response.outputs[0].shape) == []
    assert list(response.raw_output_contents) == [np.float32(2.5).tobytes()]
