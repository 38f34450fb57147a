from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from aisp.batch import ID, INGEST_NS, Batch, matrix_column
from aisp.errors import ConfigError


def make(n: int = 5) -> Batch:
    return Batch.from_columns(
        {"x": np.arange(n, dtype=np.int64), "m": np.arange(n * 3, dtype=np.float32).reshape(n, 3)},
        ingest_ns=7,
    )


def test_meta_columns_added() -> None:
    b = make()
    assert b.numpy(ID).tolist() == [0, 1, 2, 3, 4]
    assert b.numpy(INGEST_NS).tolist() == [7] * 5
    assert b.meta("_tier").tolist() == [0] * 5


def test_numeric_columns_are_zero_copy() -> None:
    b = make()
    x = b.numpy("x")
    assert x.ctypes.data == b.column("x").buffers()[1].address
    m = b.numpy("m")
    assert m.shape == (5, 3) and m.dtype == np.float32
    assert m[2].tolist() == [6.0, 7.0, 8.0]


def test_slice_concat_filter_take() -> None:
    b = make(6)
    assert b.slice(4).numpy("m").tolist() == [[12, 13, 14], [15, 16, 17]]
    c = Batch.concat([b.slice(0, 2), b.slice(4)])
    assert c.numpy("x").tolist() == [0, 1, 4, 5]
    assert c.numpy("m")[3].tolist() == [15, 16, 17]
    assert b.filter(b.numpy("x") % 2 == 0).numpy("x").tolist() == [0, 2, 4]
    assert b.take([5, 0]).numpy("x").tolist() == [5, 0]


def test_with_columns_replaces_and_adds() -> None:
    b = make(3).with_columns({"x": np.array([9, 9, 9]), "y": pa.array(["a", "b", "c"])})
    assert b.numpy("x").tolist() == [9, 9, 9]
    assert b.pylist("y") == ["a", "b", "c"]


def test_unknown_column_error_lists_columns() -> None:
    with pytest.raises(KeyError, match="no column 'zz'"):
        make().column("zz")


def test_matrix_column_needs_2d() -> None:
    with pytest.raises(ConfigError, match="2-D"):
        matrix_column(np.zeros(3))


def test_list_columns_of_equal_lengths_come_back_2d_and_ragged_ones_stay_objects() -> None:
    even = Batch.from_columns({"v": pa.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])})
    assert even.slice(1).numpy("v").tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    ragged = Batch.from_columns({"v": pa.array([[1.0], [2.0, 3.0]])})
    assert ragged.numpy("v").dtype == object
