"""OIP v2 infer requests and responses over gRPC (``ModelInferRequest`` / ``ModelInferResponse``).

An input's data comes either in ``raw_input_contents`` (one entry per input, in input order:
little-endian values, BYTES elements length-prefixed) or in the typed ``contents`` field of its
datatype (INT8 and INT16 in ``int_contents``, UINT8 and UINT16 in ``uint_contents``, BYTES in
``bytes_contents``; FP16 has none). Values are checked against their datatype's range. Outputs
always go back in ``raw_output_contents``, as Triton does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import BadRequest
from aisp.serve.oip.http_codec import MAX_TIMEOUT_US
from aisp.serve.oip.request import (
    DATATYPES,
    InferInput,
    InferRequest,
    RequestedOutput,
    Signature,
    array_from_bytes,
    datatype_of,
    element_count,
    encode_bytes,
)
from aisp.serve.oip.shm import NO_REGIONS, SharedMemoryRegions, shm_ref

__all__ = ["CONTENTS_FIELD", "encode_response", "parse_request"]

CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""The typed ``contents`` field that carries each datatype."""
_FIELDS = sorted(set(CONTENTS_FIELD.values()))
_FIELD_TYPE = {
    "bool_contents": "BOOL",
    "int_contents": "INT32",
    "int64_contents": "INT64",
    "uint_contents": "UINT32",
    "uint64_contents": "UINT64",
    "fp32_contents": "FP32",
    "fp64_contents": "FP64",
    "bytes_contents": "BYTES",
}


def parse_request(request: Any, sig: Signature, shm: SharedMemoryRegions = NO_REGIONS) -> InferRequest:
    """The tensors of a ``ModelInferRequest``, converted and range-checked, and its parameters.
    Inputs in shared memory are read from ``shm`` (``raw_input_contents`` then holds the other
    inputs' data, in order); outputs to it are checked to fit there."""
    raw = request.raw_input_contents
    inputs, next_raw = [], 0
    for t in request.inputs:
        shape = tuple(int(d) for d in t.shape)
        if t.datatype not in DATATYPES:
            raise BadRequest(
                f"invalid datatype {t.datatype!r} for input {t.name!r}; one of {sorted(DATATYPES)}"
            )
        filled = [f for f in _FIELDS if len(getattr(t.contents, f))]
        where = f"input {t.name!r}"
        ref = shm_ref(_plain(t.parameters, where), where) if t.parameters else None
        if ref is not None:
            if filled:
                raise BadRequest(f"contents field must not be specified for {where} in shared memory")
            arr = array_from_bytes(t.name, t.datatype, shape, shm.read(ref, where), sig.model)
        elif raw:
            if filled:
                raise BadRequest(
                    f"contents field must not be specified when using raw_input_contents for {t.name!r}"
                    f" for model {sig.model!r}"
                )
            if next_raw >= len(raw):
                raise BadRequest(f"unable to find data for input tensor {t.name!r} for model {sig.model!r}")
            arr = array_from_bytes(t.name, t.datatype, shape, raw[next_raw], sig.model)
            next_raw += 1
        else:
            arr = _typed(t, shape, filled, sig.model)
        inputs.append(InferInput(t.name, t.datatype, shape, arr))
    params = request.parameters
    return InferRequest(
        inputs,
        outputs=[_output(o, shm) for o in request.outputs] or None,
        id=request.id or None,
        priority=_uint_param(params, "priority", 2**64 - 1) or 0,
        timeout_us=_uint_param(params, "timeout", MAX_TIMEOUT_US),
        rollout_key=_rollout_key(params),
    )


def _rollout_key(params: Any) -> str | None:
    if "rollout_key" not in params:
        return None
    p = params["rollout_key"]
    choice = p.WhichOneof("parameter_choice")
    if choice not in ("string_param", "int64_param", "uint64_param"):
        raise BadRequest("parameter 'rollout_key' must be a string or an integer")
    return str(getattr(p, choice))


def _typed(t: Any, shape: tuple[int, ...], filled: list[str], model: str) -> npt.NDArray[Any]:
    count = element_count(t.name, shape)
    field = CONTENTS_FIELD.get(t.datatype)
    if field is None:
        raise BadRequest(
            f"input {t.name!r}: {t.datatype} has no typed contents; send it in raw_input_contents"
        )
    wrong = [f for f in filled if f != field]
    if wrong:
        raise BadRequest(
            f"unexpected explicit tensor data for input tensor {t.name!r} for model {model!r} of type"
            f" {_FIELD_TYPE[wrong[0]]!r}, expected datatype {t.datatype!r}"
        )
    values = getattr(t.contents, field)
    if len(values) != count:
        raise BadRequest(f"input {t.name!r}: {len(values)} values in {field} for shape {list(shape)}")
    dtype = DATATYPES[t.datatype]
    if t.datatype == "BYTES":
        out = np.empty(count, dtype=object)
        for k, v in enumerate(values):
            try:
                out[k] = v.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"input {t.name!r}: element {k} is not UTF-8 text") from None
        return out.reshape(shape)
    # integers read as the field's own width and sign: numpy's guess would make a mix of uint64
    # values from 2**63 and smaller ones float64, losing the low bits
    wide = np.asarray(
        values, dtype=(np.uint64 if field.startswith("uint") else np.int64) if dtype.kind in "iu" else None
    )
    if dtype.kind in "iu" and wide.size:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise BadRequest(f"input {t.name!r}: a value is out of range for {t.datatype}")
    return wide.astype(dtype).reshape(shape)


def _uint_param(params: Any, key: str, limit: int) -> int | None:
    if key not in params:
        return None
    p = params[key]
    which = p.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise BadRequest(f"invalid value type for {key!r} parameter, expected int64_param or uint64_param")
    value = int(getattr(p, which))
    if not 0 <= value <= limit:
        raise BadRequest(f"invalid value for {key!r}: expected an integer from 0 to {limit}, got {value}")
    return value


def _plain(params: Any, where: str) -> dict[str, Any]:
    """A parameters map as plain values (strings, integers, booleans, floats)."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is None:
            raise BadRequest(f"{where}: parameter {key!r} has no value")
        out[key] = getattr(p, which)
    return out


def _output(o: Any, shm: SharedMemoryRegions) -> RequestedOutput:
    where = f"output {o.name!r}"
    if "classification" in o.parameters:
        raise BadRequest(f"{where}: the classification extension is not supported")
    ref = shm_ref(_plain(o.parameters, where), where) if o.parameters else None
    if ref is not None:
        shm.check(ref, where)  # refused before the model runs
    return RequestedOutput(o.name, shm=ref)


def encode_response(
    pb: Any,
    req: InferRequest,
    sig: Signature,
    version: str,
    outputs: dict[str, npt.NDArray[Any]],
    shm: SharedMemoryRegions = NO_REGIONS,
) -> Any:
    """A ``ModelInferResponse`` with the requested outputs (all when none is named); an output
    asked for in shared memory is written there, its ``raw_output_contents`` entry left empty
    (one entry per output, as Triton keeps them)."""
    wanted = req.outputs or [RequestedOutput(n) for n in sig.output_names if n in outputs]
    response = pb.ModelInferResponse(model_name=sig.model, model_version=version, id=req.id or "")
    for o in wanted:
        shape = list(np.shape(outputs[o.name]))  # before ascontiguousarray, which makes a 0-d array 1-d
        arr = np.ascontiguousarray(outputs[o.name])
        datatype = datatype_of(arr.dtype)
        tensor = response.outputs.add(name=o.name, datatype=datatype, shape=shape)
        raw = encode_bytes(arr) if datatype == "BYTES" else arr.tobytes()
        if o.shm is None:
            response.raw_output_contents.append(raw)
            continue
        shm.write(o.shm, raw, f"output {o.name!r}")
        response.raw_output_contents.append(b"")
        tensor.parameters["shared_memory_region"].string_param = o.shm.region
        tensor.parameters["shared_memory_byte_size"].int64_param = len(raw)
        if o.shm.offset:
            tensor.parameters["shared_memory_offset"].int64_param = o.shm.offset
    return response
