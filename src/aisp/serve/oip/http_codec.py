"""OIP v2 infer requests and responses over HTTP/REST, with Triton's binary tensor extension.

A request body is JSON, or a JSON header of ``Inference-Header-Content-Length`` bytes followed
by the binary tensors in input order (each input's ``parameters.binary_data_size``; BYTES
elements length-prefixed). A header length of 0 is Triton's raw form: the whole body is the
model's one input, its shape deduced from the model's dims. Outputs are answered in binary when
asked for (``binary_data`` per listed output; ``binary_data_output`` for all when none is
listed), in JSON otherwise. Every malformed request is a ``BadRequest`` naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from aisp.errors import BadRequest
from aisp.serve.oip.request import (
    DATATYPES,
    MAX_ELEMENTS,
    InferInput,
    InferRequest,
    RequestedOutput,
    Signature,
    array_from_bytes,
    array_from_json,
    array_of_values,
    datatype_of,
    element_count,
    empty_array,
    encode_bytes,
    item_types,
)
from aisp.serve.oip.shm import NO_REGIONS, SharedMemoryRegions, ShmRef, shm_ref

__all__ = ["HEADER_LENGTH", "MAX_TIMEOUT_US", "encode_response", "parse_request"]

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_TIMEOUT_US = 3_600_000_000
"""The longest ``timeout`` parameter a request may give: one hour, in microseconds."""
_ELSEWHERE = frozenset(
    ("binary_data_size", "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
)
"""Input parameters that say the data is not in ``data``."""
_DIGITS = re.compile(r"[0-9]{1,10}")

Dim = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Tensor(msgspec.Struct):
    name: str
    datatype: str
    shape: list[Dim]
    parameters: dict[str, Any] | None = None
    data: msgspec.Raw = msgspec.Raw(b"")


class _Output(msgspec.Struct):
    name: str
    parameters: dict[str, Any] | None = None


class _Request(msgspec.Struct):
    inputs: list[_Tensor]
    outputs: list[_Output] | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None


_decoder = msgspec.json.Decoder(_Request)
_JSON_HEADERS = {"content-type": "application/json"}  # shared: callers only read it
_encode = msgspec.json.Encoder().encode


def _typed_tensor(datatype: str, items: Any) -> Any:
    """An input whose flat ``data`` decodes straight to ``datatype``'s item type."""
    fields: list[Any] = [
        ("name", str),
        ("shape", list[Dim]),
        ("data", items),
        ("parameters", dict[str, Any] | None, None),
    ]
    return msgspec.defstruct(f"_Typed{datatype}", fields, tag_field="datatype", tag=datatype)


# UINT64 is left to the general path (its values past int64 need numpy's overflow check)
# FP16 and FP32 values that would round to infinity fail this decoder: the general path says so
_TYPED = {_typed_tensor(dt, items): dt for dt, items in item_types(finite=True).items() if dt != "UINT64"}


class _TypedRequest(msgspec.Struct):
    inputs: list[Union[tuple(_TYPED)]]  # type: ignore[valid-type]  # noqa: UP007
    outputs: list[_Output] | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None


_typed_decoder = msgspec.json.Decoder(_TypedRequest)


def parse_request(
    body: bytes, header_length: str | None, sig: Signature, shm: SharedMemoryRegions = NO_REGIONS
) -> InferRequest:
    """The request in ``body`` (for the model of ``sig``), its tensors converted and checked;
    inputs named in shared memory are read from ``shm``, outputs to it checked to fit there."""
    if header_length is None:
        typed = _typed_request(body, shm)
        if typed is not None:
            return typed
    return _general_request(body, header_length, sig, shm)


def _general_request(
    body: bytes, header_length: str | None, sig: Signature, shm: SharedMemoryRegions
) -> InferRequest:
    """``parse_request`` for every form of request: JSON (``data`` flat or nested), the binary
    extension, shared memory and the raw form; each mistake named."""
    blob = memoryview(b"")
    if header_length is not None:
        n = _header_length(header_length, len(body))
        if n == 0:
            return _raw_request(body, sig)
        body, blob = body[:n], memoryview(body)[n:]
    try:
        msg = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"invalid inference request: {str(exc).replace('$', 'request', 1)}") from None
    except RecursionError:
        raise BadRequest("invalid inference request: JSON nested too deeply") from None
    inputs, used = [], 0
    for t in msg.inputs:
        where = f"input {t.name!r}"
        params = _params(t.parameters, where)
        size, ref = params.get("binary_data_size"), shm_ref(params, where) if params else None
        if ref is not None:
            if size is not None or len(t.data):
                raise BadRequest(f"{where} in shared memory must set neither 'data' nor 'binary_data_size'")
            arr = array_from_bytes(t.name, t.datatype, t.shape, shm.read(ref, where), sig.model)
        elif size is not None:
            _check_uint(size, f"input {t.name!r}: 'binary_data_size'")
            if len(t.data):
                raise BadRequest(f"input {t.name!r} must set only one of 'data' and 'binary_data_size'")
            if used + size > len(blob):
                raise BadRequest(
                    f"unexpected size for input {t.name!r}, expecting {used + size - len(blob)} additional"
                    f" bytes for model {sig.model!r}"
                )
            arr = array_from_bytes(t.name, t.datatype, t.shape, blob[used : used + size], sig.model)
            used += size
        elif len(t.data):
            arr = array_from_json(t.name, t.datatype, t.shape, t.data)
        else:
            arr = empty_array(t.name, t.datatype, t.shape)
        inputs.append(InferInput(t.name, t.datatype, tuple(t.shape), arr))
    if used != len(blob):
        raise BadRequest(f"unexpected additional input data for model {sig.model!r}")
    return _request(msg, inputs, shm)


def _typed_request(body: bytes, shm: SharedMemoryRegions) -> InferRequest | None:
    """A JSON request whose inputs all carry flat ``data`` of a known datatype, decoded in one
    pass; None for anything else (nested data, the binary extension, any error), which the
    general path decodes and, if it is wrong, names what is wrong."""
    try:
        msg = _typed_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    inputs = []
    for t in msg.inputs:
        if t.parameters and not _ELSEWHERE.isdisjoint(t.parameters):
            return None  # data and data elsewhere both: the general path's error
        datatype = _TYPED[type(t)]
        if t.parameters:
            _params(t.parameters, f"input {t.name!r}")
        count = math.prod(t.shape)  # msgspec checked the dims: integers from 0
        if count > MAX_ELEMENTS:
            element_count(t.name, t.shape)  # raises, naming the shape
        arr = array_of_values(t.name, datatype, t.shape, t.data, count, finite=True)
        inputs.append(InferInput(t.name, datatype, tuple(t.shape), arr))
    return _request(msg, inputs, shm)


def _request(msg: Any, inputs: list[InferInput], shm: SharedMemoryRegions) -> InferRequest:
    """The request of a decoded body (``_Request`` or ``_TypedRequest``) and its inputs."""
    if msg.parameters is None and msg.outputs is None:  # the usual request
        return InferRequest(inputs, id=msg.id)
    params = _params(msg.parameters, "request")
    timeout = params.get("timeout")
    return InferRequest(
        inputs,
        outputs=None if msg.outputs is None else [_output(o, shm) for o in msg.outputs],
        id=msg.id,
        priority=_check_uint(params.get("priority", 0), "parameter 'priority'"),
        timeout_us=None if timeout is None else _check_uint(timeout, "parameter 'timeout'", MAX_TIMEOUT_US),
        binary_output=_flag(params, "binary_data_output", "request"),
        rollout_key=_rollout_key(params.get("rollout_key")),
    )


def _rollout_key(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRequest(
            f"parameter 'rollout_key' must be a string or an integer, got {type(value).__name__}"
        )
    return str(value)


def _header_length(value: str, body_bytes: int) -> int:
    if not _DIGITS.fullmatch(value.strip()):
        raise BadRequest(f"{HEADER_LENGTH} must be a non-negative integer, got {value[:40]!r}")
    n = int(value)
    if n > body_bytes:
        raise BadRequest(f"inference header size should be in range (0, {body_bytes}), got: {n}")
    return n


def _params(value: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``parameters`` of a request, input or output: values are strings, numbers or booleans."""
    if not value:
        return {}
    for k, v in value.items():
        if type(v) not in (str, int, float, bool):
            raise BadRequest(f"{where}: parameter {k!r} has invalid type; it should be int, bool or string")
    return value


def _check_uint(value: Any, what: str, limit: int = 2**64 - 1) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise BadRequest(f"{what} must be an integer from 0 to {limit}, got {value!r}")
    return value


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if type(value) is not bool:
        raise BadRequest(f"{where}: parameter {key!r} must be true or false, got {value!r}")
    return value


def _output(o: _Output, shm: SharedMemoryRegions) -> RequestedOutput:
    where = f"output {o.name!r}"
    params = _params(o.parameters, where)
    if "classification" in params:
        raise BadRequest(f"{where}: the classification extension is not supported")
    binary = _flag(params, "binary_data", where)
    ref = shm_ref(params, where) if params else None
    if ref is not None:
        if binary:
            raise BadRequest(f"{where}: set only one of 'binary_data' and 'shared_memory_region'")
        shm.check(ref, where)  # refused before the model runs
    return RequestedOutput(o.name, binary=binary, shm=ref)


def _raw_request(body: bytes, sig: Signature) -> InferRequest:
    """Triton's raw binary request (header length 0): the body is the model's single input."""
    if len(sig.inputs) != 1:
        raise BadRequest(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(sig.inputs)} inputs"
            f" in {sig.model!r} model configuration"
        )
    spec = sig.inputs[0]
    if spec.datatype == "BYTES":
        if spec.dims != (1,):
            raise BadRequest(
                f"For BYTE datatype raw input {spec.name!r}, the model must have input shape [1]"
            )
        body = len(body).to_bytes(4, "little") + body
        shape: tuple[int, ...] = (1, 1)
    else:
        wildcards = spec.dims.count(-1)
        if wildcards > 1:
            raise BadRequest(
                f"The shape of the raw input {spec.name!r} can not be deduced because there are more"
                " than one variable-sized dimension"
            )
        per_unit = int(np.prod([d for d in spec.dims if d != -1])) * DATATYPES[spec.datatype].itemsize
        free = len(body) // per_unit if per_unit else 0  # a size that does not divide fails below
        shape = (1, *(free if d == -1 else d for d in spec.dims))
    arr = array_from_bytes(spec.name, spec.datatype, shape, body, sig.model)
    return InferRequest([InferInput(spec.name, spec.datatype, shape, arr)], binary_output=True)


def encode_response(
    req: InferRequest,
    sig: Signature,
    version: str,
    outputs: dict[str, np.ndarray[Any, Any]],
    shm: SharedMemoryRegions = NO_REGIONS,
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers (``Content-Type``; ``Inference-Header-Content-Length``
    when binary tensors follow the JSON); outputs asked for in shared memory are written to
    ``shm`` and answered by their region. The JSON is framed here and only its values go
    through the encoder (one small encode each, no intermediate dicts)."""
    wanted: list[tuple[str, bool, ShmRef | None]]
    if req.outputs is None:
        wanted = [(n, req.binary_output, None) for n in sig.output_names if n in outputs]
    else:
        wanted = [(o.name, o.binary, o.shm) for o in req.outputs]
    entries, blobs = [], []
    for name, binary, ref in wanted:
        arr = outputs[name]
        datatype = datatype_of(arr.dtype)
        head = b'{"name":%s,"datatype":"%s","shape":%s' % (
            _encode(name),
            datatype.encode(),
            _encode(arr.shape),
        )
        if ref is None and not binary:
            entries.append(b'%s,"data":%s}' % (head, _encode(arr.reshape(-1).tolist())))
            continue
        arr = np.ascontiguousarray(arr)
        raw = encode_bytes(arr) if datatype == "BYTES" else arr.tobytes()
        if ref is not None:  # answered with no data and no parameters (Triton's clients read an
            shm.write(ref, raw, f"output {name!r}")  # output's parameters as the binary extension's)
            entries.append(head + b"}")
        else:
            entries.append(b'%s,"parameters":{"binary_data_size":%d}}' % (head, len(raw)))
            blobs.append(raw)
    request_id = b"" if req.id is None else b',"id":' + _encode(req.id)
    header = b'{"model_name":%s,"model_version":%s,"outputs":[%s]%s}' % (
        _encode(sig.model),
        _encode(version),
        b",".join(entries),
        request_id,
    )
    if not any(blobs):
        return header, _JSON_HEADERS
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }
