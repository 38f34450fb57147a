"""Tensors of many requests as one batch for a model's batcher, and back.

Each request's arrays (batch dimension first) become rows; ``REQ`` and ``ROW`` columns tag each
row with its request and its row within it. 1-D and 2-D tensors are plain and fixed-size-list
columns; larger ones are flattened per row with their per-row shape in the schema's metadata,
which also keeps batches of different shapes apart in the batch queue (it compares schemas with
their metadata). Requests whose per-row shapes differ (a variable dimension) never share a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import DEADLINE_NS, TIER, Batch, matrix_column
from aisp.infer.models.versions import ServedModel
from aisp.serve.oip.request import DATATYPES, TensorSignature

__all__ = [
    "REQ",
    "ROW",
    "Gathered",
    "empty_output",
    "has_empty",
    "request_batch",
    "request_batches",
    "reshaped",
    "row_shapes",
    "shape_groups",
    "tensor_batch",
]

REQ = "_req"
ROW = "_row"
_SHAPES = b"aisp.row_shapes"


class Gathered(msgspec.Struct):
    """One request waiting to be batched: its id, arrays, rows, tier, deadline, how long it
    may wait for room in a full queue (monotonic ns) and what its caller waits on."""

    req: int
    inputs: Mapping[str, npt.NDArray[Any]]
    rows: int
    tier: int
    deadline_ns: int | None
    admit_until_ns: int
    pending: Any = None  # the server's Pending


def has_empty(inputs: Mapping[str, npt.NDArray[Any]]) -> bool:
    """Whether a tensor has no elements (a batch cannot hold it: it is computed alone)."""
    for a in inputs.values():  # noqa: SIM110 - a generator costs more than the check, per request
        if a.size == 0:
            return True
    return False


def empty_output(t: TensorSignature) -> npt.NDArray[Any]:
    """Output ``t`` for zero rows (a variable dimension is 0)."""
    return np.empty((0, *(max(d, 0) for d in t.dims)), dtype=DATATYPES[t.datatype])


def request_batches(model: ServedModel, gathered: Sequence[Gathered]) -> list[Batch]:
    """Batches of the rows of requests ``gathered``, tagged with request id and row number: one
    batch per per-row input shape (requests with other shapes of a variable dim never share a
    model call)."""
    return [request_batch(model, items) for items in shape_groups(model, gathered)]


def shape_groups(model: ServedModel, gathered: Sequence[Gathered]) -> list[list[Gathered]]:
    """``gathered`` by per-row input shape, in order of arrival within each group."""
    if len(gathered) <= 1:
        return [list(gathered)] if gathered else []
    names = model.input_names
    if len(names) == 1:  # the usual model: one input, keyed by its row shape alone
        [name] = names
        first = gathered[0].inputs[name].shape[1:]
        for it in gathered:
            if it.inputs[name].shape[1:] != first:
                break
        else:
            return [list(gathered)]
    groups: dict[tuple[tuple[int, ...], ...], list[Gathered]] = {}
    for it in gathered:
        key = tuple(tuple(it.inputs[k].shape[1:]) for k in names)
        groups.setdefault(key, []).append(it)
    return list(groups.values())


def request_batch(model: ServedModel, gathered: Sequence[Gathered]) -> Batch:
    """One batch of the rows of ``gathered`` (requests of one per-row shape)."""
    ns = np.fromiter((it.rows for it in gathered), dtype=np.int64, count=len(gathered))
    named: list[tuple[str, Any]] = []
    for k in model.input_names:
        parts = [it.inputs[k] for it in gathered]
        named.append((k, parts[0] if len(parts) == 1 else np.concatenate(parts)))
    reqs = np.fromiter((it.req for it in gathered), dtype=np.int64, count=len(gathered))
    total = int(ns.sum())
    if total == len(gathered):
        row = np.zeros(total, dtype=np.int64)
    else:
        row = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(ns) - ns, ns)
    tiers = np.fromiter((it.tier for it in gathered), dtype=np.int8, count=len(gathered))
    named += [(REQ, np.repeat(reqs, ns)), (ROW, row), (TIER, np.repeat(tiers, ns))]
    if any(it.deadline_ns is not None for it in gathered):
        d = np.fromiter((it.deadline_ns or 0 for it in gathered), dtype=np.int64, count=len(gathered))
        named.append((DEADLINE_NS, np.repeat(d, ns)))
    return tensor_batch(named)


def tensor_batch(named: Sequence[tuple[str, Any]]) -> Batch:
    """A batch of tensors whose first dimension is the row: 1-D and 2-D ones as plain and
    fixed-size-list columns, larger ones flattened per row with their per-row shape in the
    schema's metadata (``_row_shapes``), which also keeps batches of other shapes apart."""
    arrays, names, shapes = [], [], {}
    for name, arr in named:
        if isinstance(arr, pa.Array):
            arrays.append(arr)
        elif arr.ndim == 1:
            arrays.append(pa.array(arr))
        else:
            arrays.append(matrix_column(arr.reshape(arr.shape[0], -1)))
            if arr.ndim > 2:
                shapes[name] = arr.shape[1:]
        names.append(name)
    rb = pa.RecordBatch.from_arrays(arrays, names=names)
    if shapes:
        rb = rb.replace_schema_metadata({_SHAPES: msgspec.json.encode(shapes)})
    return Batch(rb)


def row_shapes(batch: Batch) -> dict[str, tuple[int, ...]]:
    meta = batch.schema.metadata
    if not meta or _SHAPES not in meta:
        return {}
    return {k: tuple(v) for k, v in msgspec.json.decode(meta[_SHAPES]).items()}


def reshaped(arr: npt.NDArray[Any], row_shape: tuple[int, ...] | None) -> npt.NDArray[Any]:
    return arr if row_shape is None else arr.reshape((arr.shape[0], *row_shape))
