"""The executor's own operators: the one that writes to a sink, the one that hands rows to a
model's batcher (and watches their drift); and when a step may fork a worker process, and where
a source reads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.batch import INGEST_NS, PARTIAL, Batch
from aisp.infer.batching.batcher import DynamicBatcher
from aisp.infer.llm.stage import LlmStage
from aisp.infer.stage import InferSpec
from aisp.ingest.base import Source
from aisp.ingest.process import ProcessSource
from aisp.observe.drift import DriftConfig, DriftMonitor, alert_sink, local_alert
from aisp.observe.stats import RunStats, StageStats
from aisp.sinks.base import SinkPartition
from aisp.transform.operators import Emit

__all__ = ["InferOp", "SinkOp", "can_fork", "model_batches", "offloaded", "resolve_alert"]

log = logging.getLogger("aisp.executor")


def can_fork(step_id: str) -> bool:
    """Process offload forks; that is only safe while this is the process's only thread."""
    if threading.active_count() == 1:
        return True
    log.warning(
        "step %r runs in-process: %d threads are already running, so forking a worker is unsafe",
        step_id,
        threading.active_count(),
    )
    return False


def offloaded(spec: Source, step_id: str) -> Source:
    """Where a source that decodes heavily reads: the child its connector spawns (a process of
    its own), else a forked worker process when forking is safe, else in-process."""
    if not spec.decode_heavy:
        return spec
    child = spec.spawned()
    if child is not None:
        return child
    return ProcessSource(inner=spec) if can_fork(step_id) else spec


def model_batches(st: StageStats, call: threading.local) -> Callable[[int, int, int, int], None]:
    """A batcher's ``on_batch``: each model call's rows, queue wait and compute time go into the
    stage's stats (and into ``call``, for its trace span)."""

    def on_batch(rows: int, queue_wait_ns: int, compute_ns: int, work_ns: int) -> None:
        call.wait_ns, call.compute_ns = queue_wait_ns, compute_ns
        st.batches += 1
        st.busy_ns += work_ns
        st.phase("batch", queue_wait_ns)
        st.phase("compute", compute_ns)
        st.batch_rows.record_one(rows)

    return on_batch


class SinkOp:
    """Writes to a sink partition and records each row's end-to-end latency once written."""

    def __init__(self, part: SinkPartition, run: RunStats) -> None:
        self.part, self._run = part, run
        if part.reports_written:
            part.on_written = self._written

    def _written(self, ingest_ns: npt.NDArray[np.int64], written_ns: int) -> None:
        self._run.e2e.record(written_ns - ingest_ns)
        self._run.events_out += ingest_ns.shape[0]
        self._run.last_written_ns = written_ns
        self._run.trail.tick(written_ns)

    def process(self, batch: Batch) -> Emit:
        if not batch.num_rows:
            return []
        if PARTIAL in batch:  # pieces of results (tokens): for a served pipeline's clients only
            return []
        self.part.write(batch)
        if not self.part.reports_written:
            self._written(batch.numpy(INGEST_NS), time.monotonic_ns())
        return []

    def flush(self) -> Emit:
        self.part.flush()
        return []


class LlmOp:
    """An ``llm`` step: rows go to its ``LlmStage``, whose loop emits them (and their tokens)."""

    def __init__(self, stage: LlmStage) -> None:
        self.stage = stage

    def process(self, batch: Batch) -> Emit:
        self.stage.feed(batch)
        return []

    def flush(self) -> Emit:
        self.stage.close()
        return []


def resolve_alert(target: Any, what: str = "drift") -> Callable[[dict[str, Any]], None]:
    """The function sending alerts to ``target``: a log line, a webhook or a callable
    (``alert_sink``), or a broker stream (``redis://``, ``nats://``), connected now."""
    if isinstance(target, str) and not local_alert(target):
        from aisp.connectors import alert_to

        return alert_to(target)
    return alert_sink(target, what)


class InferOp:
    def __init__(self, batcher: DynamicBatcher, step_id: str, spec: InferSpec) -> None:
        self.batcher = batcher
        self._step, self._spec = step_id, spec
        self.drift: DriftMonitor | None = None
        drift = spec.drift
        if drift is not None and isinstance(drift.alert, str) and not local_alert(drift.alert):
            # connected when the executor starts, so that an unreachable target fails the start
            self._spec = replace(spec, drift=replace(drift, alert=resolve_alert(drift.alert)))

    def process(self, batch: Batch) -> Emit:
        if self._spec.drift is not None and batch.num_rows:
            self._watch(batch, self._spec.drift)
        self.batcher.feed(batch)
        return []

    def _watch(self, batch: Batch, config: DriftConfig) -> None:
        columns = list(self._spec.inputs.values())
        parts = [batch.numpy(c).reshape(batch.num_rows, -1) for c in columns]
        matrix = parts[0] if len(parts) == 1 else np.hstack(parts)
        if self.drift is None:
            names = [
                name
                for c, arr in zip(columns, parts, strict=True)
                for name in ([c] if arr.shape[1] == 1 else [f"{c}[{i}]" for i in range(arr.shape[1])])
            ]
            self.drift = DriftMonitor(self._step, config, matrix.shape[1], names)
        self.drift.observe(matrix)

    def flush(self) -> Emit:
        self.batcher.close()
        return []
