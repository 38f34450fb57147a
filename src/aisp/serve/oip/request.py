"""Open Inference Protocol v2 requests, whatever their transport: converted, then checked once.

Each transport turns its wire form (HTTP JSON, the binary tensor extension, gRPC typed
``contents`` or ``raw_input_contents``) into ``InferInput``s: a name, a datatype, a shape and
the data converted to an array with every value checked against its datatype's range.
``check_request`` then checks them against the model's ``Signature`` as Triton does, with
Triton's messages where its clients read them: the requested outputs exist and are not
repeated, the inputs are exactly the model's (none missing, none unknown, none twice), they
share a batch dimension of at most ``max_batch_size``, each has the model's datatype (never
converted) and a shape that fits the model's dims. Every failure is a ``BadRequest`` (HTTP 400,
gRPC INVALID_ARGUMENT) naming the input, output or field.

``BYTES`` tensors are arrays of ``str`` (ONNX Runtime's string tensors hold UTF-8 text): JSON
carries strings, the binary forms carry each element as a 4-byte little-endian length and its
bytes (``encode_bytes`` / ``decode_bytes``).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.errors import BadRequest
from aisp.infer.models.versions import ServedModel
from aisp.serve.oip.shm import ShmRef

__all__ = [
    "DATATYPES",
    "MAX_DATA_DEPTH",
    "MAX_ELEMENTS",
    "InferInput",
    "InferRequest",
    "RequestedOutput",
    "Signature",
    "TensorSignature",
    "array_from_bytes",
    "array_from_json",
    "array_of_values",
    "item_types",
    "check_arrays",
    "check_request",
    "datatype_of",
    "decode_bytes",
    "element_count",
    "signature_of",
    "empty_array",
    "encode_bytes",
]

MAX_ELEMENTS = 1 << 32
"""The most elements one tensor may declare (a request body is far smaller than this)."""
MAX_DATA_DEPTH = 100
"""How deeply JSON ``data`` may nest (Triton's limit)."""


def _int_list(lo: int, hi: int | None) -> Any:
    """A list of ints in ``lo..hi`` (msgspec checks bounds within int64; UINT64's top is checked
    when the array is made)."""
    return list[Annotated[int, msgspec.Meta(ge=lo, le=hi)]]


_ITEMS: dict[str, tuple[np.dtype[Any], Any]] = {
    "BOOL": (np.dtype(np.bool_), list[bool]),
    "UINT8": (np.dtype(np.uint8), _int_list(0, 2**8 - 1)),
    "UINT16": (np.dtype(np.uint16), _int_list(0, 2**16 - 1)),
    "UINT32": (np.dtype(np.uint32), _int_list(0, 2**32 - 1)),
    "UINT64": (np.dtype(np.uint64), _int_list(0, None)),
    "INT8": (np.dtype(np.int8), _int_list(-(2**7), 2**7 - 1)),
    "INT16": (np.dtype(np.int16), _int_list(-(2**15), 2**15 - 1)),
    "INT32": (np.dtype(np.int32), _int_list(-(2**31), 2**31 - 1)),
    "INT64": (np.dtype(np.int64), _int_list(-(2**63), 2**63 - 1)),
    "FP16": (np.dtype(np.float16), list[float]),
    "FP32": (np.dtype(np.float32), list[float]),
    "FP64": (np.dtype(np.float64), list[float]),
    "BYTES": (np.dtype(np.object_), list[str]),
}
DATATYPES: dict[str, np.dtype[Any]] = {name: dtype for name, (dtype, _) in _ITEMS.items()}
"""OIP datatype names and the numpy dtype of their arrays (``object`` of ``str`` for BYTES)."""
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


_NARROW_FLOATS = {  # JSON numbers may overflow them: the magnitude from which one rounds to inf
    "FP16": 2.0**16 * (1 - 2.0**-12),
    "FP32": 2.0**128 * (1 - 2.0**-25),
}


def item_types(*, finite: bool = False) -> dict[str, Any]:
    """Each datatype's type of its flat JSON ``data`` (``list[float]``, bounded ``list[int]``...).
    ``finite``: FP16 and FP32 values bounded too (the decoder refuses any that would round to
    infinity, where otherwise ``array_of_values`` checks them and says so)."""
    types = {name: items for name, (_, items) in _ITEMS.items()}
    if finite:
        for name, top in _NARROW_FLOATS.items():
            types[name] = list[Annotated[float, msgspec.Meta(gt=-top, lt=top)]]
    return types


_DECODERS = {name: msgspec.json.Decoder(items) for name, items in item_types().items()}
_SMALL = 1024  # elements: checked in Python (cheaper than numpy's set-up for a few values)


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The OIP datatype of arrays of ``dtype`` (``object`` and numpy strings are BYTES).

    >>> datatype_of(np.dtype(np.float32)), datatype_of(np.dtype(object)), datatype_of(np.dtype("U3"))
    ('FP32', 'BYTES', 'BYTES')
    """
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    if dtype.kind in "OUS":
        return "BYTES"
    raise BadRequest(f"numpy dtype {dtype} has no Open Inference Protocol datatype")


@dataclass(frozen=True, slots=True)
class TensorSignature:
    """One input or output of a model: OIP datatype and dims without the batch (-1: any)."""

    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    """What a model takes and gives, as ``check_request`` checks requests against it."""

    model: str
    max_batch_size: int
    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]

    @functools.cached_property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @functools.cached_property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


class InferInput(msgspec.Struct, frozen=True):
    """One request input, its data converted and shaped (``array.shape == shape``). (The
    request records are ``msgspec`` structs: built per request, several times cheaper than
    frozen dataclasses.)"""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: npt.NDArray[Any]


class RequestedOutput(msgspec.Struct, frozen=True):
    """An output the request names; ``binary``: answer it in binary (HTTP only); ``shm``: write
    it into that shared-memory region instead of the response."""

    name: str
    binary: bool = False
    shm: ShmRef | None = None


class InferRequest(msgspec.Struct):
    """A request, whatever its transport, before it is checked against the model."""

    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None
    id: str | None = None
    priority: int = 0
    timeout_us: int | None = None
    binary_output: bool = False
    rollout_key: str | None = None  # sticks the request to one version during a rollout


# -- shapes and data --------------------------------------------------------------------------
def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def element_count(name: str, shape: Sequence[int]) -> int:
    """The number of elements of a tensor of ``shape``, in exact arithmetic (no overflow).

    >>> element_count("x", [2, 3]), element_count("x", [])
    (6, 1)
    """
    for d in shape:
        if type(d) is not int or d < 0:
            raise BadRequest(f"input {name!r}: shape {list(shape)} must be non-negative integers")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise BadRequest(
            f"invalid shape for input {name!r}: shape {_dims(shape)} causes total element count to"
            f" exceed maximum size of {MAX_ELEMENTS}"
        )
    return count


def empty_array(name: str, datatype: str, shape: Sequence[int]) -> npt.NDArray[Any]:
    """A tensor of no elements (a zero in ``shape``) that came without data."""
    dtype, _ = _datatype(name, datatype)
    if element_count(name, shape):
        raise BadRequest(f"input {name!r} must set one of 'data' and 'binary_data_size'")
    return np.empty(tuple(shape), dtype=dtype)


def _datatype(name: str, datatype: str) -> tuple[np.dtype[Any], Any]:
    item = _ITEMS.get(datatype)
    if item is None:
        raise BadRequest(f"invalid datatype {datatype!r} for input {name!r}; one of {sorted(_ITEMS)}")
    return item


def array_from_json(name: str, datatype: str, shape: Sequence[int], data: bytes) -> npt.NDArray[Any]:
    """The array of JSON ``data`` (flat or nested row-major), every value checked for ``datatype``."""
    dtype, items = _datatype(name, datatype)
    count = element_count(name, shape)
    try:
        values = _DECODERS[datatype].decode(data)
    except msgspec.ValidationError as exc:
        values = _nested(name, data, items, exc)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"input {name!r}: 'data' is not valid JSON: {_reason(exc)}") from None
    return array_of_values(name, datatype, shape, values, count)


def array_of_values(
    name: str, datatype: str, shape: Sequence[int], values: list[Any], count: int, *, finite: bool = False
) -> npt.NDArray[Any]:
    """The array of a flat list of ``values`` already typed for ``datatype`` (JSON decoded to
    its item type), for a tensor of ``shape`` and ``count`` elements. ``finite``: the decoder
    has bounded the values (``item_types(finite=True)``)."""
    dtype = _ITEMS[datatype][0]
    if len(values) > count:
        raise BadRequest(f"input {name!r}: unable to parse 'data': shape does not match true shape of 'data'")
    if len(values) < count:
        raise BadRequest(f"input {name!r}: failed to parse 'data' field: shape does not match true shape")
    if datatype in _NARROW_FLOATS and not finite:
        top = _NARROW_FLOATS[datatype]
        if count <= _SMALL:  # JSON numbers are finite: only a magnitude past the type's can overflow
            if values and (max(values) >= top or min(values) <= -top):
                raise BadRequest(f"input {name!r}: a value of 'data' is out of range for {datatype}")
            return np.array(values, dtype=dtype).reshape(shape)
        with np.errstate(over="ignore"):
            arr = np.array(values, dtype=dtype)
        if not np.isfinite(arr).all():
            raise BadRequest(f"input {name!r}: a value of 'data' is out of range for {datatype}")
        return arr.reshape(shape)
    try:
        arr = np.array(values, dtype=dtype) if values else np.empty(0, dtype=dtype)
    except OverflowError:  # UINT64 past 2**64 - 1
        raise BadRequest(f"input {name!r}: a value of 'data' is out of range for {datatype}") from None
    return arr.reshape(shape)


def _nested(name: str, data: bytes, items: Any, first: msgspec.ValidationError) -> list[Any]:
    """Nested ``data`` flattened row-major (at most ``MAX_DATA_DEPTH`` deep), then checked."""
    try:
        tree = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        raise BadRequest(
            f"input {name!r}: JSON nesting depth exceeds maximum allowed limit ({MAX_DATA_DEPTH})"
        ) from None
    if not isinstance(tree, list):
        raise BadRequest(f"input {name!r}: unable to parse 'data': {_reason(first)}")
    flat: list[Any] = []
    stack: list[tuple[list[Any], int, int]] = [(tree, 0, 1)]  # (list, next index, depth)
    while stack:
        level, i, depth = stack.pop()
        if depth > MAX_DATA_DEPTH:
            raise BadRequest(
                f"input {name!r}: JSON nesting depth exceeds maximum allowed limit ({MAX_DATA_DEPTH})"
            )
        while i < len(level):
            v = level[i]
            i += 1
            if isinstance(v, list):
                stack += [(level, i, depth), (v, 0, depth + 1)]
                break
            flat.append(v)
    try:
        return msgspec.convert(flat, type=items)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise BadRequest(f"input {name!r}: unable to parse 'data': {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).replace("$", "data", 1) if "$" in str(exc) else str(exc)


def array_from_bytes(
    name: str, datatype: str, shape: Sequence[int], data: bytes | memoryview, model: str
) -> npt.NDArray[Any]:
    """The array of a binary tensor: raw little-endian values, or BYTES' length-prefixed elements."""
    dtype, _ = _datatype(name, datatype)
    count = element_count(name, shape)
    if datatype == "BYTES":
        return decode_bytes(name, data, count, model).reshape(shape)
    want = count * dtype.itemsize
    if len(data) != want:
        raise BadRequest(
            f"input byte size mismatch for input {name!r} for model {model!r}."
            f" Expected {want}, got {len(data)}"
        )
    if datatype == "BOOL":
        flags: npt.NDArray[np.bool_] = np.frombuffer(data, dtype=np.uint8) != 0
        return flags.reshape(shape)
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)


_LENGTH = struct.Struct("<I")


def decode_bytes(name: str, data: bytes | memoryview, count: int, model: str) -> npt.NDArray[Any]:
    """``count`` length-prefixed elements, as text (an ONNX string tensor holds UTF-8)."""
    buf = memoryview(data)
    out = np.empty(count, dtype=object)
    pos, n, size = 0, 0, len(buf)
    where = f"for inference input {name!r} for model {model!r}"
    while pos < size:
        if n == count:
            raise BadRequest(f"unexpected number of string elements {n + 1} {where}, expecting {count}")
        if size - pos < 4:
            raise BadRequest(
                f"incomplete string length indicator {where}, expecting 4 bytes but only"
                f" {size - pos} bytes available"
            )
        (length,) = _LENGTH.unpack_from(buf, pos)
        pos += 4
        if length > size - pos:
            raise BadRequest(
                f"string element {n} {where} declares {length} bytes but only {size - pos} remain"
            )
        try:
            out[n] = str(buf[pos : pos + length], "utf-8")
        except UnicodeDecodeError:
            raise BadRequest(
                f"string element {n} {where} is not UTF-8 text (string tensors hold text)"
            ) from None
        pos += length
        n += 1
    if n != count:
        raise BadRequest(f"expected {count} string elements {where}, got {n}")
    return out


def encode_bytes(arr: npt.NDArray[Any]) -> bytes:
    """Elements of a BYTES array, each as a 4-byte little-endian length and its bytes.

    >>> encode_bytes(np.array(["ab", ""], dtype=object))
    b'\\x02\\x00\\x00\\x00ab\\x00\\x00\\x00\\x00'
    """
    parts = []
    for x in arr.reshape(-1).tolist():
        raw = x if isinstance(x, bytes) else str(x).encode()
        parts += [_LENGTH.pack(len(raw)), raw]
    return b"".join(parts)


# -- the checks ----------------------------------------------------------------------------------
def check_request(req: InferRequest, sig: Signature) -> dict[str, npt.NDArray[Any]]:
    """The request's arrays by input name (in the model's order), once everything holds."""
    if req.outputs is None and len(req.inputs) == len(sig.inputs):  # the usual request: fast
        arrays, batch = {}, -1
        for t, spec in zip(req.inputs, sig.inputs):  # noqa: B905 - same lengths, checked above
            shape = t.shape
            if t.name != spec.name or t.datatype != spec.datatype or not shape or shape[1:] != spec.dims:
                break  # not exactly the model's: the checks below say what differs
            if batch != shape[0]:
                if batch >= 0:
                    break  # inputs of different batch sizes
                batch = shape[0]
            arrays[t.name] = t.array
        else:
            if batch <= sig.max_batch_size:
                return arrays
    model = sig.model
    if req.outputs is not None:
        seen: set[str] = set()
        known = set(sig.output_names)
        for o in req.outputs:
            if o.name in seen:
                raise BadRequest(f"output {o.name!r} already exists in request")
            if o.name not in known:
                raise BadRequest(f"unexpected inference output {o.name!r} for model {model!r}")
            seen.add(o.name)
    given: dict[str, InferInput] = {}
    for t in req.inputs:
        if t.name in given:
            raise BadRequest(f"input {t.name!r} already exists in request")
        given[t.name] = t
    names = sig.input_names
    missing = [n for n in names if n not in given]
    unknown = [n for n in given if n not in names]
    if unknown and len(given) >= len(names):
        raise BadRequest(f"unexpected inference input {unknown[0]!r} for model {model!r}")
    if missing:
        raise BadRequest(
            f"expected {len(names)} inputs but got {len(given)} inputs for model {model!r}. Got input(s)"
            f" {list(given)}, but missing required input(s) {missing}. Please provide all required input(s)."
        )
    _check_batch(sig, [given[n] for n in names])
    for spec in sig.inputs:
        _check_input(sig, spec, given[spec.name])
    return {n: given[n].array for n in names}


def check_arrays(sig: Signature, arrays: Mapping[str, npt.NDArray[Any]]) -> int:
    """``check_request`` for arrays given in Python; returns the batch size."""
    inputs = []
    for name, arr in arrays.items():
        a = np.asarray(arr)
        inputs.append(InferInput(name, datatype_of(a.dtype), tuple(a.shape), a))
    check_request(InferRequest(inputs), sig)
    return int(inputs[0].shape[0])


def _check_batch(sig: Signature, inputs: Sequence[InferInput]) -> None:
    batch = None
    for t in inputs:
        if not t.shape:
            raise BadRequest(
                f"input {t.name!r} has no shape but model requires batch dimension for {sig.model!r}"
            )
        if batch is None:
            batch = t.shape[0]
        elif t.shape[0] != batch:
            raise BadRequest(f"input {t.name!r} batch size does not match other inputs for {sig.model!r}")
    if batch is not None and batch > sig.max_batch_size:
        raise BadRequest(
            f"inference request batch-size must be <= {sig.max_batch_size} for {sig.model!r}, got {batch}"
        )


def _check_input(sig: Signature, spec: TensorSignature, t: InferInput) -> None:
    if t.datatype != spec.datatype:
        raise BadRequest(
            f"inference input {t.name!r} data-type is {t.datatype!r}, but model {sig.model!r}"
            f" expects {spec.datatype!r}"
        )
    dims = t.shape[1:]
    if len(dims) != len(spec.dims) or any(w != -1 and w != d for w, d in zip(spec.dims, dims, strict=True)):
        raise BadRequest(
            f"unexpected shape for input {t.name!r} for model {sig.model!r}. Expected"
            f" {_dims((-1, *spec.dims))}, got {_dims(t.shape)}. NOTE: the first dimension is the batch"
            f" (at most max_batch_size {sig.max_batch_size})"
        )


def signature_of(model: ServedModel) -> Signature:
    """The inputs and outputs requests are checked against: the model's ``config.pbtxt`` (which
    the model was checked against when it loaded: ``ModelConfig.check``), or, where it lists
    none, what the ONNX model itself declares."""
    cfg = model.config

    def listed(tensors: Sequence[Any]) -> tuple[TensorSignature, ...]:
        return tuple(TensorSignature(t.name, datatype_of(np.dtype(t.dtype)), tuple(t.dims)) for t in tensors)

    def declared(specs: Mapping[str, Any]) -> tuple[TensorSignature, ...]:
        out = []
        for name, spec in specs.items():
            dims = tuple(-1 if d is None else d for d in (spec.shape or (None, None))[1:])
            dtype = np.dtype(spec.dtype) if spec.dtype is not None else np.dtype(np.float32)
            out.append(TensorSignature(name, datatype_of(dtype), dims))
        return tuple(out)

    return Signature(
        cfg.name,
        cfg.max_batch_size,
        listed(cfg.inputs) if cfg.inputs else declared(model.input_specs),
        listed(cfg.outputs) if cfg.outputs else declared(model.output_specs),
    )
