"""QoS tiers in the batcher: ordering, per-tier timeouts, shedding the lowest tier first."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import TIER, Batch
from aisp.errors import ConfigError
from aisp.infer import BatcherConfig, BatchQueue, DynamicBatcher, PythonRuntime

MS = 1_000_000


def rows(ids: list[int], tiers: list[int]) -> Batch:
    return Batch.from_columns(
        {"x": np.zeros((len(ids), 1), dtype=np.float32), TIER: np.array(tiers, dtype=np.int8)},
        ids=np.array(ids, dtype=np.int64),
        ingest_ns=0,
    )


def test_higher_tiers_are_served_first() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=3))
    q.push(rows([1, 2], [0, 0]), now_ns=0)
    q.push(rows([3, 4], [2, 1]), now_ns=1)
    b = q.pop_ready(now_ns=2, idle=True)
    assert b is not None and b.ids.tolist() == [3, 4, 1]


def test_rows_without_a_tier_get_the_default_tier() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=2, default_tier=1))
    q.push(Batch.from_columns({"x": [0.0]}, ids=np.array([7]), ingest_ns=0), now_ns=0)
    q.push(rows([8], [0]), now_ns=0)
    b = q.pop_ready(now_ns=0, idle=True)
    assert b is not None and b.ids.tolist()[0] == 7


def test_per_tier_timeouts() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=8, timeout_ms=100, tier_timeout_ms={2: 5}, eager=False))
    q.push(rows([1, 2], [2, 0]), now_ns=0)
    assert q.next_wakeup_ns(0) == 1 * MS  # max_queue_delay first
    expired = q.expire(6 * MS)
    assert [(b.ids.tolist(), reason) for b, reason in expired] == [
        ([1], "timeout after 5 ms in batcher queue")
    ]
    assert q.expire(50 * MS) == [] and q.queued_rows == 1
    ((b, reason),) = q.expire(100 * MS)
    assert b.ids.tolist() == [2] and reason == "timeout after 100 ms in batcher queue"


def test_config_validates_tiers() -> None:
    with pytest.raises(ConfigError, match="overload must be 'block' or 'shed'"):
        BatcherConfig(overload="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"tier_timeout_ms\[1\] must be a finite number > 0"):
        BatcherConfig(tier_timeout_ms={1: 0})


def test_shed_evicts_lower_tiers_before_refusing_higher_ones() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=4, capacity_rows=4))
    q.push(rows([1, 2, 3], [0, 0, 0]), now_ns=0)
    admitted, dropped = q.shed(rows([10, 11, 12], [2, 2, 1]), capacity_rows=4)
    assert admitted is not None and admitted.ids.tolist() == [10, 11, 12]
    assert sorted(i for b in dropped for i in b.ids.tolist()) == [2, 3]  # newest bronze first
    q.push(admitted, now_ns=1)
    assert q.queued_rows == 4
    admitted, dropped = q.shed(rows([20], [0]), capacity_rows=4)  # bronze cannot push out gold
    assert admitted is None and [b.ids.tolist() for b in dropped] == [[20]]


@st.composite
def scenario(draw: st.DrawFn) -> list[tuple[str, list[int]]]:
    steps = draw(st.lists(st.sampled_from(["push", "pop"]), min_size=1, max_size=40))
    return [
        (s, draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)) if s == "push" else []) for s in steps
    ]


@settings(max_examples=200)
@given(scenario(), st.integers(2, 10))
def test_no_row_is_shed_while_a_lower_tier_row_is_kept(steps: list[tuple[str, list[int]]], cap: int) -> None:
    """Shedding invariant, and every row resolved exactly once."""
    q = BatchQueue(BatcherConfig(max_batch_size=2, capacity_rows=max(cap, 2)))
    tier_of: dict[int, int] = {}
    queued: set[int] = set()
    fate: dict[int, str] = {}
    next_id = 0
    for now, (step, tiers) in enumerate(steps):
        if step == "push":
            ids = list(range(next_id, next_id + len(tiers)))
            next_id += len(tiers)
            tier_of.update(zip(ids, tiers, strict=True))
            admitted, dropped = q.shed(rows(ids, tiers), q.config.capacity_rows)
            shed_ids = [i for b in dropped for i in b.ids.tolist()]
            kept = (set(queued) - set(shed_ids)) | (set(admitted.ids.tolist()) if admitted else set())
            for s in shed_ids:
                assert s not in fate
                fate[s] = "shed"
                assert all(tier_of[k] >= tier_of[s] for k in kept), "shed a row while a lower tier was kept"
            queued = kept
            if admitted is not None:
                q.push(admitted, now)
            assert q.queued_rows == len(queued) <= q.config.capacity_rows
        else:
            b = q.pop_ready(now, idle=True)
            if b is not None:
                served = b.ids.tolist()
                assert all(
                    tier_of[s] >= max((tier_of[k] for k in queued - set(served)), default=-1) for s in served
                )
                for s in served:
                    assert s in queued and s not in fate
                    fate[s] = "served"
                    queued.discard(s)
    assert set(fate) | queued == set(range(next_id))


def test_dynamic_batcher_sheds_bronze_for_gold_under_overload() -> None:
    gate = threading.Event()

    def slow(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        gate.wait(10)
        return {"y": inputs["x"]}

    rt = PythonRuntime(slow, input_names=("x",), output_names=("y",), name="slow")
    served: list[int] = []
    dead: list[tuple[list[int], str]] = []
    lock = threading.Lock()

    def emit(b: Batch) -> None:
        with lock:
            served.extend(b.ids.tolist())

    def dead_letter(b: Batch, reason: str) -> None:
        with lock:
            dead.append((b.ids.tolist(), reason))

    cfg = BatcherConfig(max_batch_size=4, capacity_rows=8, overload="shed")
    batcher = DynamicBatcher(
        rt,
        cfg,
        prepare=lambda b: {"x": b.numpy("x")},
        finish=lambda b, o, rt: b,
        emit=emit,
        dead_letter=dead_letter,
    )
    batcher.start()
    batcher.submit(rows([0, 1, 2, 3], [0] * 4))  # taken by the (blocked) model call
    while batcher.queued_rows:
        pass
    batcher.submit(rows(list(range(10, 18)), [0] * 8))  # bronze fills the queue
    batcher.submit(rows(list(range(20, 26)), [2] * 6))  # gold pushes bronze out, never blocks
    gate.set()
    batcher.close()
    shed = sorted(i for ids, reason in dead if reason == "shed" for i in ids)
    assert shed == list(range(12, 18))
    assert set(range(20, 26)) <= set(served) and batcher.stats.shed == 6
    assert sorted(served + shed) == [0, 1, 2, 3, *range(10, 18), *range(20, 26)]
