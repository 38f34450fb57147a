"""The model server core, independent of the transport: models from a repository, each behind
its own dynamic batcher, so concurrent single-row requests are served in batches.

``ModelServer.infer`` submits a request's rows to the model's batcher and waits for them; the
rows of several requests share model calls, and a request larger than a batch is split and
reassembled by row. Requests carry a priority (tier) and an optional deadline that the batcher
honours; rows that time out or are shed fail their request with that reason.
"""

from __future__ import annotations

import itertools
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


@dataclass
class _Pending:
    rows: int
    outputs: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    done_rows: int = 0
    version: str = ""
    error: str | None = None
    event: threading.Event = field(default_factory=threading.Event)


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
        self.last_inference_ms = 0
        self._input_ns = 0
        self._output_ns = 0

    def request(self, ok: bool, ns: int) -> None:
        with self._lock:
            entry = self._phases["success" if ok else "fail"]
            entry[0] += 1
            entry[1] += ns
            self.last_inference_ms = int(time.time() * 1000)

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
                "last_inference": self.last_inference_ms,
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
    """

    def __init__(
        self,
        repository: ModelRepository | str,
        *,
        models: Sequence[str] | None = None,
        batching: Mapping[str, BatcherConfig] | None = None,
        admission_wait_ms: float = 0.0,
    ) -> None:
        self._batching = dict(batching or {})
        self.admission_wait_ms = admission_wait_ms
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

    # -- inference ----------------------------------------------------------------------------
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
        """Run ``inputs`` (arrays with the batch dimension first) through the model's batcher."""
        model = self.served(name, version)
        missing = sorted(set(model.input_names) - set(inputs))
        if missing:
            raise ModelError(f"model {name!r} needs inputs {list(model.input_names)}; missing {missing}")
        rows = {int(a.shape[0]) for a in inputs.values()}
        if len(rows) != 1:
            raise ModelError(f"inputs have different batch sizes: {sorted(rows)}")
        n = rows.pop()
        if tier is None:
            tier = model.config.tier(priority)
        req = next(self._ids)
        pending = _Pending(n)
        cols: dict[str, Any] = {k: _column(v) for k, v in inputs.items() if k in model.input_names}
        cols[_REQ] = np.full(n, req, dtype=np.int64)
        cols[_ROW] = np.arange(n, dtype=np.int64)
        cols[TIER] = np.full(n, tier, dtype=np.int8)
        if timeout_s is not None:
            cols[DEADLINE_NS] = np.full(n, time.monotonic_ns() + int(timeout_s * 1e9), dtype=np.int64)
        with self._lock:
            self._pending[req] = pending
            served = self._served[name]
        started = time.perf_counter_ns()
        ok = False
        try:
            try:
                served.batcher.submit(Batch.from_columns(cols), timeout_ms=self.admission_wait_ms)
            except TimeoutError as exc:
                raise RequestFailed(
                    f"model {name!r} is overloaded: its queue is full ({exc}); retry later",
                    reason="overloaded",
                ) from exc
            if not pending.event.wait(None if timeout_s is None else timeout_s + 1.0):
                raise RequestFailed(f"model {name!r}: no answer in {timeout_s:g} s", reason="timeout")
            ok = pending.error is None
        finally:
            with self._lock:
                self._pending.pop(req, None)
            served.stats_of(pending.version or model.version).request(ok, time.perf_counter_ns() - started)
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
        for req in np.unique(reqs).tolist():
            sel = reqs == req
            with self._lock:
                p = self._pending.get(req)
            if p is None:
                continue  # the caller gave up
            for name, arr in outs.items():
                buf = p.outputs.get(name)
                if buf is None:
                    buf = p.outputs[name] = np.empty((p.rows, arr.shape[1]), dtype=arr.dtype)
                buf[rows[sel]] = arr[sel]
            p.version = version
            p.done_rows += int(sel.sum())
            if p.done_rows >= p.rows:
                p.event.set()

    def _fail(self, batch: Batch, reason: str) -> None:
        for req in np.unique(batch.numpy(_REQ)).tolist():
            with self._lock:
                p = self._pending.get(req)
            if p is not None and p.error is None:
                p.error = reason
                p.event.set()


def _column(arr: npt.NDArray[Any]) -> Any:
    arr = np.asarray(arr)
    if arr.ndim == 1:
        return arr
    return matrix_column(arr.reshape(arr.shape[0], -1))
