"""Background restores of newly assigned partitions: ready ones are handed over once, a partition
taken away is never handed over and its claim is released, a failed claim fails the caller."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aisp.errors import StateError
from aisp.schedule.checkpointing.restores import Restores
from aisp.state.checkpoint import Checkpoint


class Store:
    """Claims that wait for a gate, and a record of what was claimed and released."""

    def __init__(self) -> None:
        self.gate: dict[int, threading.Event] = {}
        self.claimed: list[int] = []
        self.released: list[int] = []
        self.fail: set[int] = set()
        self.made: list[Restores] = []

    def claim(self, partition: int) -> Checkpoint | None:
        self.gate.setdefault(partition, threading.Event()).wait(10)
        if partition in self.fail:
            raise StateError(f"partition {partition}: changelog unreadable")
        self.claimed.append(partition)
        return Checkpoint(0, Path("x"), {"offset": partition * 10}, {}) if partition else None

    def release(self, partition: int) -> None:
        self.released.append(partition)

    def open(self, partition: int) -> None:
        """Let the claim of ``partition`` finish (the gate the claim waits on, whoever made it)."""
        self.gate.setdefault(partition, threading.Event()).set()

    def restores(self) -> Restores:
        made = Restores(self.claim, self.release)
        self.made.append(made)
        return made

    def close(self) -> None:
        for gate in list(self.gate.values()):
            gate.set()
        for made in self.made:
            made.close()


@pytest.fixture
def store() -> Iterator[Store]:
    """A store whose gates are all opened and whose restores are closed at the end, failed or
    not, so no claim thread outlives its test (a thread left running makes a later test's fork
    of worker processes refuse to run)."""
    made = Store()
    yield made
    made.close()


def wait_ready(restores: Restores, timeout_s: float = 10.0) -> dict[int, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = restores.take_ready()
        if ready:
            return ready
        time.sleep(0.01)
    raise AssertionError("nothing restored")


def test_partitions_are_handed_over_once_restored_in_the_order_assigned(store: Store) -> None:
    restores = store.restores()
    restores.start([0, 2])
    assert restores.pending and restores.take_ready() == {}
    store.open(0)  # the claim thread may be waiting on the gate already: open that one
    first = wait_ready(restores)
    assert first == {0: None} and restores.pending
    store.open(2)
    second = wait_ready(restores)
    assert list(second) == [2] and second[2].meta["offset"] == 20
    assert not restores.pending and restores.take_ready() == {}
    restores.close()


def test_a_partition_taken_away_while_it_is_restored_is_released_not_handed_over(store: Store) -> None:
    restores = store.restores()
    restores.start([1, 3])
    time.sleep(0.05)  # the claim of 1 is under way
    restores.cancel([1])
    store.open(1)
    store.open(3)
    assert list(wait_ready(restores)) == [3]
    deadline = time.monotonic() + 5
    while 1 not in store.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.released == [1] and 1 in store.claimed
    assert 1 not in restores.take_ready()
    restores.close()


def test_a_claimed_partition_taken_away_before_it_is_loaded_is_released(store: Store) -> None:
    store.open(4)
    restores = store.restores()
    restores.start([4])
    deadline = time.monotonic() + 5
    while not store.claimed and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    restores.cancel([4])
    assert store.released == [4] and restores.take_ready() == {} and not restores.pending
    restores.start([4])  # assigned again: claimed again
    assert list(wait_ready(restores)) == [4]
    restores.close()


def test_a_failed_claim_fails_the_next_take(store: Store) -> None:
    store.fail.add(5)
    store.open(5)
    restores = store.restores()
    restores.start([5])
    with pytest.raises(StateError, match="changelog unreadable"):
        wait_ready(restores)
    restores.close()
