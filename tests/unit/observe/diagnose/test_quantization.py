"""Quantized tier variants judged slower only when they are, whatever their costs' shape."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.observe.diagnose.quantization import ModelPoint, slower_variants

costs = st.tuples(st.floats(0.0, 5e-3), st.floats(1e-8, 1e-4))  # a call's fixed cost, a row's
sizes = st.integers(1, 4096)


def point(stage: str, precision: str, cost: tuple[float, float], rows: int) -> ModelPoint:
    fixed, per_row = cost
    return ModelPoint(stage, precision, float(rows), fixed + per_row * rows, 100.0)


@settings(max_examples=500, deadline=None)
@given(costs, costs, sizes, sizes)
def test_a_variant_judged_slower_is_slower_at_its_own_batch_size(
    q_cost: tuple[float, float], f_cost: tuple[float, float], q_rows: int, f_rows: int
) -> None:
    """Soundness for any cost a + b * rows: had the FP32 model run the variant's batches, it
    would have taken no longer. And at equal batch sizes the verdict is exact."""
    q, f = point("score.tier0", "int8", q_cost, q_rows), point("score.default", "fp32", f_cost, f_rows)
    found = slower_variants([q, f])
    fp32_at_q_rows = f_cost[0] + f_cost[1] * q_rows
    if found:
        ((variant, sibling, ev),) = found
        assert (variant.stage, sibling.stage) == ("score.tier0", "score.default")
        assert q.call_s >= fp32_at_q_rows * (1 - 1e-9)
        assert ev["variant_precision"] == "int8"
    if q_rows == f_rows:
        assert bool(found) == (q.call_s >= f.call_s)


def test_only_quantized_variants_of_one_tiered_step_are_compared() -> None:
    slow, fast = (1e-3, 1e-5), (1e-4, 1e-6)
    assert slower_variants([point("a.tier0", "fp32", slow, 64), point("a.default", "fp32", fast, 64)]) == []
    assert slower_variants([point("a.tier0", "int8", slow, 64), point("b.default", "fp32", fast, 64)]) == []
    assert slower_variants([point("score", "int8", slow, 64), point("other", "fp32", fast, 64)]) == []
    assert slower_variants([point("a.tier0", "fp16", fast, 64), point("a.default", "fp32", slow, 64)]) == []
    (found,) = slower_variants([point("a.tier2", "fp16", slow, 64), point("a.default", "fp32", fast, 64)])
    assert found[0].stage == "a.tier2"
