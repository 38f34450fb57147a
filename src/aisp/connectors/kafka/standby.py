"""What a worker knows of a changelog partition (``ChangelogLog``), and standby replicas: warm
copies of partitions a worker does not own, kept by tailing their changelogs, so taking one
over reads only the tail.

A changelog record names the input offset its checkpoint covers; it counts once the group's
committed offset has reached that offset (an earlier record of its key is then superseded). A
record past the committed offset may be one whose commit never landed, so it is kept apart
until the committed offset passes it, or a later record of its key that counts supersedes it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aisp.connectors.kafka.client import CLIENT_SETTINGS

__all__ = ["ChangelogLog", "Standby", "ring"]

log = logging.getLogger("aisp.changelog")

OFFSET_BEGINNING = -2
END = b"\x00aisp-end"  # an end marker's key: no msgpack of a single key encodes to it
LAYOUT = b"\x00aisp-layout"  # the key of the record that gives the row layout of what follows
COVERS = 8
"""A live record's value starts with the input offset it covers (8 bytes, big-endian); a
tombstone carries it in its header ``o``."""

Record = tuple[int, int, bytes | None]
"""(changelog offset, input offset covered, value or None for a tombstone)."""


@dataclass
class ChangelogLog:
    """One changelog partition read up to ``next``: each key's last record that counts under
    ``settled`` (the committed input offset these were sorted by), the records after it that do
    not count yet, and the row layout last given."""

    next: int = OFFSET_BEGINNING
    settled: int | None = None
    final: dict[bytes, tuple[int, bytes | None]] = field(default_factory=dict)
    pending: dict[bytes, list[Record]] = field(default_factory=dict)
    layout: bytes | None = None
    records: int = 0

    def add_messages(self, messages: list[Any], token: bytes | None = None) -> bool:
        """Add consumed records in order; True once the end marker ``token`` was among them."""
        final, pending, settled = self.final, self.pending, self.settled
        frm = int.from_bytes
        n, last = 0, self.next - 1
        try:
            for m in messages:
                if m.error() is not None:
                    continue
                key: Any = m.key()
                value: Any = m.value()
                last = m.offset()
                if not key:
                    continue
                if key[0] == 0:  # engine records
                    if key == LAYOUT:
                        self.layout = value
                    elif key == END and token is not None and value == token:
                        return True
                    continue
                covers = frm(value[:COVERS], "big") if value is not None else int(m.headers()[0][1])
                n += 1
                if settled is not None and covers <= settled:
                    final[key] = (last, value)
                    pending.pop(key, None)
                else:
                    pending.setdefault(key, []).append((last, covers, value))
            return False
        finally:
            self.next = last + 1 if last >= 0 else self.next
            self.records += n

    def settle(self, committed: int | None) -> None:
        """Sort the pending records by the committed input offset ``committed``."""
        if committed is None or (self.settled is not None and committed <= self.settled):
            return
        self.settled = committed
        for key, records in list(self.pending.items()):
            counting = [r for r in records if r[1] <= committed]
            if counting:
                at, _, value = counting[-1]
                self.final[key] = (at, value)
                records = [r for r in records if r[0] > at and r[1] > committed]
            if records:
                self.pending[key] = records
            else:
                del self.pending[key]

    def resolve(self) -> tuple[list[bytes], list[bytes], set[bytes]]:
        """The live keys and their values (offset prefix included), and the keys with records
        that do not count (to be written over at the next checkpoint)."""
        keys = [k for k, (_, v) in self.final.items() if v is not None]
        final = self.final
        return keys, [final[k][1] for k in keys], set(self.pending)  # type: ignore[misc]


def ring(owned: list[int], partitions: int, k: int) -> set[int]:
    """The partitions a worker keeps warm copies of: ``k`` times as many as it owns (``k`` when
    it owns none), the first ones after its own in ring order that it does not own. When the
    workers own equal runs of partitions (a range assignment) or every n-th one (round robin),
    each partition then has ``k`` copies on the ``k`` workers before its owner.

    >>> sorted(ring([0, 1], 4, 1)), sorted(ring([2, 3], 4, 1)), sorted(ring([0, 2], 4, 1))
    ([2, 3], [0, 1], [1, 3])
    >>> sorted(ring([2, 3], 8, 2)), sorted(ring([], 4, 2)), sorted(ring([0], 3, 5))
    ([4, 5, 6, 7], [0, 1], [1, 2])
    """
    want = k * len(owned) if owned else k
    start = max(owned) + 1 if owned else 0
    mine = set(owned)
    out: set[int] = set()
    for i in range(partitions):
        p = (start + i) % partitions
        if len(out) >= want:
            break
        if p not in mine:
            out.add(p)
    return out


class Standby(threading.Thread):
    """Tails the changelogs of the partitions in ``want`` (see the module docstring)."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topic: str,
        topics: Any,
        *,
        refresh_s: float = 2.0,
        security: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name="aisp-standby", daemon=True)
        self._security = dict(security or {})  # the broker's login and TLS settings
        self._servers, self._group, self._topic = bootstrap, group, topic
        self._topics = topics  # () -> {step: changelog topic}
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._want: set[int] = set()
        self._warm: dict[tuple[str, int], ChangelogLog] = {}
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def want(self, partitions: set[int]) -> None:
        with self._lock:
            self._want = set(partitions)

    def take(self, partition: int) -> dict[str, ChangelogLog]:
        """Stop tailing ``partition``; its warm copies by changelog topic (empty: none)."""
        with self._lock:
            self._want.discard(partition)
            keys = [k for k in self._warm if k[1] == partition]
            return {name: self._warm.pop((name, p)) for name, p in keys}

    @property
    def warm(self) -> dict[int, int]:
        """Records read per partition kept warm."""
        with self._lock:
            out: dict[int, int] = {}
            for (_, p), c in self._warm.items():
                out[p] = out.get(p, 0) + c.records
            return out

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported; a standby is an optimisation
            self.error = exc
            log.warning("standby replicas stopped: %s", exc)

    def _run(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        common = {"bootstrap.servers": self._servers, "enable.auto.commit": False, **CLIENT_SETTINGS}
        common.update(self._security)
        # uncommitted records too: a dead worker's open transaction must not hold the copy back
        uncommitted = {"isolation.level": "read_uncommitted"}
        reader = Consumer({**common, **uncommitted, "group.id": f"{self._group}-standby"})
        offsets = Consumer({**common, "group.id": self._group})  # reads committed offsets only
        assigned: set[tuple[str, int]] = set()
        names: dict[str, str] = {}
        refreshed = settled = 0.0
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now - refreshed >= self._refresh_s:
                    names, refreshed = self._topics(), now
                with self._lock:
                    desired = {(name, p) for p in self._want for name in names.values()}
                    for gone in set(self._warm) - desired:
                        del self._warm[gone]
                    for new in desired - set(self._warm):
                        self._warm[new] = ChangelogLog()
                    starts = {k: self._warm[k].next for k in desired}
                if desired != assigned:
                    reader.assign([TopicPartition(n, p, starts[(n, p)]) for n, p in sorted(desired)])
                    assigned = desired
                if assigned and now - settled >= 1.0:  # sort what the group has committed since
                    parts = sorted({p for _, p in assigned})
                    tps = offsets.committed([TopicPartition(self._topic, p) for p in parts], timeout=10)
                    with self._lock:
                        for tp in tps:
                            for (_, p), c in self._warm.items():
                                if p == tp.partition and tp.offset >= 0:
                                    c.settle(tp.offset)
                    settled = now
                msgs = reader.consume(num_messages=10_000, timeout=0.2) if assigned else []
                if not assigned:
                    self._halt.wait(0.2)
                by_copy: dict[tuple[str, int], list[Any]] = {}
                for m in msgs:
                    by_copy.setdefault((m.topic() or "", m.partition() or 0), []).append(m)
                with self._lock:
                    for where, batch in by_copy.items():
                        copy = self._warm.get(where)
                        if copy is not None:  # not taken over meanwhile
                            copy.add_messages(batch)
        finally:
            reader.close()
            offsets.close()
