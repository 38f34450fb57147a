"""What the image and audio operators share: their error, their counters and the threads they decode on.

``MediaError`` is an input that cannot be decoded; its message is the dead letter's reason, in
plain words (``plain`` takes out what a library's message says about Python objects, such as
``<_io.BytesIO object at 0x...>``).

``MediaCounters`` is kept by an image or audio step's spec and read off the graph as metrics
(``aisp.observe.export.operators``): items decoded and refused, bytes in, seconds spent
decoding (summed over the threads) and the pixels or samples made. ``run_sliced`` cuts a batch
into one slice per core and decodes the slices in parallel threads: libjpeg-turbo, OpenCV,
libsndfile and soxr release the GIL while they work, so one step's rows decode on every core.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import BadRequest
from aisp.transform.operators import OperatorContext

__all__ = [
    "MediaCounters",
    "MediaError",
    "binary_payloads",
    "cores",
    "dead_letter_rows",
    "plain",
    "run_sliced",
    "samples_column",
]

T = TypeVar("T")

_OBJECT = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>|\b0x[0-9a-fA-F]{6,}\b")


class MediaError(BadRequest, ValueError):
    """An input that cannot be decoded; the message is the dead letter's reason (a request that
    carried it is answered 400). A ``ValueError`` too, as decoders' own errors are."""


def plain(message: str) -> str:
    """A library's error message fit for a reason: without the reprs and addresses of Python
    objects (``Error opening <_io.BytesIO object at 0x7f...>: ...`` -> ``Error opening the
    input: ...``), spaces collapsed and the trailing full stop dropped.

    >>> plain("Error opening <_io.BytesIO object at 0x7f85a071a660>: Format not recognised.")
    'Error opening the input: Format not recognised'
    """
    text = " ".join(_OBJECT.sub("the input", message).split())
    return text.rstrip(".") or "unknown error"


def cores() -> int:
    """Threads a decoding step uses when its ``threads`` is 0: one per core this process may
    run on (its CPU affinity, as ``taskset`` or a container's cpuset sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def run_sliced(threads: int, rows: int, fn: Callable[[int, int], T], min_rows: int = 2) -> list[T]:
    """``fn(start, end)`` over ``rows`` cut into one contiguous slice per thread (at most
    ``threads``, at least ``min_rows`` rows a slice), in parallel; the results in slice order.

    The threads are started for the call and joined before it returns (the calling thread takes
    the first slice): starting one costs tens of microseconds against the milliseconds of a
    slice's decoding, and no thread outlives the batch, so a process that forks later (a source
    or sink offloaded to a child process) never finds one running.
    """
    parts = max(1, min(threads, rows // max(1, min_rows)))
    if parts == 1:
        return [fn(0, rows)]
    bounds = [rows * i // parts for i in range(parts + 1)]
    results: list[Any] = [None] * parts
    failed: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = fn(bounds[i], bounds[i + 1])
        except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
            failed.append(exc)

    helpers = [
        threading.Thread(target=work, args=(i,), name="aisp-decode", daemon=True) for i in range(1, parts)
    ]
    for t in helpers:
        t.start()
    work(0)
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]
    return results


def samples_column(parts: Sequence[npt.NDArray[Any]]) -> tuple[pa.ListArray, npt.NDArray[np.int64]]:
    """Each row's samples as one ``list<float32>`` column over a single buffer, and each row's
    count of samples."""
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32())), lengths


def binary_payloads(batch: Batch, column: str) -> list[bytes | None]:
    """A binary column's values (None where null); a column of another type is a
    ``ConfigError``: the pipeline is wired wrong, not the input bad."""
    from aisp.errors import ConfigError

    col = batch.column(column)
    if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or pa.types.is_null(col.type)):
        raise ConfigError(f"column {column!r} is {col.type}, not binary")
    values: list[bytes | None] = col.to_pylist()
    return values


def dead_letter_rows(ctx: OperatorContext, batch: Batch, bad: Sequence[tuple[int, str]]) -> None:
    """Send each ``(row, reason)`` of ``batch`` to the dead-letter sink, rows with the same
    reason together."""
    by_reason: dict[str, list[int]] = {}
    for row, reason in bad:
        by_reason.setdefault(reason, []).append(row)
    for reason, rows in by_reason.items():
        ctx.dead_letter(batch.take(rows), ctx.step_id, reason)


class MediaCounters:
    """What an image or audio step did (see the module docstring); ``unit`` is what it makes:
    ``pixels`` or ``samples``."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self._lock = threading.Lock()
        self.items = 0
        self.refused = 0
        self.bytes = 0
        self.decode_ns = 0
        self.units = 0

    def add(self, *, items: int, refused: int, nbytes: int, decode_ns: int, units: int) -> None:
        with self._lock:
            self.items += items
            self.refused += refused
            self.bytes += nbytes
            self.decode_ns += decode_ns
            self.units += units

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "unit": self.unit,
                "items": self.items,
                "refused": self.refused,
                "bytes": self.bytes,
                "decode_seconds": self.decode_ns / 1e9,
                "units": self.units,
            }
