"""The executor's settings, and the hook that follows each event through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aisp.batch import Batch
from aisp.transform.operators import Emit

__all__ = ["ExecutorOptions", "Lineage"]


@dataclass(frozen=True, kw_only=True)
class ExecutorOptions:
    """Executor settings. ``rate_events_per_s`` paces sources open-loop (0: as fast as possible)."""

    channel_capacity_rows: int = 8192
    source_batch_rows: int = 2048
    coalesce_rows: int = 8192
    """A task that fell behind takes the batches queued for it, up to this many rows, as one
    (``Channel.get``): per-batch costs shrink exactly when they would hold it back (0: never). A task with a
    model step never does: its batcher makes the batches, against its own capacity."""
    rate_events_per_s: float = 0.0
    paced_linger_ms: float = 1.0
    offload_sources: bool = True
    offload_sinks: bool = False
    workers: int = 1
    """Worker processes that share the pipeline by key (``aisp run --workers``; see
    ``schedule/workers/pool.py``); 1: the pipeline runs in this process."""
    state_max_keys: int = 0
    """With a state store: keep about this many keys per key space in memory (0: all); at a
    checkpoint, keys not seen for the longest are evicted (their state is in the store) and
    read back from the store when seen again."""

    @property
    def read_rows(self) -> int:
        """Rows a source reads at a time: ``source_batch_rows``; with a rate, at most about
        ``PACED_READ_S`` of input, since a source holding rows it paces out does not stop for a
        checkpoint's pause until they are out (at 300 events/s, 2048 rows would hold every
        checkpoint off for 7 s).

        >>> ExecutorOptions(rate_events_per_s=300).read_rows, ExecutorOptions().read_rows
        (15, 2048)
        """
        if self.rate_events_per_s <= 0:
            return self.source_batch_rows
        return max(1, min(self.source_batch_rows, int(self.rate_events_per_s * PACED_READ_S)))


PACED_READ_S = 0.05


class Lineage(Protocol):
    """Follows each event (by ``_id``) through the graph, so a caller can tell when it is done.

    An event starts with one open branch. ``forwarded`` is told what an operator made of a batch
    before its outputs move on (a filter closes branches, a route to two ports opens one), and
    of every output that goes to several consumers, or to none;
    ``written`` that a sink took rows (each closes a branch); ``failed`` that rows went to the
    dead-letter sink (each closes a branch, unless ``closes`` is False: an operator dead-lettered
    them itself, and ``forwarded`` closes their branch). Calls come from the executor's threads.
    """

    def forwarded(self, step: str, batch: Batch, outs: Emit) -> None: ...

    def written(self, step: str, batch: Batch) -> None: ...

    def failed(self, step: str, batch: Batch, reason: str, *, closes: bool = True) -> None: ...
