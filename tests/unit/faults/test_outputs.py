"""Judging a chaos run's output: by composite keys, floats within rounding, dead letters that
account for an output and those that never were one."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from aisp.faults.outputs import compare, without_dead_letters


@given(st.lists(st.integers(0, 50), min_size=1, max_size=30, unique=True), st.randoms(use_true_random=False))
def test_outputs_are_compared_by_composite_keys_and_floats_within_rounding(
    ids: list[int], rnd: object
) -> None:
    ref = [json.dumps({"user": f"u{i % 3}", "w": i, "sum": i * 0.1 + 0.2}).encode() for i in ids]
    out = list(ref)
    rnd.shuffle(out)  # type: ignore[attr-defined]
    assert compare(ref, out, "user,w") == (0, 0, 0)
    row = json.loads(out[0])
    row["sum"] += row["sum"] * 1e-13  # rounding of a sum cut into other batches: the same
    assert compare(ref, [json.dumps(row).encode(), *out[1:]], "user,w") == (0, 0, 0)
    row["sum"] += 0.01  # a state feature that differs
    assert compare(ref, [json.dumps(row).encode(), *out], "user,w") == (0, 1, 1)
    assert compare(ref, out[1:], "user,w") == (1, 0, 0)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=20, unique=True), st.data())
def test_dead_letters_account_for_the_outputs_they_name_and_no_other(
    ids: list[int], data: st.DataObject
) -> None:
    ref = [json.dumps({"id": i, "user": f"u{i % 4}", "w": i // 4}).encode() for i in ids]
    dead_ids = data.draw(st.sets(st.sampled_from(ids)))
    scored = [
        json.dumps({"row": {"id": i, "amount": 1.0}, "reason": "model failed"}).encode() for i in dead_ids
    ]
    assert without_dead_letters(ref, scored, "id") == [x for x in ref if json.loads(x)["id"] not in dead_ids]
    # an output named by (user, w): a dead input event (a late one) names no window
    late = [
        json.dumps({"row": {"id": i, "user": f"u{i % 4}", "ts": 5}, "reason": "late"}).encode() for i in ids
    ]
    assert without_dead_letters(ref, [*late, b"not json with no row field"], "user,w") == ref
    windows = [json.dumps({"row": {"user": "u1", "w": 0}, "reason": "sink refused"}).encode()]
    kept = without_dead_letters(ref, windows, "user,w")
    assert kept == [x for x in ref if (json.loads(x)["user"], json.loads(x)["w"]) != ("u1", 0)]
