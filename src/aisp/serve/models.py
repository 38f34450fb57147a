"""The model server core, independent of the transport: models from a repository, each behind
its own dynamic batcher, so concurrent single-row requests are served in batches.

``ModelServer.infer`` submits a request's rows to the model's batcher and waits for them; the
rows of several requests share model calls, and a request larger than a batch is split and
reassembled by row. Requests carry a priority (tier) and an optional deadline that the batcher
honours; rows that time out or are shed fail their request with that reason.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import DEADLINE_NS, TIER, Batch, matrix_column
from aisp.errors import AispError, ModelError
from aisp.infer.batcher import DynamicBatcher
from aisp.infer.config import BatcherConfig
from aisp.infer.repository import ModelRepository
from aisp.infer.runtime import Runtime
from aisp.infer.versions import ServedModel
from aisp.observe.clock import wall_ms

__all__ = ["NP_TO_OIP", "OIP_TO_NP", "InferResult", "ModelServer", "ModelStats", "RequestFailed"]

NP_TO_OIP = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}
"""numpy dtypes and their Open Inference Protocol v2 datatype names."""
OIP_TO_NP = {v: k for k, v in NP_TO_OIP.items()}

_REQ = "_req"
_ROW = "_row"


class RequestFailed(AispError):
    """An inference request did not complete: timed out, shed, or the model call failed."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retriable = reason in ("shed", "overloaded") or reason.startswith(("timeout", "deadline"))
        self.overloaded = reason in ("shed", "overloaded")


@dataclass
class InferResult:
    model: str
    version: str
    outputs: dict[str, npt.NDArray[Any]]


@dataclass(slots=True)
class _Pending:
    rows: int
    future: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    outputs: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    done_rows: int = 0
    version: str = ""
    error: str | None = None
    event: threading.Event | None = None  # thread callers wait on it; asyncio ones on ``future``


class ModelStats:
    """Triton's statistics extension for one model version, since it was loaded.

    Requests: ``success`` / ``fail`` (count, total ns from receipt to answer). Rows: ``queue``
    (each row counted with its batch's queueing time), ``compute_input`` / ``compute_infer`` /
    ``compute_output`` per model call, and the same per batch size in ``batch_stats``.
    """

    _PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self._phases = {p: [0, 0] for p in self._PHASES}
        self._batches: dict[int, list[int]] = {}  # size -> count, input ns, infer ns, output ns
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ns = 0  # monotonic; reported as Unix ms
        self._input_ns = 0
        self._output_ns = 0

    def request(self, ok: bool, ns: int) -> None:
        with self._lock:
            entry = self._phases["success" if ok else "fail"]
            entry[0] += 1
            entry[1] += ns
            self.last_inference_ns = time.monotonic_ns()

    def batch(self, rows: int, wait_ns: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            self.inference_count += rows
            self.execution_count += 1
            for phase, ns in (
                ("queue", wait_ns * rows),
                ("compute_input", input_ns),
                ("compute_infer", infer_ns),
                ("compute_output", output_ns),
            ):
                entry = self._phases[phase]
                entry[0] += rows if phase == "queue" else 1
                entry[1] += ns
            b = self._batches.setdefault(rows, [0, 0, 0, 0])
            b[0] += 1
            b[1] += input_ns
            b[2] += infer_ns
            b[3] += output_ns

    def to_dict(self) -> dict[str, Any]:
        """The ``$model_stat`` object of the HTTP/REST statistics extension."""
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": wall_ms(self.last_inference_ns) if self.last_inference_ns else 0,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {p: {"count": c, "ns": ns} for p, (c, ns) in self._phases.items()},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": n, "ns": i},
                        "compute_infer": {"count": n, "ns": c},
                        "compute_output": {"count": n, "ns": o},
                    }
                    for size, (n, i, c, o) in sorted(self._batches.items())
                ],
            }


class _Served:
    """One loaded model and its batcher."""

    def __init__(self, server: ModelServer, model: ServedModel, config: BatcherConfig | None = None) -> None:
        self.model = model
        self.stats: dict[str, ModelStats] = {}
        self.gather: list[_Gathered] = []  # asyncio requests of this loop turn (see infer_async)
        self._phase_ns = threading.local()
        self.batcher = DynamicBatcher(
            model,
            config or model.config.batcher,
            prepare=self._prepare,
            finish=self._finish,
            emit=server._complete,
            dead_letter=server._fail,
            on_batch=lambda rows, wait_ns, compute_ns: self._batched(server, rows, wait_ns, compute_ns),
        )
        self.batcher.start()

    def stats_of(self, version: str) -> ModelStats:
        s = self.stats.get(version)
        if s is None:
            s = self.stats.setdefault(version, ModelStats(self.model.name, version))
        return s

    def _batched(self, server: ModelServer, rows: int, wait_ns: int, compute_ns: int) -> None:
        t = self._phase_ns
        self.stats_of(t.version).batch(rows, wait_ns, t.input_ns, compute_ns, t.output_ns)
        server._batched(self.model.name, rows)

    def _prepare(self, batch: Batch) -> dict[str, npt.NDArray[Any]]:
        start = time.perf_counter_ns()
        out = self._inputs(batch)
        self._phase_ns.input_ns = time.perf_counter_ns() - start
        return out

    def _inputs(self, batch: Batch) -> dict[str, npt.NDArray[Any]]:
        specs = self.model.input_specs
        out = {}
        for name in self.model.input_names:
            arr = batch.numpy(name)
            spec = specs.get(name)
            if spec is not None and spec.shape and all(isinstance(d, int) for d in spec.shape[1:]):
                arr = arr.reshape((arr.shape[0], *spec.shape[1:]))
            out[name] = np.ascontiguousarray(arr, dtype=spec.dtype if spec is not None else None)
        return out

    def _finish(self, batch: Batch, outputs: Mapping[str, npt.NDArray[Any]], runtime: Runtime) -> Batch:
        start = time.perf_counter_ns()
        cols: dict[str, Any] = {}
        for name, arr in outputs.items():
            cols[f"out:{name}"] = matrix_column(arr.reshape(arr.shape[0], -1))
        cols["_version"] = np.full(batch.num_rows, int(runtime.version), dtype=np.int64)
        out = batch.select([_REQ, _ROW]).with_columns(cols)
        self._phase_ns.output_ns = time.perf_counter_ns() - start
        self._phase_ns.version = str(runtime.version)
        return out


class ModelServer:
    """Serves the models of a repository (see the module docstring).

    Args:
        repository: the model repository (a path or a ``ModelRepository``).
        models: the models to load at start (default: every model in the repository).
        batching: per model, a ``BatcherConfig`` that replaces what its ``config.pbtxt`` says.
        admission_wait_ms: how long a request may wait for room in a full model queue before it
            is refused as overloaded (HTTP 429 / gRPC RESOURCE_EXHAUSTED); the queue is the
            model's bounded admission queue (``capacity_rows``).
        inline_max_us: asyncio requests gathered in one event-loop turn run in the loop itself
            when their model is idle and the call is expected to take at most this long (a
            small model costs less than the hand-off to its dispatcher thread); 0: never.
    """

    def __init__(
        self,
        repository: ModelRepository | str,
        *,
        models: Sequence[str] | None = None,
        batching: Mapping[str, BatcherConfig] | None = None,
        admission_wait_ms: float = 0.0,
        inline_max_us: float = 200.0,
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
        self._served: dict[str, _Served] = {}
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        self.started_ns = time.monotonic_ns()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for name in self._initial if self._initial is not None else self.repository.models():
            self.load(name)

    def close(self) -> None:
        with self._lock:
            served, self._served = self._served, {}
        for s in served.values():
            s.batcher.close()

    # -- repository ---------------------------------------------------------------------------
    def load(self, name: str, version: int | None = None) -> str:
        """Load ``name`` (or switch it to ``version``: a hot swap between batches)."""
        with self._lock:
            current = self._served.get(name)
        if current is not None:
            return current.model.load(version)
        model = ServedModel(self.repository, name, version=version)
        served = _Served(self, model, self._batching.get(name))
        with self._lock:
            self._served[name] = served
            self._shapes[name] = {t.name: t.dims for t in model.config.outputs}
        return model.version

    def unload(self, name: str) -> None:
        with self._lock:
            served = self._served.pop(name, None)
        if served is None:
            raise ModelError(f"model {name!r} is not loaded")
        served.batcher.close()

    def index(self) -> list[dict[str, str]]:
        out = []
        for name in self.repository.models():
            served = self._served.get(name)
            versions = self.repository.versions(name) or [0]
            for v in versions:
                ready = served is not None and served.model.version == str(v)
                out.append({"name": name, "version": str(v), "state": "READY" if ready else "UNAVAILABLE"})
        return out

    def served(self, name: str, version: str | None = None) -> ServedModel:
        with self._lock:
            s = self._served.get(name)
        if s is None:
            raise ModelError(f"model {name!r} is not loaded")
        if version and version != s.model.version:
            raise ModelError(f"model {name!r} version {version} is not serving (serving: {s.model.version})")
        return s.model

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """OIP v2 model metadata: name, serving versions, platform, inputs/outputs with the batch
        dimension as -1 and OIP datatypes."""
        cfg = self.served(name, version).config

        def tensors(ts: Sequence[Any]) -> list[dict[str, Any]]:
            return [
                {"name": t.name, "datatype": NP_TO_OIP[np.dtype(t.dtype)], "shape": [-1, *t.dims]} for t in ts
            ]

        versions = [str(v) for v in self.repository.serving_versions(cfg.name, cfg)]
        return {
            "name": cfg.name,
            "versions": versions,
            "platform": cfg.platform,
            "inputs": tensors(cfg.inputs),
            "outputs": tensors(cfg.outputs),
        }

    def ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.served(name, version)
        except ModelError:
            return False
        return True

    @property
    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._served)

    def is_loaded(self, name: str) -> bool:
        return name in self._served

    # -- inference ----------------------------------------------------------------------------
    def _check(self, model: ServedModel, inputs: Mapping[str, npt.NDArray[Any]]) -> int:
        """The request's row count, after checking its inputs against the model's."""
        name = model.name
        missing = sorted(set(model.input_names) - set(inputs))
        if missing:
            raise ModelError(f"model {name!r} needs inputs {list(model.input_names)}; missing {missing}")
        rows = {int(a.shape[0]) if a.ndim else -1 for a in inputs.values()}
        if len(rows) != 1 or -1 in rows:
            raise ModelError(f"inputs need one shared batch dimension first, got batch sizes {sorted(rows)}")
        specs = model.input_specs
        for k in model.input_names:
            spec = specs.get(k)
            dims = [d for d in spec.shape[1:] if isinstance(d, int) and d > 0] if spec and spec.shape else []
            if spec is None or not spec.shape or len(dims) != len(spec.shape) - 1:
                continue
            per_row = math.prod(dims)
            arr = inputs[k]
            if math.prod(arr.shape[1:]) != per_row:
                want = ["-1", *map(str, spec.shape[1:])]
                raise ModelError(
                    f"input {k!r} of model {name!r} has shape {list(arr.shape)};"
                    f" the model takes [{', '.join(want)}]"
                )
        return rows.pop()

    def infer(
        self,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        version: str | None = None,
        priority: int = 0,
        tier: int | None = None,
        timeout_s: float | None = None,
    ) -> InferResult:
        """Run ``inputs`` (arrays with the batch dimension first) through the model's batcher,
        from a thread (blocks until answered). Asyncio callers use ``infer_async``."""
        model = self.served(name, version)
        n = self._check(model, inputs)
        req = next(self._ids)
        pending = _Pending(n, event=threading.Event())
        deadline = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
        tier = model.config.tier(priority) if tier is None else tier
        batch = _request_batch(model, [_Gathered(req, inputs, n, tier, deadline, 0)])
        with self._lock:
            self._pending[req] = pending
            served = self._served[name]
        started = time.perf_counter_ns()
        try:
            try:
                served.batcher.submit(batch, timeout_ms=self.admission_wait_ms)
            except TimeoutError as exc:
                pending.error = "overloaded"
                raise RequestFailed(
                    f"model {name!r} is overloaded: its queue is full ({exc}); retry later",
                    reason="overloaded",
                ) from exc
            assert pending.event is not None
            if not pending.event.wait(None if timeout_s is None else timeout_s + 1.0):
                pending.error = "timeout"
        finally:
            with self._lock:
                self._pending.pop(req, None)
            ok = pending.error is None
            served.stats_of(pending.version or model.version).request(ok, time.perf_counter_ns() - started)
        return self._result(name, n, pending, timeout_s)

    async def infer_async(
        self,
        name: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        version: str | None = None,
        priority: int = 0,
        tier: int | None = None,
        timeout_s: float | None = None,
    ) -> InferResult:
        """``infer`` for asyncio: the requests that arrive in one turn of the event loop are
        handed to the batcher as one batch (one Arrow batch, one queue operation), and their
        answers come back to the loop in one call per model batch."""
        model = self.served(name, version)
        n = self._check(model, inputs)
        loop = asyncio.get_running_loop()
        req = next(self._ids)
        pending = _Pending(n, future=loop.create_future(), loop=loop)
        now = time.monotonic_ns()
        deadline = None if timeout_s is None else now + int(timeout_s * 1e9)
        tier = model.config.tier(priority) if tier is None else tier
        with self._lock:
            self._pending[req] = pending
            served = self._served[name]
        gather = served.gather
        gather.append(_Gathered(req, inputs, n, tier, deadline, now + int(self.admission_wait_ms * 1e6)))
        if len(gather) == 1:
            loop.call_soon(self._flush, served, model)
        started = time.perf_counter_ns()
        try:
            assert pending.future is not None
            if timeout_s is None:
                await pending.future
            else:
                await asyncio.wait_for(asyncio.shield(pending.future), timeout_s + 1.0)
        except TimeoutError:
            pending.error = "timeout"
        finally:
            with self._lock:
                self._pending.pop(req, None)
            ok = pending.error is None
            served.stats_of(pending.version or model.version).request(ok, time.perf_counter_ns() - started)
        return self._result(name, n, pending, timeout_s)

    def _flush(self, served: _Served, model: ServedModel) -> None:
        """(Event loop) Submit the requests gathered this turn: those that fit in the model's
        queue as one batch; the rest wait for room until their admission time is up."""
        items, served.gather = served.gather, []
        if not items:
            return
        batcher = served.batcher
        queued = batcher.queued_rows
        fits = np.cumsum([it.rows for it in items]) <= batcher.config.capacity_rows - queued
        take = int(np.argmin(fits)) if not fits.all() else len(items)
        if take == 0 and queued == 0:
            take = 1  # a request larger than the whole queue is taken when it is empty
        now = time.monotonic_ns()
        refused = items[take:]
        if take:
            batch = _request_batch(model, items[:take])
            cost_ns = int(self.inline_max_us * 1e3)
            try:
                if not (cost_ns > 0 and batcher.run_inline(batch, max_cost_ns=cost_ns)):
                    batcher.submit(batch, timeout_ms=0)
            except TimeoutError:
                refused = items
            except RuntimeError:  # the model was unloaded or the server is stopping
                self._settle([it.req for it in items[:take]], "unavailable")
        waiting = [it for it in refused if it.admit_until_ns > now]
        self._settle([it.req for it in refused if it.admit_until_ns <= now], "overloaded")
        if waiting:
            if not served.gather:
                asyncio.get_running_loop().call_later(0.001, self._flush, served, model)
            served.gather[:0] = waiting

    def _settle(self, reqs: Sequence[int], error: str | None) -> None:
        """Finish requests ``reqs`` (with ``error``, or done)."""
        done: list[_Pending] = []
        with self._lock:
            for req in reqs:
                p = self._pending.get(req)
                if p is not None and p.error is None:
                    if error is not None:
                        p.error = error
                    done.append(p)
        _wake(done)

    def _result(self, name: str, n: int, pending: _Pending, timeout_s: float | None) -> InferResult:
        if pending.error == "overloaded":
            raise RequestFailed(
                f"model {name!r} is overloaded: its queue is full; retry later", reason="overloaded"
            )
        if pending.error == "timeout":
            raise RequestFailed(f"model {name!r}: no answer in {timeout_s:g} s", reason="timeout")
        if pending.error is not None:
            raise RequestFailed(f"model {name!r}: {pending.error}", reason=pending.error)
        shapes = self._shapes.get(name, {})
        outputs = {
            k: v.reshape((n, *shapes[k])) if k in shapes and all(d > 0 for d in shapes[k]) else v
            for k, v in pending.outputs.items()
        }
        return InferResult(name, pending.version, outputs)

    def statistics(self, name: str | None = None, version: str | None = None) -> list[dict[str, Any]]:
        """Triton statistics (``$model_stat`` objects) of the loaded models, or of one model
        (and version); a model not loaded raises ``ModelError``."""
        with self._lock:
            served = dict(self._served)
        if name is not None:
            if name not in served:
                raise ModelError(f"model {name!r} is not loaded")
            served = {name: served[name]}
        out = []
        for _, s in sorted(served.items()):
            versions = [version] if version else sorted(set(s.stats) | {s.model.version}, key=int)
            out += [s.stats_of(v).to_dict() for v in versions]
        return out

    def tier_of(self, name: str, priority: int) -> int:
        """The tier a request with OIP/Triton ``priority`` gets on model ``name``."""
        return self.served(name).config.tier(priority)

    def queue_rows(self) -> dict[str, int]:
        with self._lock:
            return {name: s.batcher.queued_rows for name, s in self._served.items()}

    # -- batcher callbacks (dispatcher threads) -----------------------------------------------
    def _batched(self, model: str, rows: int) -> None:
        if self.on_batch is not None:
            self.on_batch(model, rows)

    def _complete(self, batch: Batch) -> None:
        reqs = batch.numpy(_REQ)
        rows = batch.numpy(_ROW)
        version = str(int(batch.numpy("_version")[0]))
        outs = {c[4:]: batch.numpy(c) for c in batch.column_names if c.startswith("out:")}
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
                p.outputs = {name: arr[s:e] for name, arr in outs.items()}  # the whole request, in order
            else:
                for name, arr in outs.items():
                    buf = p.outputs.get(name)
                    if buf is None:
                        buf = p.outputs[name] = np.empty((p.rows, arr.shape[1]), dtype=arr.dtype)
                    buf[rows[s:e]] = arr[s:e]
            p.version = version
            p.done_rows += e - s
            if p.done_rows >= p.rows:
                done.append(p)
        _wake(done)

    def _fail(self, batch: Batch, reason: str) -> None:
        self._settle(np.unique(batch.numpy(_REQ)).tolist(), reason)


@dataclass(slots=True)
class _Gathered:
    req: int
    inputs: Mapping[str, npt.NDArray[Any]]
    rows: int
    tier: int
    deadline_ns: int | None
    admit_until_ns: int


def _request_batch(model: ServedModel, gathered: Sequence[_Gathered]) -> Batch:
    """One batch of the rows of requests ``gathered``, tagged with request id and row number."""
    ns = np.fromiter((it.rows for it in gathered), dtype=np.int64, count=len(gathered))
    cols: dict[str, Any] = {}
    for k in model.input_names:
        arrays = [it.inputs[k] for it in gathered]
        cols[k] = _column(
            arrays[0] if len(arrays) == 1 else np.concatenate([a.reshape(a.shape[0], -1) for a in arrays])
        )
    reqs = np.fromiter((it.req for it in gathered), dtype=np.int64, count=len(gathered))
    cols[_REQ] = np.repeat(reqs, ns)
    total = int(ns.sum())
    if total == len(gathered):
        cols[_ROW] = np.zeros(total, dtype=np.int64)
    else:
        cols[_ROW] = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(ns) - ns, ns)
    cols[TIER] = np.repeat(np.fromiter((it.tier for it in gathered), dtype=np.int8, count=len(gathered)), ns)
    if any(it.deadline_ns is not None for it in gathered):
        d = np.fromiter((it.deadline_ns or 0 for it in gathered), dtype=np.int64, count=len(gathered))
        cols[DEADLINE_NS] = np.repeat(d, ns)
    return Batch.from_columns(cols)


def _wake(done: Sequence[_Pending]) -> None:
    """Wake the waiters of finished requests: threads directly, each event loop once."""
    loops: dict[asyncio.AbstractEventLoop, list[_Pending]] = {}
    for p in done:
        if p.event is not None:
            p.event.set()
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
            _resolve(ps)
            continue
        try:
            loop.call_soon_threadsafe(_resolve, ps)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _resolve(ps: Sequence[_Pending]) -> None:
    for p in ps:
        if p.future is not None and not p.future.done():
            p.future.set_result(None)


def _column(arr: npt.NDArray[Any]) -> Any:
    arr = np.asarray(arr)
    if arr.ndim == 1:
        return arr
    return matrix_column(arr.reshape(arr.shape[0], -1))
