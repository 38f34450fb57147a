from __future__ import annotations

import threading

import numpy as np
import pytest

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.schedule.channel import Channel


def rows(n: int) -> Batch:
    return Batch.from_columns({"x": np.zeros(n)}, ingest_ns=0)


def test_put_blocks_when_full_until_get() -> None:
    ch = Channel(capacity_rows=10)
    ch.put(rows(8))
    entered, done = threading.Event(), threading.Event()

    def producer() -> None:
        entered.set()
        ch.put(rows(5))  # 8 + 5 > 10: must wait for the consumer
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    entered.wait()
    assert not done.wait(0.05)
    assert ch.get() is not None
    assert done.wait(5)
    t.join()
    assert ch.rows == 5


def test_oversized_batch_enters_empty_channel() -> None:
    ch = Channel(capacity_rows=4)
    ch.put(rows(100))
    assert ch.rows == 100


def test_closes_after_all_producers() -> None:
    ch = Channel(capacity_rows=4, producers=2)
    ch.put(rows(1))
    ch.close_producer()
    assert ch.get() is not None
    ch.close_producer()
    assert ch.get() is None


def test_capacity_validated() -> None:
    with pytest.raises(ConfigError, match="capacity_rows must be >= 1, got 0"):
        Channel(0)


def test_a_consumer_that_fell_behind_takes_the_queued_batches_as_one() -> None:
    ch = Channel(capacity_rows=100, producers=1)
    first = Batch.from_columns({"x": [1, 2]}, ids=np.array([0, 1]))
    first.traced = np.array([1])
    ch.put(first)
    ch.put(Batch.from_columns({"x": [3]}, ids=np.array([2])))
    ch.put(Batch.from_columns({"y": [4]}, ids=np.array([3])))  # other columns: not merged
    ch.put(Batch.from_columns({"y": [5, 6]}, ids=np.array([4, 5])))
    got = ch.get(max_rows=10)
    assert got is not None and got.pylist("x") == [1, 2, 3] and got.traced.tolist() == [1]
    assert ch.get(max_rows=2).pylist("y") == [4]  # a third row would pass max_rows
    assert ch.get(max_rows=2).pylist("y") == [5, 6]
    assert ch.rows == 0
