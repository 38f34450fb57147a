"""Keyed state checkpointed per input partition, so it moves with partitions between processes.

Several processes of one Kafka consumer group (on one machine, to use more cores) share a
directory; each input partition has its own checkpoint store there (``p-<partition>/``, the
same verified format as ``CheckpointStore``) holding the state of the keys that arrive from that
partition and the partition's position. The process that owns a partition holds its store's
lock: a partition newly assigned is claimed (waiting while its previous owner still flushes it)
and its newest checkpoint loaded; a partition taken away is checkpointed first (its state is
flushed), then released and its keys dropped from memory. Partition and state are written
together, so whoever owns a partition next starts exactly where its state was taken.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from aisp.errors import AispError, StateError
from aisp.state.checkpoint import Checkpoint, CheckpointStore

__all__ = ["PartitionStateStore", "PartitionStates"]


class PartitionStateStore(Protocol):
    """Where keyed state that follows input partitions is kept: a directory the group's
    processes share (``PartitionStates``), or changelog topics on the input's broker
    (``aisp.connectors.kafka.changelog.ChangelogStates``)."""

    @property
    def owned(self) -> list[int]: ...

    written_before_outputs: bool
    """Whether a partition's state may be written before the outputs it covers are durable: its
    restore takes only what the group's committed offset reached (changelogs), so it is written
    before anything commits offsets (a transactional Kafka output commits them with its outputs);
    else (a shared directory, whose restore starts at the offset written) after the outputs."""

    def claim(self, partition: int) -> Checkpoint | None:
        """Take ``partition`` over; its state and position (``meta["offset"]``), if any."""
        ...

    def write(self, partition: int, tables: dict[str, pa.Table], meta: dict[str, Any]) -> bool:
        """Checkpoint an owned partition: ``keys.<space>`` and ``op.<step>`` tables, ``meta``
        with ``offset`` (its input position) and ``spaces`` (each step's key space)."""
        ...

    def release(self, partition: int) -> None: ...

    def stats(self) -> dict[str, float]:
        """Counters for the run summary (``claimed``: partitions taken over, ...)."""
        ...

    def close(self) -> None: ...


class PartitionStates:
    """The per-partition checkpoint stores under ``root`` (see the module docstring)."""

    written_before_outputs = False

    def __init__(self, root: str | Path, *, keep: int = 3, claim_timeout_s: float = 60.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._keep = keep
        self._claim_timeout_s = claim_timeout_s
        self._stores: dict[int, CheckpointStore] = {}
        self._lock = threading.Lock()  # writes and releases of one partition never interleave
        self._claimed = 0

    @property
    def owned(self) -> list[int]:
        with self._lock:
            return sorted(self._stores)

    def claim(self, partition: int) -> Checkpoint | None:
        """Take ``partition`` over: wait for its lock (the previous owner may still be flushing
        it), then return its newest verified checkpoint (None: it has none yet)."""
        store = CheckpointStore(self.root / f"p-{partition}", keep=self._keep)
        deadline = time.monotonic() + self._claim_timeout_s
        while True:
            try:
                store.lock()
                break
            except AispError as exc:
                if time.monotonic() > deadline:
                    waited = f"{self._claim_timeout_s:g} s"
                    raise StateError(
                        f"input partition {partition}'s state stayed locked for {waited}: {exc}"
                    ) from exc
                time.sleep(0.1)
        with self._lock:
            self._stores[partition] = store
            self._claimed += 1
        return store.latest()

    def stats(self) -> dict[str, float]:
        return {"claimed": self._claimed}

    def write(self, partition: int, tables: dict[str, pa.Table], meta: dict[str, Any]) -> bool:
        """Checkpoint ``partition`` (when still owned; False when it was released meanwhile)."""
        with self._lock:
            store = self._stores.get(partition)
            if store is None:
                return False
            store.write(store.next_id(), tables, meta)
            return True

    def release(self, partition: int) -> None:
        with self._lock:
            store = self._stores.pop(partition, None)
        if store is not None:
            store.unlock()

    def close(self) -> None:
        for partition in self.owned:
            self.release(partition)
