"""``aisp.serve.oip.tensors``: many requests' tensors as one batch and back.

Checks that ``request_batch`` / ``tensor_batch`` keep every datatype's values, shapes and order
(1-D, 2-D and larger tensors, per-row shapes in the schema's metadata, read back by
``row_shapes`` / ``reshaped``), that the ``REQ`` / ``ROW`` / tier / deadline columns tag each row
with its request, that ``shape_groups`` keeps requests of other per-row shapes apart in arrival
order, and the small helpers ``has_empty`` and ``empty_output``.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import DEADLINE_NS, TIER, Batch
from aisp.infer.models.versions import ServedModel
from aisp.serve.oip.request import DATATYPES, TensorSignature
from aisp.serve.oip.tensors import (
    REQ,
    ROW,
    Gathered,
    empty_output,
    has_empty,
    request_batch,
    request_batches,
    reshaped,
    row_shapes,
    shape_groups,
    tensor_batch,
)
from tests.support.oip_tensors import DATATYPE_NAMES, array_of, values_of


class FakeModel:
    """What the batching functions read of a ``ServedModel``: its input names, in order."""

    def __init__(self, *names: str) -> None:
        self.input_names = names


def model(*names: str) -> ServedModel:
    return cast(ServedModel, FakeModel(*names))


def gathered(req: int, rows: int, tier: int = 0, deadline_ns: int | None = None, **inputs: Any) -> Gathered:
    return Gathered(req, inputs, rows, tier, deadline_ns, 0)


def read_back(batch: Batch, name: str) -> npt.NDArray[Any]:
    """A column as the model sees it: flattened rows reshaped to the per-row shape."""
    return reshaped(batch.numpy(name), row_shapes(batch).get(name))


def assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tolist() == want.tolist()
    if want.dtype != object:
        assert got.tobytes() == want.tobytes()  # bit for bit (-0.0 stays -0.0)


# -- has_empty, empty_output -----------------------------------------------------------------------
def test_has_empty_is_true_only_when_some_tensor_has_no_elements() -> None:
    assert has_empty({}) is False
    assert has_empty({"a": np.zeros((2, 3)), "b": np.zeros(1)}) is False
    assert has_empty({"a": np.zeros((2, 3)), "b": np.zeros((2, 0))}) is True
    assert has_empty({"a": np.zeros((0,))}) is True
    assert has_empty({"a": np.zeros(())}) is False  # a scalar has one element


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_empty_output_has_zero_rows_and_zero_for_a_variable_dim(datatype: str) -> None:
    out = empty_output(TensorSignature("y", datatype, (-1, 3)))
    assert out.shape == (0, 0, 3)
    assert out.dtype == DATATYPES[datatype]
    assert empty_output(TensorSignature("y", datatype, ())).shape == (0,)


# -- tensor_batch, row_shapes, reshaped -----------------------------------------------------------
def test_tensor_batch_column_kinds_and_row_shape_metadata() -> None:
    one = np.arange(3, dtype=np.int64)
    two = np.arange(6, dtype=np.float32).reshape(3, 2)
    three = np.arange(24, dtype=np.int16).reshape(3, 2, 4)
    arrow = pa.array([7, 8, 9], type=pa.int32())
    batch = tensor_batch([("one", one), ("two", two), ("three", three), ("arrow", arrow)])
    assert batch.column_names == ["one", "two", "three", "arrow"]
    assert batch.schema.field("one").type == pa.int64()
    assert batch.schema.field("two").type == pa.list_(pa.float32(), 2)
    assert batch.schema.field("three").type == pa.list_(pa.int16(), 8)
    assert batch.schema.field("arrow").type == pa.int32()
    assert batch.column("arrow").equals(arrow)  # an Arrow column is taken as it is
    assert row_shapes(batch) == {"three": (2, 4)}
    assert batch.schema.metadata == {b"aisp.row_shapes": b'{"three":[2,4]}'}
    assert_same(read_back(batch, "three"), three)
    assert_same(read_back(batch, "two"), two)
    assert_same(read_back(batch, "one"), one)


def test_row_shapes_is_empty_without_larger_tensors_and_reshaped_none_is_identity() -> None:
    batch = tensor_batch([("a", np.zeros((2, 5), np.float64))])
    assert batch.schema.metadata is None
    assert row_shapes(batch) == {}
    arr = np.arange(4)
    assert reshaped(arr, None) is arr
    flat = np.arange(12).reshape(2, 6)  # two rows, each flattened
    assert reshaped(flat, (2, 3)).tolist() == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]


def test_batches_of_other_row_shapes_have_other_schemas() -> None:
    a = tensor_batch([("x", np.zeros((2, 2, 3), np.float32))])
    b = tensor_batch([("x", np.zeros((2, 3, 2), np.float32))])  # same width (6), other shape
    assert a.schema.field("x").type == b.schema.field("x").type
    assert not a.schema.equals(b.schema, check_metadata=True)
    assert row_shapes(a) == {"x": (2, 3)} and row_shapes(b) == {"x": (3, 2)}


# -- request_batch ------------------------------------------------------------------------------------
def test_request_batch_tags_rows_with_request_row_and_tier() -> None:
    items = [
        gathered(11, 2, tier=1, x=np.array([[1, 2], [3, 4]], np.int32)),
        gathered(12, 1, tier=3, x=np.array([[5, 6]], np.int32)),
        gathered(13, 3, tier=0, x=np.array([[7, 8], [9, 10], [11, 12]], np.int32)),
    ]
    batch = request_batch(model("x"), items)
    assert batch.column_names == ["x", REQ, ROW, TIER]  # no deadline column: none has a deadline
    assert batch.numpy("x").tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert batch.numpy(REQ).tolist() == [11, 11, 12, 13, 13, 13]
    assert batch.numpy(ROW).tolist() == [0, 1, 0, 0, 1, 2]
    assert batch.numpy(TIER).tolist() == [1, 1, 3, 0, 0, 0]
    assert batch.schema.field(TIER).type == pa.int8()
    assert batch.schema.field(REQ).type == pa.int64()


def test_request_batch_of_single_rows_numbers_every_row_zero() -> None:
    items = [gathered(r, 1, x=np.array([float(r)], np.float64)) for r in (4, 5, 6)]
    batch = request_batch(model("x"), items)
    assert batch.numpy(ROW).tolist() == [0, 0, 0]
    assert batch.numpy(REQ).tolist() == [4, 5, 6]
    assert batch.numpy("x").tolist() == [4.0, 5.0, 6.0]


def test_request_batch_adds_deadlines_when_any_request_has_one() -> None:
    items = [
        gathered(1, 2, deadline_ns=None, x=np.zeros(2, np.int8)),
        gathered(2, 1, deadline_ns=5_000, x=np.zeros(1, np.int8)),
    ]
    batch = request_batch(model("x"), items)
    assert batch.column_names[-1] == DEADLINE_NS
    assert batch.numpy(DEADLINE_NS).tolist() == [0, 0, 5_000]  # none: 0


def test_request_batch_keeps_the_models_input_order_and_every_input() -> None:
    items = [
        gathered(1, 1, b=np.array([[1.5]], np.float32), a=np.array(["x"], dtype=object)),
        gathered(2, 2, a=np.array(["y", "zz"], dtype=object), b=np.array([[2.5], [3.5]], np.float32)),
    ]
    batch = request_batch(model("a", "b"), items)
    assert batch.column_names[:2] == ["a", "b"]
    assert batch.numpy("a").tolist() == ["x", "y", "zz"]
    assert batch.numpy("b").tolist() == [[1.5], [2.5], [3.5]]


@st.composite
def requests_of_one_row_shape(draw: st.DrawFn) -> tuple[str, tuple[int, ...], list[Gathered]]:
    datatype = draw(st.sampled_from(DATATYPE_NAMES))
    row_shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    per_row = int(np.prod(row_shape))
    items = []
    for req in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 4))
        values = draw(st.lists(values_of(datatype), min_size=rows * per_row, max_size=rows * per_row))
        tier = draw(st.integers(0, 5))
        deadline = draw(st.none() | st.integers(1, 2**40))
        items.append(
            gathered(100 + req, rows, tier, deadline, x=array_of(datatype, values, (rows, *row_shape)))
        )
    return datatype, row_shape, items


@settings(max_examples=120, deadline=None)
@given(requests_of_one_row_shape())
def test_request_batch_round_trips_every_datatype_and_shape(
    case: tuple[str, tuple[int, ...], list[Gathered]],
) -> None:
    datatype, row_shape, items = case
    [batch] = request_batches(model("x"), items)
    want = np.concatenate([it.inputs["x"] for it in items])
    got = read_back(batch, "x")
    assert_same(got, want)
    assert row_shapes(batch) == ({"x": row_shape} if len(row_shape) > 1 else {})
    assert batch.numpy(REQ).tolist() == [it.req for it in items for _ in range(it.rows)]
    assert batch.numpy(ROW).tolist() == [k for it in items for k in range(it.rows)]
    assert batch.numpy(TIER).tolist() == [it.tier for it in items for _ in range(it.rows)]
    if any(it.deadline_ns is not None for it in items):
        want_deadlines = [it.deadline_ns or 0 for it in items for _ in range(it.rows)]
        assert batch.numpy(DEADLINE_NS).tolist() == want_deadlines
    else:
        assert DEADLINE_NS not in batch


# -- shape_groups, request_batches -------------------------------------------------------------------
def test_shape_groups_of_none_and_of_one() -> None:
    assert shape_groups(model("x"), []) == []
    one = gathered(1, 1, x=np.zeros((1, 3)))
    assert shape_groups(model("x"), [one]) == [[one]]
    assert request_batches(model("x"), []) == []


def test_shape_groups_keeps_one_group_when_row_shapes_agree() -> None:
    items = [gathered(r, r, x=np.zeros((r, 3, 2))) for r in (1, 2, 3)]  # other row counts, same rows
    assert shape_groups(model("x"), items) == [items]


def test_shape_groups_parts_other_row_shapes_in_order_of_arrival() -> None:
    a1, b1, a2, c1, b2 = (
        gathered(1, 1, x=np.zeros((1, 3))),
        gathered(2, 1, x=np.zeros((1, 4))),
        gathered(3, 2, x=np.zeros((2, 3))),
        gathered(4, 1, x=np.zeros((1, 2, 2))),
        gathered(5, 1, x=np.zeros((1, 4))),
    )
    groups = shape_groups(model("x"), [a1, b1, a2, c1, b2])
    assert [[it.req for it in g] for g in groups] == [[1, 3], [2, 5], [4]]


def test_shape_groups_of_several_inputs_key_on_every_input() -> None:
    items = [
        gathered(1, 1, a=np.zeros((1, 2)), b=np.zeros((1, 5))),
        gathered(2, 1, a=np.zeros((1, 2)), b=np.zeros((1, 6))),  # b differs
        gathered(3, 1, a=np.zeros((1, 2)), b=np.zeros((1, 5))),
    ]
    groups = shape_groups(model("a", "b"), items)
    assert [[it.req for it in g] for g in groups] == [[1, 3], [2]]


def test_request_batches_gives_one_batch_per_row_shape() -> None:
    items = [
        gathered(1, 1, x=np.full((1, 2, 2), 1, np.int32)),
        gathered(2, 1, x=np.full((1, 4), 2, np.int32)),
        gathered(3, 2, x=np.full((2, 2, 2), 3, np.int32)),
    ]
    batches = request_batches(model("x"), items)
    assert len(batches) == 2
    assert batches[0].numpy(REQ).tolist() == [1, 3, 3]
    assert read_back(batches[0], "x").tolist() == [[[1, 1], [1, 1]], [[3, 3], [3, 3]], [[3, 3], [3, 3]]]
    assert batches[1].numpy(REQ).tolist() == [2]
    assert read_back(batches[1], "x").tolist() == [[2, 2, 2, 2]]
