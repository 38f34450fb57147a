"""Checkpoints on disk: operator state as Arrow IPC files, positions in a manifest written last.

A checkpoint is a directory ``chk-<id>`` under the store's root. Its tables (key spaces,
operator state) are Arrow IPC files; ``manifest.json`` holds the metadata (source positions,
sink positions, model versions) and every file's size and SHA-256, and is written last. Files
are fsynced, the directory is written under a temporary name and renamed into place, and the
root is fsynced, so a crash at any moment leaves either a complete checkpoint or none.

``latest()`` returns the newest checkpoint whose manifest parses and whose files all match
their digests; a corrupt or partial one is skipped with a warning, so the previous one is used.
Nothing is unpickled: Arrow and JSON only.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from aisp.errors import AispError
from aisp.observe.clock import wall_ms

__all__ = ["Checkpoint", "CheckpointStore"]

log = logging.getLogger("aisp.checkpoint")
MANIFEST = "manifest.json"
_PREFIX = "chk-"
_LOCKED: set[str] = set()  # lock files this process holds


class CorruptCheckpoint(AispError):
    """A checkpoint directory that is incomplete or does not match its manifest."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its id, metadata and tables."""

    id: int
    path: Path
    meta: dict[str, Any]
    tables: dict[str, pa.Table]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    """Writes and finds checkpoints under ``root`` (see the module docstring); keeps ``keep``."""

    def __init__(self, root: str | Path, *, keep: int = 3) -> None:
        if keep < 2:
            raise AispError(f"keep at least 2 checkpoints (a corrupt latest one falls back), got {keep}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Claim the directory for this process (until ``unlock`` or the process ends, however it
        ends): a second pipeline writing checkpoints here would interleave with this one's and
        corrupt both, so it gets a clear error instead. A POSIX record lock: forked workers do
        not inherit it, so none can keep it after a SIGKILL of the pipeline."""
        path = (self.root / ".lock").resolve()
        if str(path) in _LOCKED:  # record locks are per process: this process holds it already
            # (and it must not open the file to say so: closing any of its descriptors of the
            # file would drop the lock it holds)
            raise AispError(
                f"checkpoint directory {self.root} is in use by another pipeline of this process"
                f" (pid {os.getpid()}); give each pipeline its own --checkpoint-dir"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)  # this process holds no lock on it: nothing to drop
            raise AispError(
                f"checkpoint directory {self.root} is in use by another process (pid {holder});"
                " give each pipeline process its own --checkpoint-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _LOCKED.add(str(path))
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            _LOCKED.discard(str((self.root / ".lock").resolve()))
            os.close(self._lock_fd)  # closing releases the lock
            self._lock_fd = None

    def ids(self) -> list[int]:
        """Ids of the checkpoint directories present (complete or not), ascending."""
        names = [
            p.name[len(_PREFIX) :] for p in self.root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
        ]
        return sorted(int(n) for n in names if n.isdigit())

    def write(self, checkpoint_id: int, tables: dict[str, pa.Table], meta: dict[str, Any]) -> Path:
        """Write checkpoint ``checkpoint_id`` atomically; prune the oldest beyond ``keep``."""
        final = self.root / f"{_PREFIX}{checkpoint_id:010d}"
        tmp = self.root / f".{final.name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files = {}
        for name, table in tables.items():
            path = tmp / f"{name}.arrow"
            buf = pa.BufferOutputStream()
            with pa.ipc.new_file(buf, table.schema) as writer:
                writer.write_table(table)
            data = buf.getvalue()
            with path.open("wb") as fh:  # hashed from memory: no read-back
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            files[name] = {"file": path.name, "bytes": data.size, "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {"id": checkpoint_id, "created_unix_ms": wall_ms(), "files": files, "meta": meta}
        with (tmp / MANIFEST).open("wb") as fh:
            fh.write(msgspec.json.encode(manifest))
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        tmp.rename(final)
        _fsync_dir(self.root)
        for old in self.ids()[: -self.keep]:
            shutil.rmtree(self.root / f"{_PREFIX}{old:010d}", ignore_errors=True)
        return final

    def load(self, checkpoint_id: int) -> Checkpoint:
        """Read and verify one checkpoint; ``CorruptCheckpoint`` says what is wrong."""
        path = self.root / f"{_PREFIX}{checkpoint_id:010d}"
        try:
            manifest = msgspec.json.decode((path / MANIFEST).read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            raise CorruptCheckpoint(f"{path.name}: no readable manifest ({exc})") from exc
        tables = {}
        for name, entry in manifest.get("files", {}).items():
            file = path / entry["file"]
            intact = (
                file.is_file() and file.stat().st_size == entry["bytes"] and _sha256(file) == entry["sha256"]
            )
            if not intact:
                raise CorruptCheckpoint(f"{path.name}: {entry['file']} is missing or fails its SHA-256")
            with pa.memory_map(str(file)) as source:
                tables[name] = pa.ipc.open_file(source).read_all()
        return Checkpoint(int(manifest["id"]), path, dict(manifest.get("meta", {})), tables)

    def meta(self, checkpoint_id: int) -> dict[str, Any]:
        """The metadata in checkpoint ``checkpoint_id``'s manifest (its files not read nor
        verified: ``load`` does that); ``CorruptCheckpoint`` without a readable manifest."""
        path = self.root / f"{_PREFIX}{checkpoint_id:010d}" / MANIFEST
        try:
            return dict(msgspec.json.decode(path.read_bytes()).get("meta", {}))
        except (OSError, msgspec.DecodeError) as exc:
            raise CorruptCheckpoint(f"{path.parent.name}: no readable manifest ({exc})") from exc

    def latest(self) -> Checkpoint | None:
        """The newest verified checkpoint (corrupt ones are skipped with a warning), or None."""
        for checkpoint_id in reversed(self.ids()):
            try:
                return self.load(checkpoint_id)
            except CorruptCheckpoint as exc:
                log.warning("skipping checkpoint: %s", exc)
        return None

    def discard_from(self, checkpoint_id: int) -> None:
        """Remove the checkpoints numbered ``checkpoint_id`` and later (written by a worker for a
        checkpoint its coordinator never completed)."""
        for old in self.ids():
            if old >= checkpoint_id:
                shutil.rmtree(self.root / f"{_PREFIX}{old:010d}", ignore_errors=True)

    def next_id(self) -> int:
        ids = self.ids()
        return ids[-1] + 1 if ids else 1
