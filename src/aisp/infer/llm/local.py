"""An LLM in this process (llama-cpp-python), behind the same interface as ``OpenAIClient``.

``LocalLlama`` loads a GGUF model (default: the packaged SmolLM2-135M-Instruct) and generates
one stream at a time on a thread of its own, a token at a time: the model's chat template makes
the prompt, each token is sampled (greedy at temperature 0) until an end-of-generation token or
``max_tokens``, and ``detok.TokenText`` turns the tokens into text as they come (a character
split across tokens is held until complete, never sent as U+FFFD). Each piece reaches the LLM
step's event loop as it is made; the generation counts real tokens. No server, no HTTP: for a
single machine with a small model. It competes with the pipeline for the cores
(``n_threads``), where a server would run beside it.
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
from aisp.infer.llm.detok import TokenText

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
        self._template = self._chat_template()
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

    def _chat_template(self) -> Any:
        """The model's own chat template (its GGUF metadata), as llama-cpp-python builds it."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self._llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ConfigError("the model has no chat template (tokenizer.chat_template in its GGUF metadata)")
        model = self._llm._model  # noqa: SLF001 - token texts, as Llama itself reads them
        eos, bos = self._llm.token_eos(), self._llm.token_bos()
        return Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos],
        )

    def _prompt(self, messages: list[dict[str, str]]) -> list[int]:
        made = self._template(messages=messages)
        return list(
            self._llm.tokenize(made.prompt.encode("utf-8"), add_bos=not made.added_special, special=True)
        )

    def _decode(self, ids: list[int]) -> str:
        return self._llm.detokenize(ids).decode("utf-8", "replace")

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        messages: list[dict[str, str]],
        on_piece: Callable[[str], None],
        max_tokens: int,
        deadline_ns: int | None,
    ) -> Generation:
        import llama_cpp

        sent = time.monotonic_ns()
        parts: list[str] = []
        first = tokens = 0
        finish = "length"
        text = TokenText(self._decode)

        def send(piece: str) -> None:
            nonlocal first
            if piece:
                first = first or time.monotonic_ns()
                parts.append(piece)
                loop.call_soon_threadsafe(on_piece, piece)

        try:
            prompt = self._prompt(messages)
            vocab = self._llm._model.vocab  # noqa: SLF001
            for token in self._llm.generate(prompt, temp=self.temperature, top_k=40, top_p=0.95, min_p=0.05):
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    finish = "stop"
                    break
                tokens += 1
                send(text.feed([token]))
                if deadline_ns is not None and time.monotonic_ns() > deadline_ns:
                    finish = "deadline"
                    break
                if tokens >= max_tokens:
                    break
            send(text.end())
        except Exception as exc:  # noqa: BLE001 - the row's dead letter says what failed
            raise LlmError(f"{type(exc).__name__}: {exc}", tokens=tokens) from None
        if finish == "deadline":
            raise LlmError("deadline passed during generation", tokens=tokens)
        now = time.monotonic_ns()
        return Generation(
            text="".join(parts), pieces=len(parts), completion_tokens=tokens, prompt_tokens=len(prompt),
            finish_reason=finish, endpoint="local", attempts=1, sent_ns=sent, first_ns=first or now,
            done_ns=now,
        )  # fmt: skip
