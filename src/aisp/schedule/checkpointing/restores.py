"""Partitions whose keyed state is restored in the background while the others flow.

A partition newly assigned to the process is claimed from the partition state store (its
changelogs read, or its shared directory's lock awaited) by one background thread, in the order
assigned; meanwhile the Kafka source keeps reading the partitions it already has and polls the
group (so a long restore never makes the process miss the poll interval), and reads nothing of
the partitions being restored. Between batches the source thread loads what is ready.

A partition taken away before its restore is loaded is cancelled: a claim that finishes after
that is released at once (a store's lock is not held for nobody). A claim that fails fails the
run, with the store's error, at the source's next batch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from aisp.state.checkpoint import Checkpoint

__all__ = ["Restores"]

log = logging.getLogger("aisp.executor")


class Restores:
    """The background claims of newly assigned partitions (see the module docstring)."""

    def __init__(self, claim: Callable[[int], Checkpoint | None], release: Callable[[int], None]) -> None:
        self._claim, self._release = claim, release
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int]] = deque()
        self._wanted: dict[int, int] = {}  # partition -> the generation of its latest assignment
        self._ready: dict[int, Checkpoint | None] = {}
        self._generation = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self, partitions: list[int]) -> None:
        """Claim ``partitions`` in the background."""
        with self._cond:
            for partition in partitions:
                self._generation += 1
                self._wanted[partition] = self._generation
                self._queue.append((partition, self._generation))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="aisp-restore", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def cancel(self, partitions: list[int]) -> None:
        """Forget the restores of ``partitions`` (taken away); release the ones claimed already."""
        with self._cond:
            claimed = [p for p in partitions if p in self._ready]
            for partition in partitions:
                self._wanted.pop(partition, None)
                self._ready.pop(partition, None)
        for partition in claimed:
            self._release(partition)

    @property
    def pending(self) -> bool:
        """Whether some partition is still being restored or waits to be loaded."""
        with self._cond:
            return bool(self._wanted)

    def take_ready(self) -> dict[int, Checkpoint | None]:
        """The partitions claimed since the last call, with their state (None: none yet)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            ready, self._ready = self._ready, {}
            for partition in ready:
                self._wanted.pop(partition, None)
            return ready

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the claim under way (waiting up to ``timeout_s`` for it)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                partition, generation = self._queue.popleft()
                if self._wanted.get(partition) != generation:
                    continue  # taken away (or assigned again: a later entry claims it)
            try:
                checkpoint = self._claim(partition)
            except BaseException as exc:  # noqa: BLE001 - handed to the source thread
                with self._cond:
                    self._error = exc
                log.warning("input partition %d: restore failed: %s", partition, exc)
                return
            with self._cond:
                wanted = self._wanted.get(partition) == generation and not self._closed
                if wanted:
                    self._ready[partition] = checkpoint
            if not wanted:
                self._release(partition)
