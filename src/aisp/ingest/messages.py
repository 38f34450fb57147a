"""Broker messages to a batch: the one sequence every broker source runs on what it read.

Each message is one event as JSON (or, with the schema ``RawMessage``, as raw bytes: an image, an
audio chunk). ``MessageDecoder.batch`` decodes a read's messages with the pipeline's schema,
dead-letters the ones that do not parse (with the message's position in its
broker and the reason), keeps the engine ids of the others and their ``traceparent`` headers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.ingest.base import SourceContext, attach_traceparents
from aisp.ingest.decode import ColumnarDecoder

__all__ = ["MessageDecoder"]


class MessageDecoder:
    """Decodes messages for the source step of ``ctx`` (``empty``: a batch of no rows with the
    schema's columns, for a read that found nothing new)."""

    def __init__(self, schema: type[msgspec.Struct], ctx: SourceContext) -> None:
        self._decoder = ColumnarDecoder(schema)
        self._ctx = ctx
        self.empty = Batch.from_columns(self._decoder.decode([]).columns)

    def batch(
        self,
        lines: Sequence[bytes],
        ids: npt.NDArray[np.int64],
        where: Callable[[int], dict[str, Any]],
        traceparents: Sequence[Any] | None = None,
        empty_reason: str | None = None,
    ) -> Batch:
        """The rows of ``lines`` that parse, with their ``ids`` (one per message). A message that
        does not parse is dead-lettered as ``{**where(i), "step", "reason", "raw"}`` (``where``:
        its position, e.g. partition and offset; ``empty_reason``: the reason for an empty one).
        ``traceparents``: each message's header, None where absent."""
        now = time.monotonic_ns()
        decoded = self._decoder.decode(lines)
        if decoded.errors:
            step = self._ctx.step_id
            self._ctx.dead_letter(
                [
                    {
                        **where(e.index),
                        "step": step,
                        "reason": empty_reason if empty_reason and not lines[e.index] else e.reason,
                        "raw": lines[e.index].decode("utf-8", "replace"),
                    }
                    for e in decoded.errors
                ]
            )
        kept = np.arange(len(lines)) if decoded.kept is None else decoded.kept
        batch = Batch.from_columns(decoded.columns, ids=ids[kept], ingest_ns=now)
        if traceparents is not None and any(t is not None for t in traceparents):
            attach_traceparents(batch, kept, list(traceparents))
        return batch
