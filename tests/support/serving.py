"""Start `aisp serve` as a real subprocess on free 127.0.0.1 ports, for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GRPC_SERVERS = ("native", "grpcio")
"""The gRPC transports (``aisp serve --grpc-server``): every gRPC test runs on both."""


@contextmanager
def aisp_serve(
    repo: Path,
    *,
    http: bool,
    grpc: bool,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    grpc_server: str = "auto",
) -> Iterator[tuple[dict[str, str], subprocess.Popen[str]]]:
    """Yields ({"http": "host:port", "grpc": "host:port"}, process); SIGTERM and reap at the end.
    ``grpc_server``: the gRPC transport."""
    cmd = [sys.executable, "-m", "aisp.cli", "serve", str(repo), *extra_args, "--grpc-server", grpc_server]
    cmd += ["--http-port", "0" if http else "-1", "--grpc-port", "0" if grpc else "-1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(extra_env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    addresses: dict[str, str] = {}
    try:
        while len(addresses) < http + grpc:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"aisp serve exited: {proc.stderr.read() if proc.stderr else ''}")
            kind, _, address = line.strip().partition(" ")
            addresses[kind] = address
        yield addresses, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)  # also closes the pipes


def wait_http(address: str, timeout_s: float = 30.0) -> None:
    """Wait until the HTTP server at ``address`` answers (its socket is bound before it serves)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{address}/v2/health/live", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise TimeoutError(f"no HTTP server at {address} after {timeout_s} s")


@contextmanager
def conformance_server(
    root: Path, *extra_args: str, grpc_server: str = "auto"
) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """``aisp serve`` over ``conformance_repository(root)`` on HTTP and gRPC (on the transport
    ``grpc_server``), ready: yields (http address, grpc address, process)."""
    from tests.support.models import conformance_repository

    repo = conformance_repository(root)
    with aisp_serve(repo, http=True, grpc=True, extra_args=extra_args, grpc_server=grpc_server) as (
        addresses,
        proc,
    ):
        wait_http(addresses["http"])
        yield addresses["http"], addresses["grpc"], proc
