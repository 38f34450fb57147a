"""An OpenAI-compatible streaming LLM client: the runtime of the ``llm`` step (``aisp.infer.llm.stage``).

``OpenAIClient`` streams generations from ``/v1/chat/completions`` or ``/v1/completions``
(``stream: true``, server-sent events) of any OpenAI-compatible server: vLLM, llama.cpp's
server, llama-cpp-python, a hosted API. With several endpoints each request goes to the one
with the fewest requests in flight, among those with a free slot (``concurrency`` each) whose
circuit breaker lets calls through. A request that fails before its first token (refused
connection, 5xx, 429, no first token within ``first_token_timeout_s``) is tried again after a
backoff with full jitter, on another endpoint where there is one; once a token went out it is
never tried again (its reader would see text twice): the request ends with the error.

Calls run on one asyncio event loop (the step's); ``free`` and ``capacity`` may be read from
any thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from aisp.errors import ConfigError, ModelError
from aisp.infer.runtimes.endpoints import BreakerConfig, Endpoint, EndpointPool, RetryPolicy
from aisp.retry import RETRIES
from aisp.secrets import read_secret

if TYPE_CHECKING:
    import httpx

__all__ = ["Generation", "LlmClient", "LlmError", "OpenAIClient"]

log = logging.getLogger("aisp.llm")

_RETRIABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class LlmError(ModelError):
    """A generation failed; ``tokens`` pieces had been streamed before it did."""

    def __init__(self, message: str, *, tokens: int = 0, retriable: bool = False) -> None:
        super().__init__(message)
        self.tokens, self.retriable = tokens, retriable


@dataclass(slots=True)
class Generation:
    """One finished generation and its timings (``time.monotonic_ns``)."""

    text: str
    pieces: int
    """Streamed pieces with text (a server sends about one per token)."""
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str
    endpoint: str
    attempts: int
    sent_ns: int
    """When the attempt that answered was sent."""
    first_ns: int
    done_ns: int


class LlmClient(Protocol):
    """What an LLM step calls: ``OpenAIClient`` (servers), ``LocalLlama`` (in this process)."""

    name: str
    version: str

    @property
    def capacity(self) -> int:
        """Generations it runs at once now."""
        ...

    def endpoints(self) -> list[dict[str, Any]]: ...

    async def generate(
        self,
        prompt: str,
        on_piece: Callable[[str], None],
        *,
        max_tokens: int | None = None,
        deadline_ns: int | None = None,
    ) -> Generation: ...

    async def aclose(self) -> None: ...


class OpenAIClient:
    """Streaming generation from the OpenAI-compatible servers at ``urls``.

    Args:
        urls: base URLs, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is added).
        model: the ``model`` field of each request ("" = the server's one model).
        api: ``"chat"`` (messages: ``system`` and the prompt as the user's turn) or
            ``"completions"`` (the prompt as it is).
        max_tokens, temperature, params: generation settings (``params`` adds any other
            field, e.g. ``{"top_p": 0.9, "seed": 1}``).
        concurrency: requests in flight per endpoint (a llama.cpp server with one slot: 1).
        first_token_timeout_s: an attempt with no first token by then fails (and is tried again).
        timeout_s: a whole generation.
        retry: attempts before the first token, and the backoff between them.
        breaker: per endpoint: opened by consecutive failures, tried again after ``reset_s``.
        api_key: sent as ``Authorization: Bearer``; or ``api_key_env`` (an environment
            variable that holds it) or ``api_key_file`` (a file that holds it: one trailing
            newline dropped), one of the three at most. Never printed or exported.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        model: str = "",
        api: str = "chat",
        system: str | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        params: Mapping[str, Any] | None = None,
        concurrency: int = 1,
        first_token_timeout_s: float = 30.0,
        timeout_s: float = 300.0,
        retry: RetryPolicy | None = None,
        breaker: BreakerConfig | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        api_key_file: str | None = None,
        name: str | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if api not in ("chat", "completions"):
            raise ConfigError(f"api must be 'chat' or 'completions', got {api!r}")
        if concurrency < 1 or max_tokens < 1:
            raise ConfigError(f"concurrency and max_tokens must be >= 1, got {concurrency}, {max_tokens}")
        self.model, self.api, self.system = model, api, system
        self.max_tokens, self.temperature = max_tokens, temperature
        self.params = dict(params or {})
        self.concurrency = concurrency
        self.first_token_timeout_s, self.timeout_s = first_token_timeout_s, timeout_s
        self.retry = retry or RetryPolicy(attempts=3, base_ms=50.0, max_ms=1000.0)
        self._pool: EndpointPool[httpx.AsyncClient] = EndpointPool(
            [u.rstrip("/") for u in urls], breaker or BreakerConfig(failures=3, reset_s=2.0),
            what="an LLM client", slots=concurrency,
        )  # fmt: skip
        api_key = read_secret("an LLM client", api_key, env=api_key_env, file=api_key_file)
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = name or f"llm:{model or 'default'}"
        self.version = ""
        self._path = "/v1/chat/completions" if api == "chat" else "/v1/completions"

    # -- capacity (any thread) ------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Requests in flight when every endpoint whose breaker is not open is busy."""
        return self._pool.capacity

    def endpoints(self) -> list[dict[str, Any]]:
        """Each endpoint's state, requests in flight and counts (for status pages)."""
        return [
            {"url": e.url, "state": e.breaker.state, "outstanding": e.outstanding,
             "requests": e.calls + e.outstanding, "failures": e.failures}
            for e in self._pool.endpoints
        ]  # fmt: skip

    # -- calls (the event loop) -----------------------------------------------------------------
    def body(self, prompt: str, max_tokens: int | None = None) -> dict[str, Any]:
        """The JSON body of a streaming request for ``prompt``."""
        body: dict[str, Any] = {
            "stream": True,
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": self.temperature,
            **self.params,
        }
        if self.model:
            body["model"] = self.model
        if self.api == "chat":
            messages = [{"role": "system", "content": self.system}] if self.system else []
            body["messages"] = [*messages, {"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def generate(
        self,
        prompt: str,
        on_piece: Callable[[str], None],
        *,
        max_tokens: int | None = None,
        deadline_ns: int | None = None,
    ) -> Generation:
        """Stream one generation, calling ``on_piece(text)`` for each piece as it arrives.

        Raises:
            LlmError: every attempt failed before the first token, the stream broke after it,
                or the request itself was refused (4xx: not tried again).
        """
        body = orjson.dumps(self.body(prompt, max_tokens))
        tried: set[str] = set()
        last: LlmError | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                await asyncio.sleep(self.retry.backoff_s(attempt))
            endpoint = self._pool.pick(tried)
            if endpoint is None:
                last = LlmError("no LLM endpoint is available (every breaker is open)", retriable=True)
                continue
            tried.add(endpoint.url)
            try:
                gen = await self._attempt(endpoint, body, on_piece, deadline_ns)
            except LlmError as exc:
                if not exc.retriable or exc.tokens:
                    raise
                last = exc
                RETRIES.note(self.name, str(exc).split(":", 1)[0])
                continue
            gen.attempts = attempt + 1
            return gen
        assert last is not None
        raise LlmError(f"{last} (after {self.retry.attempts} attempts)")

    async def _attempt(
        self,
        e: Endpoint[httpx.AsyncClient],
        body: bytes,
        on_piece: Callable[[str], None],
        deadline_ns: int | None,
    ) -> Generation:
        """One try on ``e`` (picked, its call counted, by the pool)."""
        import httpx  # (not at import: most pipelines have no LLM step)

        e.breaker.allow()  # an open breaker past its reset_s: this is its trial call
        state = _Stream(time.monotonic_ns(), e.url)
        end_s = time.monotonic() + self.timeout_s
        if deadline_ns is not None:
            end_s = min(end_s, deadline_ns / 1e9)
        ok = False
        try:
            if e.client is None:
                e.client = self._http(e.url)
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + (end_s - time.monotonic())):
                await self._read(e.client, body, state, on_piece)
            ok = True
        except LlmError:
            self._failed(e, state)
            raise
        except TimeoutError:
            self._failed(e, state)
            left_s = end_s - time.monotonic()  # > 0: the first token's limit, not the whole call's
            raise LlmError(
                f"timeout: no {'end' if state.pieces else 'first token'} from {e.url} in time",
                tokens=state.pieces, retriable=not state.pieces and left_s > 0,
            ) from None  # fmt: skip
        except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: a line that is not JSON
            self._failed(e, state)
            raise LlmError(
                f"{type(exc).__name__}: {e.url}: {exc}", tokens=state.pieces, retriable=not state.pieces
            ) from None
        finally:
            self._pool.end(e, failed=not ok)
        e.breaker.success()
        return state.finished()

    def _http(self, url: str) -> httpx.AsyncClient:
        import httpx

        return httpx.AsyncClient(
            base_url=url,
            headers={"content-type": "application/json", **self._headers},
            limits=httpx.Limits(
                max_connections=self.concurrency * 4, max_keepalive_connections=self.concurrency * 4
            ),
            timeout=httpx.Timeout(self.timeout_s, connect=5.0),
        )

    async def aclose(self) -> None:
        """Close the connections opened on the running loop (a later call opens new ones)."""
        for e in self._pool.endpoints:
            if e.client is not None:
                http, e.client = e.client, None
                await http.aclose()

    @staticmethod
    def _failed(e: Endpoint[httpx.AsyncClient], state: _Stream) -> None:
        if not state.pieces:  # a broken stream says little about the next request
            e.breaker.failure()

    async def _read(
        self, http: httpx.AsyncClient, body: bytes, state: _Stream, on_piece: Callable[[str], None]
    ) -> None:
        # the first token's limit covers the connection and the response's headers too
        async with asyncio.timeout(self.first_token_timeout_s) as first:
            async with http.stream("POST", self._path, content=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise LlmError(
                        f"HTTP {resp.status_code}: {detail}", retriable=resp.status_code in _RETRIABLE_STATUS
                    )
                # bytes split into lines here (httpx's text and line layers cost ~100 us a chunk)
                chunks: Any = resp.aiter_bytes()  # an async generator, closed here, not by the GC
                tail = b""
                async with aclosing(chunks):
                    async for chunk in chunks:
                        *lines, tail = (tail + chunk).split(b"\n")
                        for line in lines:
                            if state.take(line, self.api, on_piece):
                                first.reschedule(None)  # the first token came: the whole call's limit applies
                            if state.ended:
                                return
            if not state.ended:
                raise LlmError("stream ended without [DONE]", tokens=state.pieces, retriable=not state.pieces)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


class _Stream:
    """What one streaming response has brought so far."""

    __slots__ = ("completion_tokens", "ended", "endpoint", "finish_reason", "first_ns", "parts",
                 "pieces", "prompt_tokens", "sent_ns")  # fmt: skip

    def __init__(self, sent_ns: int, endpoint: str) -> None:
        self.sent_ns, self.endpoint = sent_ns, endpoint
        self.first_ns = 0
        self.parts: list[str] = []
        self.pieces = self.completion_tokens = self.prompt_tokens = 0
        self.finish_reason = ""
        self.ended = False

    def take(self, line: bytes, api: str, on_piece: Callable[[str], None]) -> bool:
        """Take one SSE line; True when it brought the first piece of text."""
        if not line.startswith(b"data:"):
            return False  # comments, event names, blank separators
        data = line[5:].strip()
        if data == b"[DONE]":
            self.ended = True
            return False
        msg = orjson.loads(data)
        if not isinstance(msg, dict):
            raise LlmError(f"not a JSON object in the stream: {data[:100]!r}", tokens=self.pieces)
        if "error" in msg:
            raise LlmError(f"server error: {str(msg['error'])[:300]}", tokens=self.pieces)
        usage = msg.get("usage")
        if isinstance(usage, dict):
            self.completion_tokens = _count(usage.get("completion_tokens"))
            self.prompt_tokens = _count(usage.get("prompt_tokens"))
        choices = msg.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        text = (
            (delta.get("content") if isinstance(delta, dict) else None)
            if api == "chat"
            else choice.get("text")
        )
        if not text or not isinstance(text, str):
            return False
        first = not self.pieces
        if first:
            self.first_ns = time.monotonic_ns()
        self.pieces += 1
        self.parts.append(text)
        on_piece(text)
        return first

    def finished(self) -> Generation:
        now = time.monotonic_ns()
        return Generation(
            text="".join(self.parts),
            pieces=self.pieces,
            completion_tokens=self.completion_tokens or self.pieces,
            prompt_tokens=self.prompt_tokens,
            finish_reason=self.finish_reason or "stop",
            endpoint=self.endpoint,
            attempts=1,
            sent_ns=self.sent_ns,
            first_ns=self.first_ns or now,
            done_ns=now,
        )
