"""An LLM in this process (llama-cpp-python), behind the same interface as ``OpenAIClient``.

``LocalLlama`` loads a GGUF model (default: the packaged SmolLM2-135M-Instruct) and generates
one stream at a time on a thread of its own; each piece reaches the LLM step's event loop as it
is made. No server, no HTTP: for a single machine with a small model. It competes with the
pipeline for the cores (``n_threads``), where a server would run beside it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aisp.errors import ConfigError
from aisp.infer.llm.client import Generation, LlmError

__all__ = ["LocalLlama"]


class LocalLlama:
    """Chat completions from ``model`` (a GGUF file; None: ``packaged_smollm2()``) in this process."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        n_threads: int = 2,
        n_ctx: int = 2048,
        system: str | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        name: str = "llm:local",
    ) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise ConfigError("llama-cpp-python is not installed: pip install 'aisp[llm]'") from exc
        from aisp.infer.llm.server import packaged_smollm2

        path = Path(model) if model is not None else packaged_smollm2()
        self._llm = Llama(model_path=str(path), n_threads=n_threads, n_ctx=n_ctx, verbose=False)
        self.system, self.max_tokens, self.temperature = system, max_tokens, temperature
        self.name, self.version = name, path.name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aisp-llm-local")
        self._outstanding = self._requests = self._failures = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return 1

    def endpoints(self) -> list[dict[str, Any]]:
        return [{"url": "local", "state": "closed", "outstanding": self._outstanding,
                 "requests": self._requests, "failures": self._failures}]  # fmt: skip

    async def aclose(self) -> None:
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._llm.close()

    async def generate(
        self,
        prompt: str,
        on_piece: Callable[[str], None],
        *,
        max_tokens: int | None = None,
        deadline_ns: int | None = None,
    ) -> Generation:
        """Stream one generation (see ``OpenAIClient.generate``)."""
        loop = asyncio.get_running_loop()
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": prompt})
        with self._lock:
            self._outstanding += 1
            self._requests += 1
        try:
            return await loop.run_in_executor(
                self._pool, self._run, loop, messages, on_piece, max_tokens or self.max_tokens, deadline_ns
            )
        except LlmError:
            with self._lock:
                self._failures += 1
            raise
        finally:
            with self._lock:
                self._outstanding -= 1

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        messages: list[dict[str, str]],
        on_piece: Callable[[str], None],
        max_tokens: int,
        deadline_ns: int | None,
    ) -> Generation:
        sent = time.monotonic_ns()
        parts: list[str] = []
        first = 0
        finish = "stop"
        try:
            stream: Any = self._llm.create_chat_completion(
                messages=messages,  # type: ignore[arg-type]
                stream=True, max_tokens=max_tokens, temperature=self.temperature,
            )  # fmt: skip
            for chunk in stream:
                choice = chunk["choices"][0]
                text = choice.get("delta", {}).get("content")
                finish = choice.get("finish_reason") or finish
                if text:
                    first = first or time.monotonic_ns()
                    parts.append(text)
                    loop.call_soon_threadsafe(on_piece, text)
                if deadline_ns is not None and time.monotonic_ns() > deadline_ns:
                    finish = "deadline"
                    break
        except Exception as exc:  # noqa: BLE001 - the row's dead letter says what failed
            raise LlmError(f"{type(exc).__name__}: {exc}", tokens=len(parts)) from None
        if finish == "deadline":
            raise LlmError("deadline passed during generation", tokens=len(parts))
        now = time.monotonic_ns()
        return Generation(
            text="".join(parts), pieces=len(parts), completion_tokens=len(parts), prompt_tokens=0,
            finish_reason=finish, endpoint="local", attempts=1, sent_ns=sent, first_ns=first or now,
            done_ns=now,
        )  # fmt: skip
