"""The embedding router against a row-by-row reference: each row to the branch with its most
similar example, or to the fallback under the threshold; the decision and score on the row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.transform.text.router import EmbeddingRouter


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.normal(size=(n, 6)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31), st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 30),
       st.floats(-0.5, 0.9))  # fmt: skip
def test_each_row_goes_where_a_row_by_row_reference_sends_it(
    seed: int, per_branch: list[int], rows: int, threshold: float
) -> None:
    rng = np.random.default_rng(seed)
    examples = {f"b{i}": unit(rng, n) for i, n in enumerate(per_branch)}
    router = EmbeddingRouter(examples, threshold=threshold, fallback="other")
    vectors = unit(rng, rows)
    out = router(Batch.from_columns({"embedding": vectors}))
    for v, route, score in zip(
        vectors, out.column("route").to_pylist(), out.numpy("route_score"), strict=True
    ):
        scores = {b: float((e @ v).max()) for b, e in examples.items()}
        best = max(scores, key=lambda b: scores[b])
        assert score == pytest.approx(scores[best], abs=1e-5)
        assert (
            route == (best if scores[best] >= threshold else "other") or abs(scores[best] - threshold) < 1e-5
        )


def test_a_router_that_cannot_work_fails_where_declared() -> None:
    with pytest.raises(ConfigError, match="at least one branch"):
        EmbeddingRouter({})
    with pytest.raises(ConfigError, match="fallback"):
        EmbeddingRouter({"other": np.ones((1, 3))})
    with pytest.raises(ConfigError, match="one dimension"):
        EmbeddingRouter({"a": np.ones((1, 3)), "b": np.ones((1, 4))})
