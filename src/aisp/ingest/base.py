"""The source contract.

A ``Source`` is a config-only factory (cheap to build, safe to copy, no live resources).
``Source.open(ctx)`` returns a ``SourcePartition`` that owns the live reader:

* ``next_batch(max_rows)`` returns the next ``Batch`` of at most ``max_rows`` rows, or ``None``
  once the input is exhausted. It may return an empty batch when everything it read was invalid
  (those lines went to ``ctx.dead_letter``).
* ``snapshot()`` returns the position *after* the last row handed out, as plain JSON-able data;
  ``Source.open(ctx, resume_from=snapshot)`` continues from there, so a checkpoint holding state
  and this position replays exactly the rows that came later.
* ``commit(position)`` says a checkpoint holding ``position`` is durable (acks to a broker).
* ``close()`` releases the reader; it is called once, also after errors.

A source that several worker processes can share (``aisp run --workers N``) also cuts its
input into ``Split``s: ``splits(resume_from, rows)`` hands them out in order (and says the
position after those handed out, for checkpoints), and ``split_reader(ctx)`` reads one in
another process.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from aisp.batch import Batch

__all__ = [
    "DeadLetterRecord",
    "IdleClock",
    "Source",
    "SourceContext",
    "SourcePartition",
    "Split",
    "SplitReader",
    "Splits",
    "attach_traceparents",
]

DeadLetterRecord = dict[str, Any]


class IdleClock:
    """How long a broker source has had nothing to read, for ``stop_when_idle_s``: counted from
    its first empty read after rows were handed out, so the time the engine spends on those
    rows (pacing them out at ``--rate``, backpressure) is not idle input.

    >>> clock = IdleClock()
    >>> clock.handed_out(); clock.idle_s() < 0.01
    True
    """

    def __init__(self) -> None:
        self._since = time.monotonic()
        self._handed = False

    def handed_out(self) -> None:
        """Rows were handed out now."""
        self._handed = True

    def reset(self) -> None:
        """Not idle now, though nothing was read (a broker away, a partition being restored)."""
        self._since, self._handed = time.monotonic(), False

    def idle_s(self) -> float:
        """(At an empty read) seconds without input."""
        now = time.monotonic()
        if self._handed:
            self._since, self._handed = now, False
        return now - self._since


@dataclass(frozen=True)
class SourceContext:
    """What the engine hands a source partition."""

    step_id: str
    dead_letter: Callable[[list[DeadLetterRecord]], None]
    batch_rows: int = 2048
    on_assign: Callable[[list[int]], None] | None = None
    """For a source whose partitions are assigned by a group (Kafka): called with partitions
    newly assigned, whose state the engine then restores (in the background); the source reads
    none of their records until ``restored`` hands them back."""
    restored: Callable[[], dict[int, int | None]] | None = None
    """Called by the source between batches while partitions are being restored: those restored
    since, with the position to start each at (None: where the group says)."""
    on_revoke: Callable[[list[int]], None] | None = None
    """Called with partitions about to be taken away, after the last of their records was read."""


class SourcePartition(abc.ABC):
    """The live reader of a source (see the module docstring for the contract)."""

    @abc.abstractmethod
    def next_batch(self, max_rows: int) -> Batch | None: ...

    def snapshot(self) -> Any:
        return None

    def commit(self, position: Any) -> None:  # noqa: B027 - optional hook
        """A checkpoint covering everything up to ``position`` is durable: a broker source acks
        or commits up to there. Called between batches (the source is paused)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


@dataclass(frozen=True)
class Split:
    """A part of a source's input another process can read on its own: ``spec`` (plain data,
    for ``Source.split_reader``) and the number of events in it."""

    spec: dict[str, Any]
    rows: int


class Splits(abc.ABC):
    """A source's input cut into splits, handed out in order from a position."""

    @abc.abstractmethod
    def next(self) -> Split | None:
        """The next split, or None at the end of the input."""

    @property
    @abc.abstractmethod
    def position(self) -> Any:
        """The position after the splits handed out so far (``Source.open`` and
        ``Source.splits`` resume there)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


SplitReader = Callable[[dict[str, Any]], list[Batch]]
"""Reads the events of one split (``Split.spec``); what does not decode goes to the context's
dead letters."""


class Source(abc.ABC):
    """Config-only factory of ``SourcePartition``s.

    ``decode_heavy`` sources (JSON parsing) are run in a child process by the executor, so that
    their GIL-bound decoding runs in parallel with the rest of the pipeline: the one
    ``spawned()`` gives (a fresh interpreter), else a fork of the pipeline's process.
    """

    decode_heavy: ClassVar[bool] = False

    def spawned(self) -> Source | None:
        """The same input read and decoded by a fresh child interpreter (lighter than a fork
        of the pipeline's process), or None if this source has no such form."""
        return None

    @abc.abstractmethod
    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition: ...

    def describe(self) -> str:
        return type(self).__name__

    def column_names(self) -> list[str] | None:
        """The columns of the batches it reads, when known before reading."""
        return None

    def splits(self, resume_from: Any, rows: int) -> Splits | None:
        """The input cut into splits of about ``rows`` events, from ``resume_from``, for
        several workers; None: this source cannot be split."""
        return None

    def split_reader(self, ctx: SourceContext) -> SplitReader:
        """A reader of this source's splits, in another process (``splits`` says which)."""
        raise NotImplementedError(f"{self.describe()} cannot be split")


def attach_traceparents(batch: Batch, kept: npt.NDArray[np.int64], headers: list[Any]) -> Batch:
    """Set ``batch.traceparents`` from the ``traceparent`` header of each message (``headers``
    by message, None where absent; ``kept``: the messages that became rows, in row order)."""
    found = {
        int(eid): h.decode() if isinstance(h, bytes) else str(h)
        for eid, i in zip(batch.ids.tolist(), kept.tolist(), strict=True)
        if (h := headers[i]) is not None
    }
    batch.traceparents = found or None
    return batch
