"""Window state in the state store, as a log of changes.

A window step's state is many small records, one per open window (``WindowsBase.changes``):
most checkpoints touch a fraction of them (a long window, sessions of quiet keys) and close
some. Each checkpoint therefore writes, under its version, the windows that changed (``R``,
their rows as Arrow IPC) and the serials of the windows that closed (``G``); now and then, when
the log since the last full state outgrows the state itself, the full state instead (``B``, a
base). A restore to version ``v`` reads the newest base at or before ``v`` and applies the
changes after it, in order: the last row of each window wins, closed windows go. Entries older
than the newest base that every kept checkpoint can reach from are deleted.

Names are ``<step>\\x1ewindows\\x1f`` + the version (8 bytes, big-endian, so they sort by
version) + the kind byte; each is written once.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.errors import StateError
from aisp.state.store import LmdbStateStore

__all__ = ["WindowLog"]

_VERSION = struct.Struct(">Q")
_BASE, _GONE, _ROWS = b"B", b"G", b"R"
MIN_BASE_ROWS = 4096
"""A base is due once the rows logged since the last one exceed the open windows, or this."""


def _prefix(step: str) -> bytes:
    return f"{step}\x1ewindows\x1f".encode()


def _ipc(columns: dict[str, npt.NDArray[Any]]) -> bytes:
    table = pa.table({name: pa.array(col) for name, col in columns.items()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _table(blob: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(blob)).read_all()


class WindowLog:
    """The window steps' state in ``store`` (see the module's docstring)."""

    def __init__(self, store: LmdbStateStore) -> None:
        self._store = store
        self._logged: dict[str, int] = {}  # rows logged since the step's last base
        self._bases: dict[str, list[int]] = {}  # versions of the step's bases, ascending

    def base_due(self, step: str, open_windows: int) -> bool:
        """Whether ``step``'s next write should be the full state (its first in this process:
        the log may have been cut short by a restore)."""
        logged = self._logged.get(step)
        return logged is None or logged > max(open_windows, MIN_BASE_ROWS)

    def write(
        self,
        version: int,
        step: str,
        columns: dict[str, npt.NDArray[Any]],
        gone: npt.NDArray[np.int64],
        *,
        base: bool,
        before: int = 0,
    ) -> None:
        """Write ``step``'s changes at ``version`` (``base``: ``columns`` is its whole state);
        ``before``: the oldest checkpoint still kept (what no kept one reads is deleted)."""
        head = _prefix(step) + _VERSION.pack(version)
        if base:
            self._store.write(version, [head + _BASE], [_ipc(columns)])
            self._bases.setdefault(step, []).append(version)
            self._logged[step] = 0
        else:
            names = [head + _ROWS, head + _GONE]
            self._store.write(version, names, [_ipc(columns), gone.astype("<i8").tobytes()])
            self._logged[step] = self._logged.get(step, 0) + len(columns["__uid"]) + len(gone)
        reachable = [b for b in self._bases.get(step, []) if b <= before]
        if reachable:  # every kept checkpoint restores from this base or a later one
            self._store.delete_range(_prefix(step), _prefix(step) + _VERSION.pack(reachable[-1]))
            self._bases[step] = [b for b in self._bases[step] if b >= reachable[-1]]

    def read(self, version: int, step: str) -> dict[str, npt.NDArray[Any]] | None:
        """``step``'s open windows at ``version``, as ``WindowsBase.snapshot`` gives them (None:
        nothing stored)."""
        prefix = _prefix(step)
        entries = [(_VERSION.unpack_from(name, len(prefix))[0], name[-1:], value)
                   for name, value in self._store.read(version, prefix)]  # fmt: skip
        bases = [v for v, kind, _ in entries if kind == _BASE]
        if not bases:
            if entries:
                raise StateError(f"the state store has changes of window step {step!r} but no base")
            return None
        start = bases[-1]
        self._bases[step] = bases  # the next write may delete up to one of them
        tables, gone = [], []
        for v, kind, value in entries:
            if v < start:
                continue
            if kind == _GONE:
                gone.append(np.frombuffer(value, dtype="<i8"))
            else:
                tables.append(_table(value))
        table = pa.concat_tables(tables, promote_options="permissive")
        uid = table.column("__uid").to_numpy()
        last = uid.shape[0] - 1 - np.unique(uid[::-1], return_index=True)[1]  # each window's newest row
        keep = np.sort(last[~np.isin(uid[last], np.concatenate(gone) if gone else [])])
        table = table.take(pa.array(keep))
        return {c: table.column(c).to_numpy() for c in table.column_names}
