"""Results of a batcher's model calls handed on in the order their batches were formed, though
several instances run them at once (``BatcherConfig(ordered=True)``).

Each batch gets a number when it is formed; a call that ends before the calls of earlier
batches leaves its result waiting; the call that completes the run of numbers hands on every
result it unblocks, in order, under one lock (so two threads never hand results on at once). A
failed call (its rows dead-lettered) takes its number with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from aisp.batch import Batch

__all__ = ["InOrder"]


class InOrder:
    """Numbers batches as they are formed and hands their results to ``emit`` in that order."""

    def __init__(self, emit: Callable[[Batch], None]) -> None:
        self._emit = emit
        self._formed = 0
        self._next_out = 0
        self._held: dict[int, Batch | None] = {}
        self._lock = threading.Lock()

    def number(self) -> int:
        """The next batch's number (the caller serialises the forming of batches)."""
        seq, self._formed = self._formed, self._formed + 1
        return seq

    def done(self, seq: int, result: Batch | None) -> None:
        """Batch ``seq``'s result (None: its call failed): handed on once every earlier batch's
        has been, with the results that were waiting for it."""
        with self._lock:
            self._held[seq] = result
            while self._next_out in self._held:
                ready = self._held.pop(self._next_out)
                self._next_out += 1
                if ready is not None:
                    self._emit(ready)
