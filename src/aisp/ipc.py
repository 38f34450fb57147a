"""Inter-process plumbing shared by the process-offloaded sources and sinks."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

__all__ = ["report_error", "set_pipe_size", "worker_init"]

PR_SET_PDEATHSIG = 1  # Linux prctl: signal this process when its parent dies
F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity
F_GETPIPE_SZ = 1032


def set_pipe_size(conn: Connection | int, size_bytes: int) -> int:
    """Grow the pipe behind ``conn`` to ``size_bytes`` (capped by the system limit); returns the size.

    Unprivileged processes may not exceed ``/proc/sys/fs/pipe-max-size``; the request is capped
    there. A failure keeps the default size (64 KiB), which works, with less decoupling.
    """
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        limit = size_bytes
    fd = conn if isinstance(conn, int) else conn.fileno()
    try:
        return int(fcntl.fcntl(fd, F_SETPIPE_SZ, min(size_bytes, limit)))
    except OSError:
        return int(fcntl.fcntl(fd, F_GETPIPE_SZ))


def _die_with_parent() -> None:
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipes still end the worker
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def report_error(conn: Connection, exc: BaseException) -> None:
    """From a worker process: send ``X`` + the error to the parent, if it still listens."""
    try:
        conn.send_bytes(b"X" + f"{type(exc).__name__}: {exc}".encode())
    except OSError:
        pass


def worker_init(*parent_ends: Connection) -> None:
    """First thing in a forked worker: close the parent's ends of the pipes, die with the
    parent, leave stopping to it, and tune the GC.

    The fork duplicates the parent's pipe ends; the worker closes them (``parent_ends``), or it
    would keep its own pipes open and never see the parent go. If the parent is killed
    (SIGKILL), the kernel kills the worker too (``PR_SET_PDEATHSIG``), so no orphan lingers.
    Ctrl-C reaches every process of the terminal's group; the parent turns it into a drain and
    then closes the worker's pipe, so the worker ignores SIGINT/SIGTERM instead of dying
    mid-batch. The inherited heap is frozen so collections do not rescan it.
    """
    for conn in parent_ends:
        conn.close()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
