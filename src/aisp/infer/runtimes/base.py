"""Model runtimes (the thing a batcher calls with one formed batch) and what a call costs.

A runtime takes named numpy arrays whose first dimension is the batch (rows) and returns named
arrays with the same number of rows. ``run`` is called from a worker thread, one call in flight per
batcher instance; ONNX Runtime releases the GIL while it computes, so the next batch forms
meanwhile.

>>> rt = PythonRuntime(lambda xs: {"y": xs["x"] * 2}, input_names=["x"], output_names=["y"], name="double")
>>> rt.run({"x": np.arange(3)})["y"].tolist()
[0, 2, 4]
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from aisp.errors import ModelError

__all__ = ["CostModel", "OnnxRuntime", "PythonRuntime", "Reshaped", "Runtime", "TensorSpec", "resolve"]

Arrays = dict[str, npt.NDArray[Any]]

CPU = "CPUExecutionProvider"
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")

_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    f"tensor({ort})": np.dtype(np_name)
    for ort, np_name in [
        ("float", "float32"),
        ("double", "float64"),
        ("float16", "float16"),
        ("int8", "int8"),
        ("int16", "int16"),
        ("int32", "int32"),
        ("int64", "int64"),
        ("uint8", "uint8"),
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("bool", "bool"),
        ("string", "object"),
    ]
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a model input wants: ``dtype`` and full ``shape`` (batch first, ``None`` = dynamic).

    Either may be ``None`` when unknown: callers then pass arrays as they are and warm-up skips.
    """

    dtype: np.dtype[Any] | None = None
    shape: tuple[int | None, ...] | None = None

    def zeros(self, rows: int) -> npt.NDArray[Any] | None:
        """A dummy input of ``rows`` rows (dynamic non-batch dims become 1); None if unknown."""
        if self.dtype is None or self.shape is None:
            return None
        dims = (rows, *(1 if d is None else d for d in self.shape[1:]))
        return np.zeros(dims, dtype=self.dtype)


@runtime_checkable
class Runtime(Protocol):
    """A model callable on whole batches, safe to call from a worker thread."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def input_names(self) -> tuple[str, ...]: ...
    @property
    def output_names(self) -> tuple[str, ...]: ...
    @property
    def input_specs(self) -> Mapping[str, TensorSpec]:
        """Dtype and shape each input wants (used to cast inputs and to build warm-up batches)."""
        ...

    @property
    def provider(self) -> str:
        """Where it runs, e.g. ``"CPUExecutionProvider"`` or ``"python"``."""
        ...

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        """Run one batch; every output has as many rows as the inputs."""
        ...

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run one all-zeros batch per size so the first real call pays no set-up cost."""
        ...


def resolve(runtime: Runtime) -> Runtime:
    """The concrete runtime to use for one call: a versioned model resolves to its current version."""
    pick = getattr(runtime, "resolve", None)
    return pick() if callable(pick) else runtime


def check_rows(name: str, inputs: Mapping[str, npt.NDArray[Any]], outputs: Mapping[str, Any]) -> None:
    """Raise ``ModelError`` unless every output has as many rows as the first input."""
    if not inputs:
        return
    rows = len(next(iter(inputs.values())))
    for out_name, out in outputs.items():
        got = out.shape[0] if getattr(out, "ndim", 0) >= 1 else None
        if got != rows:
            raise ModelError(
                f"model {name!r} returned {got} rows in output {out_name!r} for {rows} input rows"
            )


def file_sha256(path: str | PathLike[str]) -> str:
    """The SHA-256 (hex) of a model file: what a checkpoint records of a model step's weights."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


_LOCATION = b"\x0a\x08location\x12"
"""An ONNX tensor's external-data entry ``key: "location"`` as protobuf writes it (field 1, 8
bytes), followed by its ``value`` (field 2): the file, relative to the model's, holding weights."""


def onnx_weights_sha256(path: str | PathLike[str]) -> str:
    """The SHA-256 of an ONNX model's weights: of the file alone when it holds them all (as
    ``file_sha256``); with the files its tensors' external data name (a model over 2 GB, or saved
    with ``save_as_external_data``), in the order of their names, when it does not. A weight
    changed in an external file changes it. The names are read from the protobuf bytes (so the
    ``onnx`` package is not needed to run a model)."""
    import mmap

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        try:
            names: set[str] = set()
            at = data.find(_LOCATION)
            while at >= 0:
                at += len(_LOCATION)
                length = shift = 0
                while at < len(data):  # the value's length, a varint
                    byte = data[at]
                    at += 1
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    if byte < 0x80:
                        break
                names.add(bytes(data[at : at + length]).decode("utf-8", "replace"))
                at = data.find(_LOCATION, at + length)
            if not names:
                return hashlib.sha256(data).hexdigest()
            digest = hashlib.sha256(data)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()
    base = Path(path).parent
    for name in sorted(names):
        digest.update(b"\0" + name.encode() + b"\0")
        with open(base / name, "rb") as ext:
            for block in iter(lambda: ext.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


_INT4_OPS = (b"MatMulNBits",)
_INT8_OPS = (
    b"QLinearMatMul", b"MatMulInteger", b"QLinearConv", b"ConvInteger", b"DynamicQuantizeLinear",
    b"QuantizeLinear", b"QGemm", b"QAttention", b"DynamicQuantizeMatMul", b"MatMulIntegerToFloat",
)  # fmt: skip


def onnx_precision(path: str | PathLike[str], io_types: Sequence[str] = ()) -> str:
    """What an ONNX model computes in: ``int4`` or ``int8`` when its graph has quantized
    operators (an op_type as NodeProto writes it: field 4, its length, the name), ``fp16`` when
    an input or output is float16 (``io_types``: ORT's ``tensor(float16)`` strings), else
    ``fp32``. Read from the protobuf bytes, as ``onnx_weights_sha256``."""
    import mmap

    def node_op(op: bytes) -> bytes:
        return b"\x22" + bytes([len(op)]) + op

    with open(path, "rb") as fh:
        if not os.fstat(fh.fileno()).st_size:
            return "fp32"
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if any(data.find(node_op(op)) >= 0 for op in _INT4_OPS):
                return "int4"
            if any(data.find(node_op(op)) >= 0 for op in _INT8_OPS):
                return "int8"
    return "fp16" if "tensor(float16)" in io_types else "fp32"


def default_providers(available: Sequence[str]) -> list[str]:
    """GPU providers ``available`` offers (TensorRT, CUDA, in that order), then the CPU.

    >>> default_providers(["CPUExecutionProvider", "CUDAExecutionProvider"])
    ['CUDAExecutionProvider', 'CPUExecutionProvider']
    """
    return [p for p in GPU_PROVIDERS if p in available] + [CPU]


def _spec(meta: Any) -> TensorSpec:
    """The dtype and shape of an ONNX Runtime input or output (``NodeArg``)."""
    return TensorSpec(
        _ORT_DTYPES.get(meta.type), tuple(d if isinstance(d, int) else None for d in meta.shape)
    )


class OnnxRuntime:
    """An ONNX model run by ``onnxruntime.InferenceSession``.

    Args:
        path: the ``.onnx`` file.
        providers: execution providers in order of preference; by default TensorRT and CUDA when
            this onnxruntime build has them, then the CPU.
        intra_op_threads: threads one operator may use (1 keeps a core free for the pipeline).
        inter_op_threads: threads for running operators in parallel (sequential mode uses 1).
        name: the model name; the file's stem by default.
        version: the model version recorded in checkpoints and metrics.

    ``weights_sha256`` is the SHA-256 of the model's weights (the file, and the external-data
    files it names: ``onnx_weights_sha256``), computed once here, at load: a checkpoint
    records it beside the version, and a restore checks both (``aisp.schedule.model_steps``).

    Raises:
        ModelError: the file is missing or onnxruntime cannot load it.
    """

    def __init__(
        self,
        path: str | PathLike[str],
        *,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 1,
        inter_op_threads: int = 1,
        name: str | None = None,
        version: str = "1",
    ) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        self.name = name or self.path.stem
        self.version = version
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = inter_op_threads
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        chosen = list(providers) if providers else default_providers(ort.get_available_providers())
        try:
            self._session = ort.InferenceSession(str(self.path), sess_options=opts, providers=chosen)
        except Exception as exc:
            raise ModelError(f"cannot load model {str(self.path)!r}: {type(exc).__name__}: {exc}") from exc
        self.provider: str = self._session.get_providers()[0]
        metas = self._session.get_inputs()
        self.input_names = tuple(m.name for m in metas)
        self.output_names = tuple(m.name for m in self._session.get_outputs())
        self.input_specs: Mapping[str, TensorSpec] = {m.name: _spec(m) for m in metas}
        self.output_specs: Mapping[str, TensorSpec] = {m.name: _spec(m) for m in self._session.get_outputs()}
        self._outputs = list(self.output_names)
        self.weights_sha256 = onnx_weights_sha256(self.path)
        self.precision = onnx_precision(self.path, [m.type for m in (*metas, *self._session.get_outputs())])
        """``int4``, ``int8``, ``fp16`` or ``fp32`` (``onnx_precision``): what ``aisp diagnose``
        compares a quantized tier variant by."""

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        """Run one batch; ``ModelError`` if onnxruntime fails or the row counts differ."""
        try:
            results = self._session.run(self._outputs, dict(inputs))
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        outputs: Arrays = dict(zip(self._outputs, results, strict=True))
        check_rows(self.name, inputs, outputs)
        return outputs

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run one all-zeros batch per size, built from the model's input metadata."""
        warmup_with_zeros(self, batch_sizes)

    def __repr__(self) -> str:
        return f"OnnxRuntime({str(self.path)!r}, name={self.name!r}, provider={self.provider!r})"


class PythonRuntime:
    """A vectorised Python function ``fn(inputs) -> outputs`` used as a runtime.

    Args:
        fn: takes a dict of input arrays, returns a dict with at least ``output_names``.
        input_names: the input arrays ``fn`` reads.
        output_names: the output arrays it returns.
        name: the model name.
        version: the model version.
        input_specs: optional dtype/shape per input; inputs are cast to a given dtype by the
            infer stage, and warm-up runs only when every input's dtype and shape are given.
    """

    provider = "python"

    def __init__(
        self,
        fn: Callable[[Arrays], Mapping[str, npt.NDArray[Any]]],
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        name: str,
        version: str = "1",
        input_specs: Mapping[str, TensorSpec] | None = None,
    ) -> None:
        self._fn = fn
        self.name = name
        self.version = version
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        specs = dict(input_specs or {})
        self.input_specs: Mapping[str, TensorSpec] = {n: specs.get(n, TensorSpec()) for n in input_names}

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        """Call ``fn``; ``ModelError`` if an output is missing or has the wrong row count."""
        result = self._fn(dict(inputs))
        missing = [n for n in self.output_names if n not in result]
        if missing:
            raise ModelError(f"model {self.name!r} returned no output {missing}; got {sorted(result)}")
        outputs = {n: np.asarray(result[n]) for n in self.output_names}
        check_rows(self.name, inputs, outputs)
        return outputs

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Call ``fn`` once per size with zeros, when the input specs allow building them."""
        warmup_with_zeros(self, batch_sizes)

    def __repr__(self) -> str:
        return f"PythonRuntime(name={self.name!r}, inputs={self.input_names}, outputs={self.output_names})"


class CostModel:
    """Expected duration of a model call, ``fixed_ns + per_row_ns * rows``, learnt by EWMA.

    Keeps exponentially weighted means of rows, duration, rows^2 and rows*duration and fits the
    line through them; with one batch size seen so far the cost is taken as proportional.

    >>> m = CostModel()
    >>> m.observe(10, 2_000); m.observe(100, 11_000); m.expected_ns(0) > 0
    True
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._seen = False
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, duration_ns: int) -> None:
        """Fold in one observed call of ``rows`` rows that took ``duration_ns``."""
        x, y = float(rows), float(duration_ns)
        a = self.alpha if self._seen else 1.0
        self._seen = True
        self._x += a * (x - self._x)
        self._y += a * (y - self._y)
        self._xx += a * (x * x - self._xx)
        self._xy += a * (x * y - self._xy)

    @property
    def per_row_ns(self) -> float:
        return self._fit()[1]

    @property
    def fixed_ns(self) -> float:
        return self._fit()[0]

    def expected_ns(self, rows: int) -> int:
        """Expected duration of a call on ``rows`` rows (0 before any observation)."""
        fixed, per_row = self._fit()
        return int(fixed + per_row * rows)

    def _fit(self) -> tuple[float, float]:
        if self._x <= 0.0:
            return max(self._y, 0.0), 0.0
        var = self._xx - self._x * self._x
        if var > 1e-9 * self._x * self._x:
            slope = (self._xy - self._x * self._y) / var
            fixed = self._y - slope * self._x
            if slope >= 0.0 and fixed >= 0.0:
                return fixed, slope
            if slope < 0.0:
                return max(self._y, 0.0), 0.0
        return 0.0, max(self._y, 0.0) / self._x


def warmup_with_zeros(runtime: Runtime, batch_sizes: Sequence[int]) -> None:
    """One all-zeros batch per size, from the input specs; nothing when a spec is missing."""
    for size in dict.fromkeys(batch_sizes):
        if any(n not in runtime.input_specs for n in runtime.input_names):
            return
        dummy = {n: runtime.input_specs[n].zeros(size) for n in runtime.input_names}
        if any(v is None for v in dummy.values()):
            return
        runtime.run({n: v for n, v in dummy.items() if v is not None})


class Reshaped:
    """``runtime`` fed from flat rows: each input named in ``shapes`` comes as ``[rows, size]``
    (a fixed-size-list column, as ``ImagePreprocess`` makes its tensors) and is reshaped to
    ``[rows, *shape]`` before the call, so an image model with dynamic dimensions (``[N, 3, ?,
    ?]``) can be an infer step's model; an output of more than two dimensions (a mask, a feature
    map) comes back flattened per row, ``[rows, size]``, as a column holds it.

    >>> rt = PythonRuntime(lambda xs: {"s": xs["x"].sum(axis=(2, 3))[:, :1]}, input_names=["x"],
    ...                    output_names=["s"], name="m")
    >>> Reshaped(rt, {"x": (2, 2, 2)}).run({"x": np.ones((3, 8), dtype=np.float32)})["s"].tolist()
    [[4.0], [4.0], [4.0]]
    """

    def __init__(self, runtime: Runtime, shapes: Mapping[str, tuple[int, ...]]) -> None:
        unknown = sorted(set(shapes) - set(runtime.input_names))
        if unknown:
            raise ModelError(f"model {runtime.name!r} has no inputs {unknown}: {runtime.input_names}")
        self._runtime, self._shapes = runtime, dict(shapes)
        self.name, self.input_names, self.output_names = (
            runtime.name,
            runtime.input_names,
            runtime.output_names,
        )
        specs = dict(runtime.input_specs)
        for name, shape in self._shapes.items():
            specs[name] = TensorSpec(specs.get(name, TensorSpec()).dtype, (None, int(np.prod(shape))))
        self.input_specs: Mapping[str, TensorSpec] = specs

    @property
    def version(self) -> str:
        return self._runtime.version

    @property
    def weights_sha256(self) -> str:
        return str(getattr(self._runtime, "weights_sha256", ""))

    @property
    def provider(self) -> str:
        return self._runtime.provider

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        shaped = {
            n: a.reshape(a.shape[0], *self._shapes[n]) if n in self._shapes else a for n, a in inputs.items()
        }
        out = self._runtime.run(shaped)
        return {n: a.reshape(a.shape[0], -1) if a.ndim > 2 else a for n, a in out.items()}

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        warmup_with_zeros(self, batch_sizes)

    def __repr__(self) -> str:
        return f"Reshaped({self._runtime!r}, {self._shapes})"
