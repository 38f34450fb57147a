from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from aisp.batch import DEADLINE_NS, ID, TIER, Batch, matrix_column
from aisp.errors import ConfigError
from aisp.infer import (
    BatcherClosed,
    BatcherConfig,
    BatcherStats,
    BatchQueue,
    DynamicBatcher,
    OnnxRuntime,
    PythonRuntime,
    QueueFull,
    TensorSpec,
)

MS = 1_000_000
T0 = 1_000_000_000
WAIT_S = 10.0  # generous bound on thread hand-offs; tests finish as soon as events fire


# -- helpers --------------------------------------------------------------------------------------
def rows(ids: list[int] | np.ndarray, *, tiers: Any = None, deadlines: Any = None) -> Batch:
    ids = np.asarray(ids, dtype=np.int64)
    cols: dict[str, Any] = {"x": ids.astype(np.float64)}
    if tiers is not None:
        cols[TIER] = np.broadcast_to(np.asarray(tiers, dtype=np.int8), ids.shape).copy()
    if deadlines is not None:
        cols[DEADLINE_NS] = np.broadcast_to(np.asarray(deadlines, dtype=np.int64), ids.shape).copy()
    return Batch.from_columns(cols, ids=ids, ingest_ns=0)


def ids_of(batches: list[Batch]) -> list[int]:
    return [i for b in batches for i in b.ids.tolist()]


class Collector:
    """emit/dead_letter callbacks that record what they get and signal when ``expect`` rows came."""

    def __init__(self, expect: int = 0) -> None:
        self.out: list[Batch] = []
        self.dead: list[tuple[Batch, str]] = []
        self.expect = expect
        self.done = threading.Event()
        self.lock = threading.Lock()

    def emit(self, batch: Batch) -> None:
        with self.lock:
            self.out.append(batch)
            self._check()

    def dead_letter(self, batch: Batch, reason: str) -> None:
        with self.lock:
            self.dead.append((batch, reason))
            self._check()

    def _check(self) -> None:
        if sum(b.num_rows for b in self.out) + sum(b.num_rows for b, _ in self.dead) >= self.expect:
            self.done.set()


def python_io() -> tuple[Callable[[Batch], dict[str, np.ndarray]], Callable[..., Batch]]:
    def prepare(batch: Batch) -> dict[str, np.ndarray]:
        return {"x": batch.numpy("x")}

    def finish(batch: Batch, outputs: Mapping[str, np.ndarray], _rt: object = None) -> Batch:
        return batch.with_columns({"y": outputs["y"]})

    return prepare, finish


def doubler(fn: Callable[[dict[str, np.ndarray]], None] | None = None) -> PythonRuntime:
    def run(xs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if fn is not None:
            fn(xs)
        return {"y": xs["x"] * 2}

    return PythonRuntime(run, input_names=["x"], output_names=["y"], name="double")


def make_batcher(runtime: Any, config: BatcherConfig, sink: Collector, **kw: Any) -> DynamicBatcher:
    prepare, finish = python_io()
    return DynamicBatcher(
        runtime, config, prepare=prepare, finish=finish, emit=sink.emit, dead_letter=sink.dead_letter, **kw
    )


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": True}, "max_batch_size must be an integer >= 1, got True"),
        ({"preferred_batch_sizes": (0,)}, "preferred_batch_sizes entries must be an integer >= 1, got 0"),
        ({"max_batch_size": 8, "preferred_batch_sizes": (16,)}, "must be <= max_batch_size (8), got 16"),
        ({"max_queue_delay_ms": -1}, "max_queue_delay_ms must be a finite number >= 0.0, got -1"),
        ({"max_queue_delay_ms": float("nan")}, "max_queue_delay_ms must be a finite number"),
        ({"timeout_ms": 0}, "timeout_ms must be a finite number > 0.0, got 0"),
        ({"safety_margin_ms": -0.5}, "safety_margin_ms must be a finite number >= 0.0, got -0.5"),
        ({"eager": 1}, "eager must be a bool, got 1"),
        ({"capacity_rows": 100}, "capacity_rows must be an integer >= max_batch_size (512), got 100"),
        ({"instances": 0}, "instances must be an integer >= 1, got 0"),
    ],
)
def test_config_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        BatcherConfig(**kwargs)
    assert message in str(info.value)


def test_config_normalises_preferred_sizes() -> None:
    cfg = BatcherConfig(max_batch_size=64, preferred_batch_sizes=(32, 8, 32))
    assert cfg.preferred_batch_sizes == (8, 32)
    assert cfg == BatcherConfig(max_batch_size=64, preferred_batch_sizes=(8, 32))


# -- BatchQueue: properties -----------------------------------------------------------------------
configs = st.builds(
    lambda max_b, pref, delay, timeout, eager: BatcherConfig(
        max_batch_size=max_b,
        preferred_batch_sizes=tuple(p for p in pref if p <= max_b),
        max_queue_delay_ms=delay,
        timeout_ms=timeout,
        safety_margin_ms=0.5,
        eager=eager,
        capacity_rows=max(max_b, 64),
    ),
    st.integers(1, 16),
    st.lists(st.integers(1, 16), max_size=3),
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    st.none() | st.sampled_from([1.0, 4.0]),
    st.booleans(),
)


def expected_size(cfg: BatcherConfig, queued: int) -> int:
    n = min(queued, cfg.max_batch_size)
    fits = [p for p in cfg.preferred_batch_sizes if p <= n]
    return max(fits) if fits else n


@settings(max_examples=150, deadline=None)
@given(cfg=configs, data=st.data())
def test_queue_invariants(cfg: BatcherConfig, data: st.DataObject) -> None:
    q = BatchQueue(cfg)
    now = T0
    next_id = 0
    enq: dict[int, int] = {}  # queued id -> enqueue time
    tier_of: dict[int, int] = {}
    deadline_of: dict[int, int] = {}
    resolved: Counter[int] = Counter()
    emitted_per_tier: dict[int, list[int]] = {}
    timeout_ns = None if cfg.timeout_ms is None else int(cfg.timeout_ms * MS)

    def take(batch: Batch) -> None:
        assert 0 < batch.num_rows <= cfg.max_batch_size
        got = batch.ids.tolist()
        tiers = [tier_of[i] for i in got]
        for i in got:
            del enq[i]
            emitted_per_tier.setdefault(tier_of[i], []).append(i)
        resolved.update(got)
        if enq:  # higher tiers first: nothing left outranks what was taken
            assert min(tiers) >= max(tier_of[i] for i in enq)

    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["push", "push", "tick", "pop", "expire"]))
        if op == "push":
            n = data.draw(st.integers(1, 12))
            tiers = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
            offs = data.draw(st.lists(st.sampled_from([0, 0, 1, 2, 5]), min_size=n, max_size=n))
            ids = list(range(next_id, next_id + n))
            next_id += n
            dl = [0 if o == 0 else now + o * MS for o in offs]
            q.push(rows(ids, tiers=tiers, deadlines=dl), now)
            for i, t, d in zip(ids, tiers, dl, strict=True):
                enq[i], tier_of[i], deadline_of[i] = now, t, d
        elif op == "tick":
            now += data.draw(st.integers(0, 3 * MS))
            wake = q.next_wakeup_ns(now)
            assert (wake is None) == (not enq)
        elif op == "pop":
            idle = data.draw(st.booleans())
            queued = len(enq)
            overdue = bool(enq) and now - min(enq.values()) >= cfg.max_queue_delay_ms * MS
            batch = q.pop_ready(now, idle=idle)
            if queued and ((cfg.eager and idle) or overdue or queued >= cfg.max_batch_size):
                assert batch is not None
            if batch is not None:
                assert batch.num_rows == expected_size(cfg, queued)
                take(batch)
        else:
            for batch, reason in q.expire(now):
                for i in batch.ids.tolist():
                    if reason == "deadline exceeded":
                        assert 0 < deadline_of[i] <= now
                    else:
                        assert reason == f"timeout after {cfg.timeout_ms:g} ms in batcher queue"
                        assert timeout_ns is not None and now - enq[i] >= timeout_ns
                    del enq[i]
                resolved.update(batch.ids.tolist())
            for i, t in enq.items():  # nothing overdue stays behind
                assert not (0 < deadline_of[i] <= now)
                assert timeout_ns is None or now - t < timeout_ns
        assert q.queued_rows == len(enq)

    while (batch := q.form_batch(now)) is not None:
        take(batch)
    assert q.queued_rows == 0 and not enq
    assert set(resolved) == set(range(next_id))
    assert all(c == 1 for c in resolved.values())
    for emitted in emitted_per_tier.values():  # FIFO within a tier
        assert emitted == sorted(emitted)


@settings(max_examples=50, deadline=None)
@given(
    cfg=configs.filter(lambda c: not c.eager),
    sizes=st.lists(st.integers(1, 10), min_size=1, max_size=5),
)
def test_lazy_queue_flushes_after_max_delay(cfg: BatcherConfig, sizes: list[int]) -> None:
    q = BatchQueue(cfg)
    start = 0
    for n in sizes:
        q.push(rows(range(start, start + n)), T0)
        start += n
    delay_ns = int(cfg.max_queue_delay_ms * MS)
    while q.queued_rows:
        batch = q.pop_ready(T0 + delay_ns, idle=False)
        assert batch is not None
        assert batch.num_rows == expected_size(cfg, batch.num_rows + q.queued_rows)


# -- BatchQueue: examples -------------------------------------------------------------------------
def test_lazy_queue_waits_until_delay_or_size() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=4, max_queue_delay_ms=2.0, eager=False))
    q.push(rows([0, 1]), T0)
    assert q.pop_ready(T0 + MS, idle=True) is None
    assert q.next_wakeup_ns(T0 + MS) == T0 + 2 * MS
    batch = q.pop_ready(T0 + 2 * MS, idle=True)
    assert batch is not None and batch.ids.tolist() == [0, 1]
    assert q.last_wait_ns == 2 * MS
    q.push(rows(range(2, 7)), T0)
    full = q.pop_ready(T0, idle=False)
    assert full is not None and full.ids.tolist() == [2, 3, 4, 5]
    assert q.queued_rows == 1


def test_eager_queue_dispatches_when_idle_only() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=8, max_queue_delay_ms=5.0))
    q.push(rows([0]), T0)
    assert q.pop_ready(T0, idle=False) is None  # busy: let the batch grow
    q.push(rows([1, 2]), T0)
    batch = q.pop_ready(T0, idle=True)
    assert batch is not None and batch.ids.tolist() == [0, 1, 2]


def test_preferred_sizes_split_the_queue() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=16, preferred_batch_sizes=(4, 8), eager=False))
    q.push(rows(range(11)), T0)
    sizes = []
    while (batch := q.pop_ready(T0, idle=False)) is not None:
        sizes.append(batch.num_rows)
    assert sizes == [8]  # 3 left: under the smallest preferred size, waits for the delay
    batch = q.pop_ready(T0 + MS, idle=False)
    assert batch is not None and batch.ids.tolist() == [8, 9, 10]


def test_higher_tier_first_and_mixed_batches_split() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=3))
    q.push(rows([0, 1, 2, 3], tiers=[0, 2, 0, 1]), T0)
    q.push(rows([4], tiers=[2]), T0)
    first = q.pop_ready(T0, idle=True)
    second = q.pop_ready(T0, idle=True)
    assert first is not None and second is not None
    assert first.ids.tolist() == [1, 4, 3]
    assert second.ids.tolist() == [0, 2]


def test_timeout_expires_rows_with_reason() -> None:
    cfg = BatcherConfig(
        max_batch_size=8, timeout_ms=5, eager=False, max_queue_delay_ms=100, safety_margin_ms=0
    )
    q = BatchQueue(cfg)
    q.push(rows([0, 1]), T0)
    q.push(rows([2]), T0 + 3 * MS)
    assert q.expire(T0 + 4 * MS) == []
    assert q.next_wakeup_ns(T0 + 4 * MS) == T0 + 5 * MS
    expired = q.expire(T0 + 5 * MS)
    assert [(b.ids.tolist(), r) for b, r in expired] == [([0, 1], "timeout after 5 ms in batcher queue")]
    assert q.queued_rows == 1


def test_deadline_expires_only_late_rows() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=8, eager=False, max_queue_delay_ms=100))
    q.push(rows([0, 1, 2, 3], deadlines=[0, T0 + 2 * MS, T0 + 9 * MS, T0 + 2 * MS]), T0)
    assert q.expire(T0 + MS) == []
    expired = q.expire(T0 + 2 * MS)
    assert [(b.ids.tolist(), r) for b, r in expired] == [([1, 3], "deadline exceeded")]
    batch = q.form_batch(T0 + 2 * MS)
    assert batch is not None and batch.ids.tolist() == [0, 2]


def test_latency_budget_flushes_before_the_deadline() -> None:
    cfg = BatcherConfig(max_batch_size=64, max_queue_delay_ms=1000, safety_margin_ms=1, eager=False)
    q = BatchQueue(cfg)
    q.cost.observe(4, 2 * MS)  # about 0.5 ms per row
    q.push(rows([0, 1, 2, 3], deadlines=T0 + 10 * MS), T0)
    flush_at = T0 + 10 * MS - 2 * MS - 1 * MS  # deadline - expected compute - margin
    assert q.next_wakeup_ns(T0) == flush_at
    assert q.pop_ready(flush_at - 1, idle=False) is None
    batch = q.pop_ready(flush_at, idle=False)
    assert batch is not None and batch.num_rows == 4


def test_wakeup_follows_the_next_deadline_once_the_urgent_row_left() -> None:
    cfg = BatcherConfig(max_batch_size=2, eager=False, max_queue_delay_ms=100, safety_margin_ms=0)
    q = BatchQueue(cfg)
    q.push(rows([0], deadlines=T0 + 2 * MS), T0)
    assert q.next_wakeup_ns(T0) == T0 + 2 * MS
    assert q.pop_ready(T0 + MS, idle=False) is None
    batch = q.pop_ready(T0 + 2 * MS, idle=False)
    assert batch is not None and batch.ids.tolist() == [0]
    q.push(rows([1], deadlines=T0 + 9 * MS), T0 + 2 * MS)
    assert q.pop_ready(T0 + 2 * MS, idle=False) is None
    assert q.next_wakeup_ns(T0 + 2 * MS) == T0 + 9 * MS


def test_pieces_with_another_schema_wait_for_the_next_batch() -> None:
    q = BatchQueue(BatcherConfig(max_batch_size=8))
    q.push(rows([0, 1]), T0)
    q.push(rows([2], tiers=0), T0)  # same tier, one more column
    q.push(rows([3]), T0)
    got = [q.form_batch(T0) for _ in range(3)]
    assert [b.ids.tolist() if b else None for b in got] == [[0, 1], [2], [3]]


# -- DynamicBatcher with a Python runtime ---------------------------------------------------------
def test_batcher_resolves_every_row_once() -> None:
    sizes: list[int] = []
    sink = Collector(expect=1000)
    cfg = BatcherConfig(max_batch_size=64, capacity_rows=256, instances=2)
    batcher = make_batcher(doubler(), cfg, sink, on_batch=lambda n, _w, _c, _t: sizes.append(n))
    with batcher:
        for start in range(0, 1000, 10):
            batcher.submit(rows(range(start, start + 10)))
    assert sink.dead == []
    out = Batch.concat(sink.out)
    assert sorted(out.ids.tolist()) == list(range(1000))
    np.testing.assert_array_equal(out.numpy("y"), out.numpy("x") * 2)
    assert sum(sizes) == 1000 and max(sizes) <= 64
    stats = batcher.stats
    assert stats == BatcherStats(batches=len(sizes), rows=1000, timeouts=0, errors=0, queued_rows=0)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.0, 0.004), min_size=5, max_size=40),
    st.integers(2, 4),
    st.sets(st.integers(0, 39), max_size=5),
)
def test_ordered_results_leave_in_the_order_their_batches_formed(
    delays: list[float], instances: int, failing: set[int]
) -> None:
    """Several instances with calls of random lengths, some failing: with ``ordered`` the
    results come out in the order the rows went in (the failed batches' rows dead-lettered,
    every row once)."""
    n = len(delays) * 4

    def run(xs: dict[str, np.ndarray]) -> None:
        first = int(xs["x"][0]) // 4
        time.sleep(delays[first])
        if first in failing:
            raise ValueError("failed call")

    sink = Collector(expect=n)
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0, instances=instances, ordered=True)
    with make_batcher(doubler(run), cfg, sink) as batcher:
        for start in range(0, n, 4):
            batcher.submit(rows(range(start, start + 4)))
        assert sink.done.wait(WAIT_S)
    out = ids_of(sink.out)
    assert out == sorted(out)
    dead = sorted(i for b, _ in sink.dead for i in b.ids.tolist())
    assert sorted(out + dead) == list(range(n))
    assert all(int(b.ids[0]) // 4 in failing for b, _ in sink.dead)  # the failed calls' rows


def test_a_burst_is_split_among_the_idle_instances() -> None:
    """Rows that arrive together while two instances are idle go to both, half each, instead of
    one instance taking them all while the other waits."""
    sizes: list[int] = []
    armed, gate = threading.Event(), threading.Event()
    sink = Collector(expect=16)
    cfg = BatcherConfig(max_batch_size=64, instances=2)
    hold = doubler(lambda _x: armed.is_set() and gate.wait(WAIT_S))  # calls wait; warm-up does not
    batcher = make_batcher(hold, cfg, sink, on_batch=lambda n, *_: sizes.append(n))
    with batcher:
        armed.set()
        batcher.submit(rows(range(16)))
        deadline = time.monotonic() + WAIT_S
        while batcher.queued_rows and time.monotonic() < deadline:  # both calls formed
            time.sleep(0.001)
        gate.set()
        assert sink.done.wait(WAIT_S)
    assert sorted(sizes) == [8, 8]
    q = BatchQueue(BatcherConfig(max_batch_size=4))
    q.push(rows(range(10)), T0)
    assert (q.target_size(), q.target_size(share=3), q.target_size(share=20)) == (4, 4, 1)


def test_work_accounting_leaves_out_backpressure_and_counts_each_call_once() -> None:
    """A caller blocked on a full queue is not working: ``not_work_ns`` grows by that wait, and
    by the work of calls it ran inline, which ``on_batch`` reports (``work_ns`` >= the model's
    ``compute_ns``); a dispatcher's idle time is in no call's ``work_ns``."""
    calls: list[tuple[int, int, int]] = []

    def on_batch(n: int, _wait: int, compute: int, work: int) -> None:
        calls.append((n, compute, work))

    gate = threading.Event()
    sink = Collector(expect=40)
    cfg = BatcherConfig(max_batch_size=10, max_queue_delay_ms=0.0, capacity_rows=10)
    batcher = make_batcher(doubler(lambda _xs: gate.wait(WAIT_S)), cfg, sink, on_batch=on_batch)
    with batcher:
        batcher.submit(rows(range(10)))  # taken at once, its call held by the gate
        batcher.submit(rows(range(10, 20)))  # queued: the queue is now full
        before = batcher.not_work_ns()
        threading.Timer(0.1, gate.set).start()
        batcher.submit(rows(range(20, 30)))  # blocks until the gate opens and the queue drains
        assert batcher.not_work_ns() - before >= 50 * MS
        time.sleep(0.2)  # the dispatcher idles: not work
        batcher.submit(rows(range(30, 40)))
        assert sink.done.wait(WAIT_S)
    assert [n for n, _, _ in calls] == [10, 10, 10, 10]
    assert all(t >= c > 0 for _, c, t in calls)
    assert calls[-1][2] < 100 * MS  # the idle 200 ms before it are in no call's work

    calls.clear()
    inline = make_batcher(doubler(), BatcherConfig(max_batch_size=10), Collector(), on_batch=on_batch)
    with inline:
        inline.submit(rows(range(10)))  # the cost model learns what a call takes
        time.sleep(0.05)
        before = inline.not_work_ns()
        inline.feed(rows(range(10, 20)))  # idle model, a whole batch: runs in this thread
        assert len(calls) == 2
        assert inline.not_work_ns() - before == calls[1][2]


def test_start_warms_up_before_taking_rows() -> None:
    shapes: list[tuple[int, ...]] = []

    def run(xs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shapes.append(xs["x"].shape)
        return {"y": xs["x"]}

    spec = TensorSpec(np.dtype(np.float64), (None,))
    rt = PythonRuntime(run, input_names=["x"], output_names=["y"], name="id", input_specs={"x": spec})
    sink = Collector()
    batcher = make_batcher(rt, BatcherConfig(max_batch_size=32, preferred_batch_sizes=(8, 16)), sink)
    batcher.start()
    assert shapes == [(8,), (16,), (32,)]
    batcher.close()
    with pytest.raises(RuntimeError, match="already started"):
        batcher.start()


def test_model_error_dead_letters_the_batch_and_goes_on() -> None:
    def check(xs: dict[str, np.ndarray]) -> None:
        if (xs["x"] < 0).any():
            raise ValueError("negative input")

    sink = Collector(expect=3)
    with make_batcher(doubler(check), BatcherConfig(max_batch_size=8), sink) as batcher:
        batcher.submit(rows([-1, 1, 2]))
        assert sink.done.wait(WAIT_S)
        sink.done.clear()
        sink.expect = 5
        batcher.submit(rows([3, 4]))
        assert sink.done.wait(WAIT_S)
    [(dead, reason)] = sink.dead
    assert reason == "ValueError: negative input"
    assert dead.ids.tolist() == [-1, 1, 2]
    assert ids_of(sink.out) == [3, 4]
    assert batcher.stats.errors == 3 and batcher.stats.rows == 2


def test_prepare_failure_dead_letters() -> None:
    sink = Collector()

    def prepare(batch: Batch) -> dict[str, np.ndarray]:
        raise KeyError("x")

    _, finish = python_io()
    batcher = DynamicBatcher(
        doubler(),
        BatcherConfig(),
        prepare=prepare,
        finish=finish,
        emit=sink.emit,
        dead_letter=sink.dead_letter,
    )
    with batcher:
        batcher.submit(rows([1]))
    assert [r for _, r in sink.dead] == ["KeyError: 'x'"]


def test_backpressure_blocks_submit_until_the_model_catches_up() -> None:
    entered, release = threading.Event(), threading.Event()

    def gate(xs: dict[str, np.ndarray]) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    sink = Collector(expect=12)
    cfg = BatcherConfig(max_batch_size=4, capacity_rows=4)
    batcher = make_batcher(doubler(gate), cfg, sink)
    batcher.start()
    batcher.submit(rows([0, 1, 2, 3]))
    assert entered.wait(WAIT_S)  # the model holds the first batch; the queue is empty again
    batcher.submit(rows([4, 5, 6, 7]))  # fills the queue
    with pytest.raises(QueueFull, match="queue full"):
        batcher.submit(rows([8]), timeout_ms=1)

    submitted = threading.Event()

    def producer() -> None:
        batcher.submit(rows([8, 9, 10, 11]))
        submitted.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not submitted.is_set()  # blocked: queue at capacity while the model is held
    release.set()
    thread.join(WAIT_S)
    assert submitted.is_set()
    batcher.close()
    assert sorted(ids_of(sink.out)) == list(range(12))


def test_close_drains_rows_still_waiting() -> None:
    sink = Collector()
    cfg = BatcherConfig(max_batch_size=4, eager=False, max_queue_delay_ms=60_000)
    batcher = make_batcher(doubler(), cfg, sink)
    batcher.start()
    batcher.submit(rows([0, 1]))
    batcher.submit(rows([2]))
    batcher.close()
    assert ids_of(sink.out) == [0, 1, 2]
    with pytest.raises(BatcherClosed, match="is closed"):
        batcher.submit(rows([3]))
    batcher.close()  # idempotent


def test_close_without_start_drains_inline() -> None:
    sink = Collector()
    batcher = make_batcher(doubler(), BatcherConfig(max_batch_size=2), sink)
    batcher.submit(rows([0, 1, 2]))
    batcher.close()
    assert [b.ids.tolist() for b in sink.out] == [[0, 1], [2]]


def test_rows_time_out_in_the_queue() -> None:
    now = [T0]
    sink = Collector(expect=2)
    cfg = BatcherConfig(max_batch_size=8, eager=False, max_queue_delay_ms=60_000, timeout_ms=5)
    batcher = make_batcher(doubler(), cfg, sink, clock=lambda: now[0])
    batcher.start()
    batcher.submit(rows([0, 1]))
    now[0] += 5 * MS  # the dispatcher re-reads the clock within 5 ms of real time
    assert sink.done.wait(WAIT_S)
    batcher.close()
    assert [(b.ids.tolist(), r) for b, r in sink.dead] == [([0, 1], "timeout after 5 ms in batcher queue")]
    assert batcher.stats.timeouts == 2


def test_callback_failure_is_raised_by_close() -> None:
    def emit(batch: Batch) -> None:
        raise OSError("sink down")

    prepare, finish = python_io()
    batcher = DynamicBatcher(
        doubler(), BatcherConfig(), prepare=prepare, finish=finish, emit=emit, dead_letter=lambda b, r: None
    )
    batcher.start()
    batcher.submit(rows([1]))
    batcher.submit(rows([2]))
    with pytest.raises(OSError, match="sink down"):
        batcher.close()
    assert batcher.stats.rows == 2  # the dispatcher kept going after the first failure


# -- DynamicBatcher with ONNX Runtime -------------------------------------------------------------
@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((18, 1)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(1).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["logit"]),
            helper.make_node("Sigmoid", ["logit"], ["score"]),
        ],
        "score",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 18])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 1])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("batcher") / "score.onnx"
    onnx.save(model, str(path))
    return path


def test_onnx_batcher_matches_direct_call(onnx_model: Path) -> None:
    features = np.random.default_rng(3).standard_normal((700, 18)).astype(np.float32)
    expected = ort.InferenceSession(str(onnx_model)).run(["score"], {"features": features})[0][:, 0]

    def prepare(batch: Batch) -> dict[str, np.ndarray]:
        return {"features": batch.numpy("features")}

    def finish(batch: Batch, outputs: Mapping[str, np.ndarray], _rt: object = None) -> Batch:
        return batch.with_columns({"score": outputs["score"].reshape(-1)})

    sink = Collector()
    cfg = BatcherConfig(max_batch_size=128, preferred_batch_sizes=(64,), instances=2)
    runtime = OnnxRuntime(onnx_model)
    batcher = DynamicBatcher(
        runtime, cfg, prepare=prepare, finish=finish, emit=sink.emit, dead_letter=sink.dead_letter
    )
    with batcher:
        for start in range(0, 700, 50):
            part = features[start : start + 50]
            ids = np.arange(start, start + 50, dtype=np.int64)
            batcher.submit(Batch.from_columns({"features": matrix_column(part)}, ids=ids))
    assert sink.dead == []
    out = Batch.concat(sink.out)
    order = np.argsort(out.ids)
    assert out.ids[order].tolist() == list(range(700))
    np.testing.assert_allclose(out.numpy("score")[order], expected, rtol=1e-6)
    assert all(b.num_rows <= 128 for b in sink.out)
    assert ID in out


# -- inline calls ---------------------------------------------------------------------------------
def test_run_inline_only_when_idle_and_cheap() -> None:
    threads: list[str] = []
    release = threading.Event()
    gate = {"block": False}

    def record(_: dict[str, np.ndarray]) -> None:
        threads.append(threading.current_thread().name)
        if gate["block"]:
            release.wait(WAIT_S)

    sink = Collector(expect=3)
    b = make_batcher(doubler(record), BatcherConfig(max_batch_size=8, max_queue_delay_ms=0.0), sink)
    b.start()
    try:
        assert not b.run_inline(rows([1]), max_cost_ns=10**9)  # no cost observed yet: no guess
        b.submit(rows([2]))
        for _ in range(1000):
            if sum(x.num_rows for x in sink.out) == 1:
                break
            time.sleep(0.01)
        assert b.run_inline(rows([3]), max_cost_ns=10**9)  # idle, observed cost well under 1 s
        assert threads[-1] == threading.current_thread().name
        assert ids_of(sink.out)[-1] == 3 and sink.out[-1].numpy("y").tolist() == [6.0]
        assert not b.run_inline(rows([4]), max_cost_ns=0)  # too slow for the caller's budget
        gate["block"] = True
        b.submit(rows([5]))  # a call in flight: the model is not idle
        for _ in range(1000):
            if len(threads) == 3:
                break
            time.sleep(0.01)
        assert not b.run_inline(rows([6]), max_cost_ns=10**9)
        release.set()
    finally:
        release.set()
        b.close()


def test_a_model_too_slow_inline_is_tried_there_again_once_a_second() -> None:
    """Inline costs come from inline calls; one too slow (a start-up's, a busy moment's) is
    retried once a second while the dispatchers' figures allow it, and the retry relearns."""
    now = [T0]
    delay = {"s": 0.008}
    rt = doubler(lambda _xs: time.sleep(delay["s"]))
    b = make_batcher(
        rt, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0.0), Collector(), clock=lambda: now[0]
    )
    b.start()
    try:
        b.submit(rows([1]))  # the dispatchers learn ~8 ms
        for _ in range(1000):
            if b.stats.batches == 1:
                break
            time.sleep(0.01)
        budget = 5 * MS  # under 8 ms, but within one switch interval of slack
        assert b.run_inline(rows([2]), max_cost_ns=budget)  # never tried inline: tried
        delay["s"] = 0.0
        assert not b.run_inline(rows([3]), max_cost_ns=budget)  # 8 ms inline: too slow
        now[0] += 1_000 * MS
        assert b.run_inline(rows([4]), max_cost_ns=budget)  # a second later: tried again
        for _ in range(20):  # fast now: the inline figure comes down, and stays inline
            now[0] += 1_000 * MS
            b.run_inline(rows([5]), max_cost_ns=budget)
        assert b.run_inline(rows([6]), max_cost_ns=budget)
        assert b.run_inline(rows([7]), max_cost_ns=budget)
        assert not b.run_inline(rows([8]), max_cost_ns=0)  # 0: never
    finally:
        b.close()


@pytest.mark.parametrize("eager", [False, True])
def test_feed_runs_in_the_callers_thread_what_the_queue_would_dispatch_at_once(eager: bool) -> None:
    calls: list[tuple[str, list[float]]] = []

    def record(xs: dict[str, np.ndarray]) -> None:
        calls.append((threading.current_thread().name, xs["x"].tolist()))

    sink = Collector()
    cfg = BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0, eager=eager)
    b = make_batcher(doubler(record), cfg, sink)
    me = threading.current_thread().name

    def wait_for(n: int) -> None:
        for _ in range(1000):
            if len(calls) >= n:
                return
            time.sleep(0.01)

    b.start()
    try:
        b.submit(rows([0, 1]))  # through the dispatcher: teaches the cost model
        wait_for(1)
        assert calls[-1][0] != me
        b.feed(rows([2, 3]))  # a whole model batch: here
        assert calls[-1] == (me, [2.0, 3.0])
        b.feed(rows([4, 5, 6, 7, 8]))  # two whole batches here; the rest here only when eager
        wait_for(5)
        assert calls[2:4] == [(me, [4.0, 5.0]), (me, [6.0, 7.0])]
        assert calls[4][1] == [8.0] and (calls[4][0] == me) is eager
        far = time.monotonic_ns() + 10**12
        b.feed(rows([9, 10], deadlines=far))  # the queue drops expired rows: it takes these
        wait_for(6)
        assert calls[5][0] != me
    finally:
        b.close()
    assert sorted(ids_of(sink.out)) == list(range(11))


def test_feed_leaves_a_slow_step_after_the_model_to_the_dispatcher() -> None:
    calls: list[str] = []

    def record(_: dict[str, np.ndarray]) -> None:
        calls.append(threading.current_thread().name)

    sink = Collector()
    slow_emit = sink.emit

    def emit(batch: Batch) -> None:  # a sink waiting 20 ms on a remote store
        time.sleep(0.02)
        slow_emit(batch)

    prepare, finish = python_io()
    b = DynamicBatcher(
        doubler(record), BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0), prepare=prepare,
        finish=finish, emit=emit, dead_letter=sink.dead_letter,
    )  # fmt: skip
    b.start()
    try:
        b.submit(rows([0, 1]))  # through the dispatcher: the call and what follows it are timed
        for _ in range(1000):
            if len(sink.out) == 1:
                break
            time.sleep(0.01)
        b.feed(rows([2, 3]), max_cost_ns=5_000_000)  # 20 ms after the call: not here
        for _ in range(1000):
            if len(sink.out) == 2:
                break
            time.sleep(0.01)
        assert len(calls) == 2 and calls[1] != threading.current_thread().name
    finally:
        b.close()
