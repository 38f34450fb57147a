"""The model server core, independent of the transport: models from a repository, each behind
its own dynamic batcher, so concurrent single-row requests are served in batches.

``ModelServer.infer`` submits a request's rows to the model's batcher and waits for them; the
rows of several requests share model calls, and a request larger than a batch is split and
reassembled by row. Requests carry a priority (tier) and an optional deadline that the batcher
honours; rows that time out or are shed fail their request with that reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.errors import AispError, BadRequest
from aisp.infer.batching.batcher import BatcherClosed, QueueFull
from aisp.infer.batching.config import BatcherConfig
from aisp.infer.models.repository import ModelRepository
from aisp.infer.models.versions import ServedModel
from aisp.serve.models.control import ModelControl
from aisp.serve.models.served import InferResult, Pending, RequestFailed, Served, resolve, wake
from aisp.serve.models.stats import ModelStats
from aisp.serve.oip.request import check_arrays
from aisp.serve.oip.tensors import (
    REQ,
    ROW,
    Gathered,
    empty_output,
    has_empty,
    request_batch,
    request_batches,
    row_shapes,
    shape_groups,
)

__all__ = ["InferResult", "ModelServer", "ModelStats", "RequestFailed"]

log = logging.getLogger("aisp.serve")


class ModelServer(ModelControl):
    """Serves the models of a repository (see the module docstring).

    Args:
        repository: the model repository (a path or a ``ModelRepository``).
        models: the models to load at start (default: every model in the repository).
        batching: per model, a ``BatcherConfig`` that replaces what its ``config.pbtxt`` says.
        admission_wait_ms: how long a request may wait for room in a full model queue before it
            is refused as overloaded (HTTP 429 / gRPC RESOURCE_EXHAUSTED); the queue is the
            model's bounded admission queue (``capacity_rows``).
        inline_max_us: asyncio requests gathered in one event-loop turn run in the loop itself
            when their model is idle and the call is expected to take at most this long (as
            the calls made there measure it): a call that short costs the loop less than the
            hand-off to a dispatcher thread, whose result waits for the GIL while the loop
            holds it (up to the interpreter's 5 ms switch interval); 0: never.
    """

    def __init__(
        self,
        repository: ModelRepository | str,
        *,
        models: Sequence[str] | None = None,
        batching: Mapping[str, BatcherConfig] | None = None,
        admission_wait_ms: float = 0.0,
        inline_max_us: float = 1000.0,
    ) -> None:
        self._batching = dict(batching or {})
        self.admission_wait_ms = admission_wait_ms
        self.inline_max_us = inline_max_us
        self.on_batch: Callable[[str, int], None] | None = None
        """Metrics hook: ``on_batch(model, rows)`` after every model call."""
        self.repository = (
            repository if isinstance(repository, ModelRepository) else ModelRepository(repository)
        )
        self._initial = list(models) if models is not None else None
        super().__init__()
        self._shadows: set[asyncio.Future[None]] = set()
        self._shadow_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        self.started_ns = time.monotonic_ns()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for name in self._initial if self._initial is not None else self.repository.models():
            self.load(name)

    def close(self) -> None:
        with self._lock:
            served, self._served = self._served, {}
        for s in served.values():
            s.close()
        if self._shadow_threads is not None:
            self._shadow_threads.shutdown(wait=False, cancel_futures=True)

    def _make(self, name: str, version: int) -> Served:
        model = ServedModel(self.repository, name, version=version, pin=True)
        return Served(
            model,
            self._batching.get(name),
            emit=self._complete,
            dead_letter=self._fail,
            on_batch=self._batched,
        )

    # -- inference ----------------------------------------------------------------------------
    def _admit(
        self,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        version: str | None,
        priority: int,
        tier: int | None,
        timeout_s: float | None,
        checked: bool,
        key: str | None,
    ) -> tuple[Served, Served | None, int, int, int | None]:
        """Check a request: (its model version, the version a shadow copy goes to, rows, tier,
        deadline ns)."""
        served, shadow = self._route(name, version, key)
        n = int(next(iter(inputs.values())).shape[0]) if checked else check_arrays(served.signature, inputs)
        tier = served.model.config.tier(priority) if tier is None else tier
        deadline = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
        return served, shadow, n, tier, deadline

    def infer(
        self,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        version: str | None = None,
        priority: int = 0,
        tier: int | None = None,
        timeout_s: float | None = None,
        checked: bool = False,
        key: str | None = None,
    ) -> InferResult:
        """Run ``inputs`` (arrays with the batch dimension first) through the model's batcher,
        from a thread (blocks until answered). Asyncio callers use ``infer_async``. The inputs
        are checked first (``BadRequest`` names what does not fit the model), unless
        ``checked`` says the caller has run ``oip.check_request`` on them against this model.
        ``key`` places the request during a rollout (``aisp.infer.models.rollout``)."""
        served, shadow, n, tier, deadline = self._admit(
            name, inputs, version, priority, tier, timeout_s, checked, key
        )
        if shadow is not None:
            self._shadow_pool().submit(self._shadow_copy, name, shadow, inputs, timeout_s)
        if has_empty(inputs):
            return self._run_empty(served, inputs)
        req = next(self._ids)
        pending = Pending(n, event=threading.Event())
        batches = request_batches(served.model, [Gathered(req, inputs, n, tier, deadline, 0)])
        with self._lock:
            self._pending[req] = pending
        started = time.perf_counter_ns()
        try:
            try:
                served.batcher.submit(batches[0], timeout_ms=self.admission_wait_ms)
            except QueueFull as exc:
                pending.error = "overloaded"
                raise RequestFailed(
                    f"model {name!r} is overloaded: its queue is full ({exc}); retry later",
                    reason="overloaded",
                ) from exc
            except BatcherClosed as exc:
                pending.error = "unavailable"
                raise RequestFailed(f"model {name!r} is unavailable: {exc}", reason="unavailable") from exc
            assert pending.event is not None
            if not pending.event.wait(None if timeout_s is None else timeout_s + 1.0):
                pending.error = "timeout"
        finally:
            with self._lock:
                self._pending.pop(req, None)
            self._account(name, served, pending, time.perf_counter_ns() - started)
        return self._result(name, pending, timeout_s)

    async def infer_async(
        self,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        version: str | None = None,
        priority: int = 0,
        tier: int | None = None,
        timeout_s: float | None = None,
        checked: bool = False,
        key: str | None = None,
    ) -> InferResult:
        """``infer`` for asyncio: the requests that arrive in one turn of the event loop are
        answered together. When their model is idle and cheap (``inline_max_us``) one model call
        made in the loop answers them (numpy arrays in and out); otherwise they go to the batcher
        as one Arrow batch per input shape, and their answers come back to the loop in one call
        per model batch."""
        served, shadow, n, tier, deadline = self._admit(
            name, inputs, version, priority, tier, timeout_s, checked, key
        )
        if shadow is not None and len(self._shadows) < 64:  # a copy the candidate answers, answer discarded
            task = asyncio.ensure_future(self._shadow_async(name, shadow, inputs, timeout_s))
            self._shadows.add(task)
            task.add_done_callback(self._shadows.discard)
        if has_empty(inputs):
            return await asyncio.to_thread(self._run_empty, served, inputs)
        loop = asyncio.get_running_loop()
        req = next(self._ids)
        future = loop.create_future()
        started = time.perf_counter_ns()
        pending = Pending(n, future=future, loop=loop, started_ns=started)
        now = time.monotonic_ns()
        item = Gathered(req, inputs, n, tier, deadline, now + int(self.admission_wait_ms * 1e6), pending)
        self._join_gather(served, loop, item)
        try:
            if timeout_s is None:
                await future
            else:
                await asyncio.wait_for(asyncio.shield(future), timeout_s + 1.0)
        except TimeoutError:
            pending.error = "timeout"
        finally:
            self._pending.pop(req, None)  # where the queue's path registered it (one atomic dict op)
            self._account(name, served, pending, time.perf_counter_ns() - started)
        return self._result(name, pending, timeout_s)

    def collect(
        self,
        into: dict[Served, list[Gathered]] | None,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        on_done: Callable[[InferResult | AispError], None],
        *,
        version: str | None = None,
        priority: int = 0,
        tier: int | None = None,
        timeout_s: float | None = None,
        checked: bool = False,
        key: str | None = None,
    ) -> None:
        """Admit a request to be answered through ``on_done`` (its result, or the ``AispError``
        it failed with), with no task, future or waiting thread of its own. A request that cannot
        be admitted raises here; deadlines are the queue's (a row past its deadline is failed
        there).

        * (Any thread) into ``into``, by model version, for one ``submit_collected`` of many
          requests (a transport that receives many calls at once: the native gRPC front);
          ``on_done`` is called in whichever thread finishes it (this one when it is answered at
          once, a batcher's otherwise);
        * (Event loop) with ``into`` None: the request joins this turn's gather, as
          ``infer_async``'s do, and ``on_done`` is called in the loop's thread (many requests in
          flight on one loop: a gRPC stream)."""
        loop = asyncio.get_running_loop() if into is None else None
        served, shadow, n, tier, deadline = self._admit(
            name, inputs, version, priority, tier, timeout_s, checked, key
        )
        if shadow is not None:
            self._shadow_pool().submit(self._shadow_copy, name, shadow, inputs, timeout_s)
        if has_empty(inputs):
            try:
                result: InferResult | AispError = self._run_empty(served, inputs)
            except AispError as exc:
                result = exc
            on_done(result)
            return
        req = next(self._ids)
        started = time.perf_counter_ns()

        def finished(pending: Pending) -> None:
            with self._lock:
                self._pending.pop(req, None)
            self._account(name, served, pending, time.perf_counter_ns() - started)
            try:
                outcome: InferResult | AispError = self._result(name, pending, timeout_s)
            except AispError as exc:
                outcome = exc
            on_done(outcome)

        pending = Pending(n, loop=loop, started_ns=started, on_done=finished)
        wait_until = time.monotonic_ns() + int(self.admission_wait_ms * 1e6)
        item = Gathered(req, inputs, n, tier, deadline, wait_until, pending)
        if loop is not None:
            self._join_gather(served, loop, item)
        else:
            assert into is not None
            into.setdefault(served, []).append(item)

    def _join_gather(self, served: Served, loop: asyncio.AbstractEventLoop, item: Gathered) -> None:
        """(Event loop) ``item`` into this turn's gather of ``served``; the turn's first schedules
        the flush that submits them all."""
        gather = served.gathers.get(loop)
        if gather:
            gather.append(item)
        else:
            served.gathers[loop] = [item]
            loop.call_soon(self._flush, served, loop)

    def submit_collected(self, collected: dict[Served, list[Gathered]]) -> None:
        """(Any thread) Submit what ``collect`` gathered: per model version, the requests that fit
        in its queue, one batch per input shape (one model call made here when the model is idle
        and cheap); those that do not fit wait here for room until their admission time is up
        (the caller's next calls wait with them: the queue is full), then fail as overloaded."""
        for served, items in collected.items():
            while items:
                try:
                    items = self._submit_gathered(served, items, None)
                except Exception as exc:  # noqa: BLE001 - a fault here fails its requests, not the caller
                    log.exception("model %s: submitting %d requests failed", served.model.name, len(items))
                    self._settle_items(items, f"internal error: {type(exc).__name__}: {exc}")
                    break
                if items:
                    time.sleep(0.001)

    def _account(self, name: str, served: Served, pending: Pending, took_ns: int) -> None:
        """A finished request in its version's statistics (unless it was answered inline and
        counted there) and in the rollout's observations."""
        ok = pending.error is None
        if not pending.counted:
            served.stats_of(pending.version or served.model.version).request(ok, took_ns)
        self._observe(name, served, ok, took_ns, pending.outputs)

    def _shadow_copy(
        self, name: str, shadow: Served, inputs: Mapping[str, npt.NDArray[Any]], timeout_s: float | None
    ) -> None:
        """(A worker thread) a rollout's shadow copy of a request: answered by the candidate,
        observed by the rollout, its answer discarded."""
        with contextlib.suppress(AispError):  # the rollout counts the failure
            self.infer(name, inputs, version=shadow.model.version, timeout_s=timeout_s, checked=True)

    async def _shadow_async(
        self, name: str, shadow: Served, inputs: Mapping[str, npt.NDArray[Any]], timeout_s: float | None
    ) -> None:
        """``_shadow_copy`` on the event loop (the same path as the request it copies)."""
        with contextlib.suppress(AispError):
            await self.infer_async(
                name, inputs, version=shadow.model.version, timeout_s=timeout_s, checked=True
            )

    def _shadow_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._shadow_threads is None:
            self._shadow_threads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="aisp-shadow")
        return self._shadow_threads

    def _run_empty(self, served: Served, inputs: Mapping[str, npt.NDArray[Any]]) -> InferResult:
        """A request with a tensor of no elements, computed alone (batches cannot hold one).
        Zero rows that the model cannot compute are answered empty all the same."""
        sig = served.signature
        rows = int(next(iter(inputs.values())).shape[0])
        try:
            runtime = served.model.resolve()
            outputs = runtime.run({n: np.ascontiguousarray(inputs[n]) for n in served.model.input_names})
        except AispError as exc:
            if rows == 0:
                return InferResult(
                    sig.model, served.model.version, {t.name: empty_output(t) for t in sig.outputs}
                )
            raise BadRequest(f"model {sig.model!r} cannot compute an input of zero elements: {exc}") from exc
        return InferResult(sig.model, str(runtime.version), dict(outputs))

    def _flush(self, served: Served, loop: asyncio.AbstractEventLoop) -> None:
        """(Event loop) Submit the requests gathered this turn: those that fit in the model's
        queue, one batch per input shape; the rest wait for room until their admission time is
        up. Never raises into the loop: a failure fails the requests it concerns."""
        items = served.gathers.pop(loop, [])
        try:
            self._submit_gathered(served, items, loop)
        except Exception as exc:  # noqa: BLE001 - a fault here must fail its requests, never the loop
            log.exception("model %s: submitting %d requests failed", served.model.name, len(items))
            self._settle_items(items, f"internal error: {type(exc).__name__}: {exc}")

    def _submit_gathered(
        self, served: Served, items: list[Gathered], loop: asyncio.AbstractEventLoop | None
    ) -> list[Gathered]:
        """Submit ``items``; those that do not fit yet wait in ``loop``'s next gather, or, with no
        loop, are returned to the caller."""
        if not items:
            return []
        batcher = served.batcher
        queued = batcher.queued_rows
        room, take = batcher.config.capacity_rows - queued, 0
        for it in items:  # the requests that fit in the queue's room, in order of arrival
            room -= it.rows
            if room < 0:
                break
            take += 1
        if take == 0 and queued == 0:
            take = 1  # a request larger than the whole queue is taken when it is empty
        now = time.monotonic_ns()
        refused = items[take:]
        cost_ns = int(self.inline_max_us * 1e3)
        for group in shape_groups(served.model, items[:take]):
            if cost_ns > 0 and self._run_now(served, group, cost_ns):
                continue
            with self._lock:  # the batcher's results find their requests by id
                self._pending.update((it.req, it.pending) for it in group)
            batch = request_batch(served.model, group)
            try:
                batcher.submit(batch, timeout_ms=0)
            except QueueFull:
                self._settle_items(group, "overloaded")
            except BatcherClosed:  # the model was unloaded or the server is stopping
                self._settle_items(group, "unavailable")
        waiting = [it for it in refused if it.admit_until_ns > now]
        self._settle_items([it for it in refused if it.admit_until_ns <= now], "overloaded")
        if waiting and loop is None:
            return waiting  # the caller's thread waits for room
        if waiting:
            assert loop is not None
            gather = served.gathers.setdefault(loop, [])
            if not gather:
                loop.call_later(0.001, self._flush, served, loop)
            gather[:0] = waiting
        return []

    def _run_now(self, served: Served, group: list[Gathered], cost_ns: int) -> bool:
        """(Event loop, or ``submit_collected``'s thread) Answer ``group`` with one model call
        made here, when the model is idle and the call is cheap (``Served.run_now``); False,
        having done nothing, otherwise."""
        now, rows = time.monotonic_ns(), 0
        for it in group:
            if it.deadline_ns is not None and it.deadline_ns <= now:
                return False  # the queue fails what is past its deadline
            rows += it.rows
        try:
            done = served.run_now(group, rows, cost_ns)
        except Exception as exc:  # noqa: BLE001 - the model failed: so do its requests
            self._settle_items(group, f"{type(exc).__name__}: {exc}")
            return True
        if done is None:
            return False
        each, version = done
        end, answered, total_ns = time.perf_counter_ns(), 0, 0
        for it, outputs in zip(group, each, strict=True):
            p = it.pending
            if p.error is None:  # else the caller gave up
                p.outputs, p.version, p.done_rows, p.counted = outputs, version, p.rows, True
                answered += 1
                total_ns += end - p.started_ns
                if p.future is not None and not p.future.done():  # gathered by this loop: asyncio waiters
                    p.future.set_result(None)
                elif p.on_done is not None:  # collected with a callback (``collect``)
                    resolve((p,))
        served.stats_of(version).requests(answered, total_ns)
        return True

    def _settle_items(self, items: Sequence[Gathered], error: str) -> None:
        """Fail the requests ``items`` (those not finished yet) with ``error``."""
        _fail_all([it.pending for it in items], error)

    def _result(self, name: str, pending: Pending, timeout_s: float | None) -> InferResult:
        if pending.error == "overloaded":
            raise RequestFailed(
                f"model {name!r} is overloaded: its queue is full; retry later", reason="overloaded"
            )
        if pending.error == "timeout":
            raise RequestFailed(f"model {name!r}: no answer in {timeout_s:g} s", reason="timeout")
        if pending.error is not None:
            raise RequestFailed(f"model {name!r}: {pending.error}", reason=pending.error)
        return InferResult(name, pending.version, pending.outputs)

    # -- batcher callbacks (dispatcher threads) -----------------------------------------------
    def _batched(self, model: str, rows: int) -> None:
        if self.on_batch is not None:
            self.on_batch(model, rows)

    def _complete(self, batch: Batch) -> None:
        reqs = batch.numpy(REQ)
        rows = batch.numpy(ROW)
        version = str(int(batch.numpy("_version")[0]))
        shapes = row_shapes(batch)
        outs = {}
        for c in batch.column_names:
            if c.startswith("out:"):
                arr = batch.numpy(c)
                outs[c[4:]] = (arr, shapes.get(c, arr.shape[1:]))
        # rows of one request are contiguous unless tiers or a split reordered them
        bounds = np.flatnonzero(reqs[1:] != reqs[:-1]) + 1
        starts = [0, *bounds.tolist()]
        ends = [*bounds.tolist(), reqs.shape[0]]
        firsts = reqs[starts].tolist()
        with self._lock:
            found = [self._pending.get(r) for r in firsts]
        done = []
        for p, s, e in zip(found, starts, ends, strict=True):
            if p is None:
                continue  # the caller gave up
            if p.done_rows == 0 and e - s == p.rows and rows[s] == 0 and rows[e - 1] == p.rows - 1:
                # the whole request, in order
                p.outputs = {name: arr[s:e].reshape((e - s, *shape)) for name, (arr, shape) in outs.items()}
            else:
                for name, (arr, shape) in outs.items():
                    buf = p.outputs.get(name)
                    if buf is None:
                        buf = p.outputs[name] = np.empty((p.rows, *shape), dtype=arr.dtype)
                    buf[rows[s:e]] = arr[s:e].reshape((e - s, *shape))
            p.version = version
            p.done_rows += e - s
            if p.done_rows >= p.rows:
                done.append(p)
        wake(done)

    def _fail(self, batch: Batch, reason: str) -> None:
        with self._lock:
            found = [self._pending.get(req) for req in np.unique(batch.numpy(REQ)).tolist()]
        _fail_all(found, reason)


def _fail_all(pendings: Sequence[Pending | None], error: str) -> None:
    """Fail the requests ``pendings`` that are not finished yet with ``error``, and wake them."""
    done = []
    for p in pendings:
        if p is not None and p.error is None:
            p.error = error
            done.append(p)
    wake(done)
