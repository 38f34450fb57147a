"""Hypothesis strategies for OIP tensors, shared by the codec and tensor tests: values of every
datatype, arrays of them, and their raw bytes as the binary forms carry them."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from aisp.serve.oip.request import DATATYPES, encode_bytes

DATATYPE_NAMES = sorted(DATATYPES)


def values_of(datatype: str) -> st.SearchStrategy[Any]:
    """Any value a tensor of ``datatype`` holds (finite floats: NaN never equals itself)."""
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=6)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return st.integers(int(info.min), int(info.max))
    return st.floats(width=8 * dtype.itemsize, allow_nan=False, allow_infinity=False)  # type: ignore[arg-type]


def array_of(datatype: str, values: list[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    if datatype == "BYTES":
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out.reshape(shape)
    return np.array(values, dtype=DATATYPES[datatype]).reshape(shape)


@st.composite
def tensors(
    draw: st.DrawFn, names: list[str] | None = None, min_dims: int = 0
) -> tuple[str, npt.NDArray[Any]]:
    """A datatype of ``names`` (default: every one) and an array of it: at most 125 elements,
    sides from 0."""
    datatype = draw(st.sampled_from(names or DATATYPE_NAMES))
    shape = draw(array_shapes(min_dims=min_dims, max_dims=3, min_side=0, max_side=5))
    n = int(np.prod(shape))
    return datatype, array_of(datatype, draw(st.lists(values_of(datatype), min_size=n, max_size=n)), shape)


def raw_of(datatype: str, arr: npt.NDArray[Any]) -> bytes:
    """``arr`` as the binary forms carry it."""
    return encode_bytes(arr) if datatype == "BYTES" else np.ascontiguousarray(arr).tobytes()
