"""What several worker processes need to share one keyed pipeline (``schedule/workers/pool.py``):
a stable key hash, the blocks a file is cut into, batches as bytes on a pipe, the messages
between the processes, and the plan (which source is split, which column routes rows).

``key_owner`` sends every row of a key to the same worker in every process and every run: the
hash depends only on the key's bytes (a polynomial over the UTF-8 bytes, computed for a whole
column at once with numpy over the Arrow buffers, then a 64-bit finaliser), never on Python's
per-process ``hash``.

The input is cut by the source (``Source.splits``: a file into blocks of whole lines, a
generator into ranges of events).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.graph import Graph
from aisp.ingest.base import Source

__all__ = [
    "ExchangePlan",
    "Pipes",
    "batch_from_bytes",
    "batch_to_bytes",
    "key_hash",
    "key_owner",
    "plan_exchange",
]

_P = np.uint64(0x100000001B3)  # odd: invertible modulo 2**64
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_LEN = np.uint64(0x9E3779B97F4A7C15)

_powers = np.ones(1, dtype=np.uint64)
_inverse = np.ones(1, dtype=np.uint64)


def _powers_to(n: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """``P**i`` and ``P**-i`` (mod 2**64) for ``i < n``, grown as needed and kept."""
    global _powers, _inverse
    if _powers.shape[0] < n:
        size = max(n, 2 * _powers.shape[0], 4096)
        _powers, _inverse = np.full(size, _P, dtype=np.uint64), np.full(size, _P_INV, dtype=np.uint64)
        _powers[0] = _inverse[0] = 1
        with np.errstate(over="ignore"):
            np.cumprod(_powers, out=_powers)
            np.cumprod(_inverse, out=_inverse)
    return _powers, _inverse


def _finalise(h: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(33))
        h = h * _MIX1
        h = h ^ (h >> np.uint64(33))
        h = h * _MIX2
        return h ^ (h >> np.uint64(33))


def key_hash(column: pa.Array | pa.ChunkedArray) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of each value, the same in every process and run.

    Integers hash their value; strings and binaries their bytes; other types their text
    (``cast`` to string). A null hashes as the empty string.

    >>> a = key_hash(pa.array(["u1", "u2", "u1"]))
    >>> bool(a[0] == a[2]), bool(a[0] == a[1])
    (True, False)
    >>> bool(key_hash(pa.array(["x", "u1"]).slice(1))[0] == a[0])
    True
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    if pa.types.is_integer(t) and column.null_count == 0:
        return _finalise(column.to_numpy(zero_copy_only=False).astype(np.uint64))
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return _bytes_hash(column, np.int32)
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return _bytes_hash(column, np.int64)
    return key_hash(column.cast(pa.string()))


def _bytes_hash(column: pa.Array, offset_type: type[np.integer]) -> npt.NDArray[np.uint64]:
    n = len(column)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[column.offset : column.offset + n + 1].astype(
        np.int64
    )
    lo, hi = int(offsets[0]), int(offsets[-1])
    data = (
        np.frombuffer(data_buf, dtype=np.uint8)[lo:hi]
        if data_buf is not None and hi > lo
        else np.empty(0, np.uint8)
    )
    offsets -= lo
    if column.null_count:  # a null's bytes (if any) do not count
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        ends = np.where(valid, offsets[1:], offsets[:-1])
    else:
        ends = offsets[1:]
    starts = offsets[:-1]
    powers, inverse = _powers_to(data.shape[0] + 1)
    with np.errstate(over="ignore"):
        prefix = np.empty(data.shape[0] + 1, dtype=np.uint64)
        prefix[0] = 0
        np.cumsum(data.astype(np.uint64) * powers[: data.shape[0]], out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * inverse[starts]  # sum of b[i] * P**(i - start)
        h = h + (ends - starts).astype(np.uint64) * _LEN
    return _finalise(h)


def key_owner(column: pa.Array | pa.ChunkedArray, workers: int) -> npt.NDArray[np.int64]:
    """The worker (``0..workers-1``) that owns each row's key."""
    return (key_hash(column) % np.uint64(workers)).astype(np.int64)


def batch_to_bytes(batch: Batch) -> bytes:
    """A batch as an Arrow IPC stream (schema included: no state between messages)."""
    sink = pa.BufferOutputStream()
    rb = batch.record_batch
    with pa.ipc.new_stream(sink, rb.schema) as writer:
        writer.write_batch(rb)
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


def batch_from_bytes(data: bytes | memoryview) -> Batch:
    """The batch ``batch_to_bytes`` wrote (its columns map the bytes without a copy)."""
    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        return Batch(reader.read_next_batch())


# -- messages: a tag byte, then these fields -----------------------------------------------------
# coordinator -> worker: R (READ) read a block: the source's split; K (PAIR) checkpoint k at block B;
# E (ONE) the input ends at block B. worker -> coordinator: O (LINES) encoded rows of a sink,
# A (SINK) a batch for a sink, D dead letters (JSON), S lines that did not decode (dead letters,
# JSON), C (ONE) a block's part was taken, K (ACK) checkpoint k taken or not, M a snapshot of
# the worker's pipeline (JSON, ``observe.remote.snapshot``), F the worker's result (JSON),
# X an error.
# worker -> worker: P (ONE) a block's part (Arrow IPC; none when empty).
READ = struct.Struct("<I")  # block, then the split (JSON)
PAIR = struct.Struct("<II")
ONE = struct.Struct("<I")
LINES = struct.Struct("<HI")  # sink index, rows
SINK = struct.Struct("<H")
ACK = struct.Struct("<I?")
PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class ExchangePlan:
    """How a graph is shared by workers: its source (one that splits) and the column rows are
    routed by."""

    source_step: str
    source: Source
    key: str | None
    sinks: tuple[str, ...]


def plan_exchange(graph: Graph) -> ExchangePlan:
    """Check that ``graph`` can run on several workers and say how; ``ConfigError`` says why not."""
    sources = [n for n in graph.nodes if n.kind == "source"]
    source = sources[0].spec if len(sources) == 1 else None
    if source is None or type(source).splits is Source.splits:
        described = ", ".join(n.spec.describe() for n in sources)
        raise ConfigError(
            "--workers N needs one source that can be split (a JSON-lines file, a generator);"
            f" this pipeline reads {described}"
        )
    keys = sorted({n.spec.column for n in graph.nodes if n.kind == "key_by"})
    if len(keys) > 1:
        raise ConfigError(f"--workers N routes rows by one key; this pipeline is keyed by {keys}")
    key = keys[0] if keys else None
    fields = source.column_names()
    if key is not None and fields is not None and key not in fields:
        raise ConfigError(
            f"--workers N routes rows by the key_by column {key!r} as read from the input; it is not a"
            f" column of {source.describe()} ({', '.join(sorted(fields))})"
        )
    sinks = tuple(sorted(n.step_id for n in graph.nodes if n.kind == "sink"))
    return ExchangePlan(sources[0].step_id, source, key, sinks)


@dataclass
class Pipes:
    """One worker's ends: control from the coordinator, results to it, parts from and to peers."""

    control: Connection
    results: Connection
    from_peers: dict[int, Connection]
    to_peers: dict[int, Connection]
