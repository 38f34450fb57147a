"""A served model and the requests waiting on it: what ``ModelServer`` keeps per model and per
request, and how a request's waiter (a thread or an event loop) is woken."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.errors import RequestError
from aisp.infer.batching.batcher import DynamicBatcher
from aisp.infer.batching.config import BatcherConfig
from aisp.infer.models.versions import ServedModel
from aisp.infer.runtimes.base import Runtime
from aisp.serve.models.stats import ModelStats
from aisp.serve.oip.request import signature_of
from aisp.serve.oip.tensors import REQ, ROW, Gathered, reshaped, row_shapes, tensor_batch

__all__ = ["InferResult", "Pending", "RequestFailed", "Served", "resolve", "wake"]


class RequestFailed(RequestError):
    """An accepted request did not complete; ``reason`` says why, and sets the status: shed or
    overloaded (429, retriable), a timeout or passed deadline (504), the model unloaded or the
    server stopping (503), the model call failing (500: a fault of the server or the model)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.overloaded = reason in ("shed", "overloaded")
        timed_out = reason.startswith(("timeout", "deadline"))
        self.retriable = self.overloaded or timed_out or reason == "unavailable"
        if self.overloaded:
            self.http_status, self.grpc_code = 429, "RESOURCE_EXHAUSTED"
        elif timed_out:
            self.http_status, self.grpc_code = 504, "DEADLINE_EXCEEDED"
        elif reason == "unavailable":
            self.http_status, self.grpc_code = 503, "UNAVAILABLE"
        else:
            self.http_status, self.grpc_code = 500, "INTERNAL"


class InferResult(msgspec.Struct):
    model: str
    version: str
    outputs: dict[str, npt.NDArray[Any]]


class Pending(msgspec.Struct):
    """A request the server waits on: rows done so far, outputs, and its waiter."""

    rows: int
    future: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    outputs: dict[str, npt.NDArray[Any]] = {}  # noqa: RUF012 - msgspec copies it per instance
    done_rows: int = 0
    version: str = ""
    error: str | None = None
    event: threading.Event | None = None  # thread callers wait on it; asyncio ones on ``future``
    on_done: Callable[[Pending], None] | None = None  # or this, by whoever finishes it (``collect``)
    started_ns: int = 0  # perf_counter_ns when it was gathered
    counted: bool = False  # in the model's request statistics already (answered inline)


class Served:
    """One loaded model, its signature, its batcher and its statistics. The batcher's results go
    to ``emit``, its failures to ``dead_letter``, and ``on_batch(model, rows)`` hears of every
    model call."""

    def __init__(
        self,
        model: ServedModel,
        config: BatcherConfig | None,
        *,
        emit: Callable[[Batch], None],
        dead_letter: Callable[[Batch, str], None],
        on_batch: Callable[[str, int], None],
    ) -> None:
        self.model = model
        self.signature = signature_of(model)
        self.stats: dict[str, ModelStats] = {}
        self.gathers: dict[asyncio.AbstractEventLoop, list[Gathered]] = {}
        """Asyncio requests of the current turn of each event loop (see ``infer_async``): the
        HTTP server's loop and the gRPC server's."""
        self._phase_ns = threading.local()
        self.batcher = DynamicBatcher(
            model,
            config or model.config.batcher,
            prepare=self._prepare,
            finish=self._finish,
            emit=emit,
            dead_letter=dead_letter,
            on_batch=self._batched,
        )
        self._on_batch = on_batch
        self.batcher.start()

    def stats_of(self, version: str) -> ModelStats:
        s = self.stats.get(version)
        if s is None:
            s = self.stats.setdefault(version, ModelStats(self.model.name, version))
        return s

    def _batched(self, rows: int, wait_ns: int, compute_ns: int, _work_ns: int) -> None:
        t = self._phase_ns
        self.stats_of(t.version).batch(rows, wait_ns, t.input_ns, compute_ns, t.output_ns)
        self._on_batch(self.model.name, rows)

    def run_now(
        self, items: Sequence[Gathered], rows: int, max_cost_ns: int
    ) -> tuple[list[dict[str, npt.NDArray[Any]]], str] | None:
        """The ``rows`` rows of ``items`` (one per-row shape, at most a batch) in one model call
        in the caller's thread, when the model is idle and the call is expected to take at most
        ``max_cost_ns``: (each item's outputs, version); None, having done nothing, otherwise.
        Arrays in, arrays out: no batch is built. A failing model raises."""
        if not self.batcher.claim_inline(rows, max_cost_ns=max_cost_ns):
            return None
        start = time.perf_counter_ns()
        try:
            inputs = {}
            for name in self.model.input_names:
                parts = [it.inputs[name] for it in items]
                inputs[name] = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))
        except BaseException:
            self.batcher.release_claim()
            raise
        input_ns = time.perf_counter_ns() - start
        outputs, runtime, compute_ns = self.batcher.run_arrays(inputs, rows)
        start = time.perf_counter_ns()
        if len(items) == 1:
            each = [dict(outputs)]
        else:
            each, end = [], 0
            named = list(outputs.items())
            for it in items:
                first, end = end, end + it.rows
                each.append({name: arr[first:end] for name, arr in named})
        version = str(runtime.version)
        self.stats_of(version).batch(rows, 0, input_ns, compute_ns, time.perf_counter_ns() - start)
        self._on_batch(self.model.name, rows)
        return each, version

    def _prepare(self, batch: Batch) -> dict[str, npt.NDArray[Any]]:
        start = time.perf_counter_ns()
        out = {}
        shapes = row_shapes(batch)
        for name in self.model.input_names:
            arr = batch.numpy(name)
            out[name] = np.ascontiguousarray(reshaped(arr, shapes.get(name)))
        self._phase_ns.input_ns = time.perf_counter_ns() - start
        return out

    def _finish(self, batch: Batch, outputs: Mapping[str, npt.NDArray[Any]], runtime: Runtime) -> Batch:
        start = time.perf_counter_ns()
        rb = batch.record_batch
        named: list[tuple[str, Any]] = [(REQ, rb.column(REQ)), (ROW, rb.column(ROW))]
        named += [(f"out:{name}", arr) for name, arr in outputs.items()]
        named.append(("_version", np.full(batch.num_rows, int(runtime.version), dtype=np.int64)))
        out = tensor_batch(named)
        self._phase_ns.output_ns = time.perf_counter_ns() - start
        self._phase_ns.version = str(runtime.version)
        return out


def wake(done: Sequence[Pending]) -> None:
    """Wake the waiters of finished requests: threads directly, each event loop once."""
    loops: dict[asyncio.AbstractEventLoop, list[Pending]] = {}
    for p in done:
        if p.event is not None:
            p.event.set()
        elif p.on_done is not None and p.loop is None:
            resolve((p,))
        elif p.loop is not None:
            loops.setdefault(p.loop, []).append(p)
    if not loops:
        return
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, ps in loops.items():
        if loop is running:  # an inline call: already on the loop's thread
            resolve(ps)
            continue
        try:
            loop.call_soon_threadsafe(resolve, ps)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


_ONCE = threading.Lock()


def resolve(ps: Sequence[Pending]) -> None:
    """(The waiter's loop, or any thread for a ``collect``ed request) tell the waiters of
    finished requests: a callback once, whoever finishes the request first."""
    for p in ps:
        if p.on_done is not None:
            with _ONCE:
                done, p.on_done = p.on_done, None
            if done is not None:
                done(p)
        elif p.future is not None and not p.future.done():
            p.future.set_result(None)
