"""The infer step's config and the glue between batch columns and model tensors.

``InferSpec`` says which columns feed which model inputs and which outputs become which new
columns; ``build_io`` turns it into the ``prepare``/``finish`` pair a ``DynamicBatcher`` calls
once per batch (whole columns, no per-row work).

>>> from aisp.infer.runtimes.base import PythonRuntime
>>> rt = PythonRuntime(lambda xs: {"y": xs["x"] * 2}, input_names=["x"], output_names=["y"], name="m")
>>> prepare, finish = build_io(InferSpec(runtime=rt, inputs={"x": "a"}, outputs={"y": "b"}))
>>> b = Batch.from_columns({"a": [1.0, 2.0]})
>>> finish(b, rt.run(prepare(b))).numpy("b").tolist()
[2.0, 4.0]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch, matrix_column, padded
from aisp.errors import ConfigError, ModelError
from aisp.infer.batching.batcher import (
    BatcherConfig,
    DeadLetter,
    DynamicBatcher,
    Emit,
    Finish,
    OnBatch,
    Prepare,
)
from aisp.infer.runtimes.base import Runtime, TensorSpec
from aisp.observe.drift import DriftConfig

__all__ = ["InferSpec", "build_batcher", "build_io"]


@dataclass(frozen=True, kw_only=True)
class InferSpec:
    """What an infer step runs and how its columns map to the model.

    Args:
        runtime: the model.
        inputs: model input name -> batch column (a 2-D fixed-size-list or 1-D numeric column).
        outputs: model output name -> new column; an ``[N, 1]`` output becomes a 1-D column,
            ``[N, k]`` a fixed-size-list column.
        batcher: the batching policy.
        tag_model: add ``model`` and ``model_version`` columns: the name and version of the
            model that computed each row (they differ across a hot swap).
        drift: watch the input features for drift (``DriftConfig``).

    Raises:
        ConfigError: an input is unmapped, or a name is not one the model has.
    """

    runtime: Runtime
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    tag_model: bool = True
    drift: DriftConfig | None = None
    """Monitor the input features for drift (PSI, KS) and alert (see ``aisp.observe.drift``)."""
    on_failed: Callable[[int], None] | None = None
    """Called with the number of rows the step dead-letters (a failed model call, rows past
    their deadline) before they go: a rollout counts them as its model's errors."""

    def __post_init__(self) -> None:
        model = self.runtime.name
        wanted = set(self.runtime.input_names)
        if set(self.inputs) != wanted:
            raise ConfigError(
                f"inputs must map every input of model {model!r} {sorted(wanted)}, got {sorted(self.inputs)}"
            )
        unknown = sorted(set(self.outputs) - set(self.runtime.output_names))
        if not self.outputs or unknown:
            raise ConfigError(
                f"outputs must name outputs of model {model!r} {list(self.runtime.output_names)},"
                f" got {sorted(self.outputs)}"
            )
        if len(set(self.outputs.values())) != len(self.outputs):
            raise ConfigError(f"output columns must be distinct, got {list(self.outputs.values())}")


def _input_fn(name: str, column: str, spec: TensorSpec) -> Callable[[Batch], npt.NDArray[Any]]:
    """A function reading ``column`` as the array model input ``name`` wants (dtype, rank)."""
    dtype = spec.dtype
    rank = None if spec.shape is None else len(spec.shape)

    def read(batch: Batch) -> npt.NDArray[Any]:
        col = batch.column(column)
        if rank == 2 and isinstance(col, pa.ListArray | pa.LargeListArray):  # ragged: token ids
            arr = padded(col)
        else:
            arr = batch.numpy(column)
        if dtype is not None and arr.dtype != dtype:
            arr = arr.astype(dtype)
        if rank is not None and arr.ndim != rank:
            if rank == 2 and arr.ndim == 1:
                arr = arr.reshape(-1, 1)
            elif rank == 1 and arr.ndim == 2 and arr.shape[1] == 1:
                arr = arr.reshape(-1)
            else:
                raise ModelError(f"column {column!r} has shape {arr.shape}; input {name!r} wants rank {rank}")
        return np.ascontiguousarray(arr)

    return read


def _to_column(name: str, arr: npt.NDArray[Any]) -> pa.Array:
    """An output array as a column: ``[N]`` and ``[N, 1]`` 1-D, ``[N, k]`` fixed-size list."""
    if arr.ndim == 1:
        return pa.array(arr)
    if arr.ndim == 2:
        if arr.shape[1] == 1:
            return pa.array(np.ascontiguousarray(arr).reshape(-1))
        return matrix_column(arr)
    raise ModelError(f"output {name!r} has shape {arr.shape}; expected [N] or [N, k]")


def build_io(spec: InferSpec) -> tuple[Prepare, Finish]:
    """The ``prepare`` and ``finish`` callables a ``DynamicBatcher`` needs for ``spec``."""
    readers = {
        name: _input_fn(name, column, spec.runtime.input_specs.get(name, TensorSpec()))
        for name, column in spec.inputs.items()
    }
    outputs = dict(spec.outputs)

    def prepare(batch: Batch) -> dict[str, npt.NDArray[Any]]:
        return {name: read(batch) for name, read in readers.items()}

    def finish(
        batch: Batch, results: Mapping[str, npt.NDArray[Any]], runtime: Runtime = spec.runtime
    ) -> Batch:
        cols: dict[str, Any] = {col: _to_column(out, results[out]) for out, col in outputs.items()}
        if spec.tag_model:
            n = batch.num_rows
            cols["model"] = pa.repeat(pa.scalar(runtime.name, pa.string()), n)
            cols["model_version"] = pa.repeat(pa.scalar(str(runtime.version), pa.string()), n)
        return batch.with_columns(cols)

    return prepare, finish


def build_batcher(
    spec: InferSpec,
    *,
    emit: Emit,
    dead_letter: DeadLetter,
    clock: Callable[[], int] = time.monotonic_ns,
    on_batch: OnBatch | None = None,
) -> DynamicBatcher:
    """A (not yet started) ``DynamicBatcher`` running ``spec``."""
    prepare, finish = build_io(spec)
    if spec.on_failed is not None:
        failed, to_dead_letter = spec.on_failed, dead_letter

        def dead_letter(batch: Batch, reason: str) -> None:
            failed(batch.num_rows)
            to_dead_letter(batch, reason)

    return DynamicBatcher(
        spec.runtime,
        spec.batcher,
        prepare=prepare,
        finish=finish,
        emit=emit,
        dead_letter=dead_letter,
        clock=clock,
        on_batch=on_batch,
    )
