"""What observers may read of a running pipeline: a small read-only view.

Metrics, the dashboard and the live view read a pipeline through ``PipelineView`` (and the
batcher and dead-letter views it holds), never through the executor's internals; the executor
(``schedule.executor.LocalExecutor``) satisfies it, and anything else that runs a graph can.
These are typing Protocols: nothing here imports from the layers above ``observe``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from aisp.graph import Graph
from aisp.observe.stats import RunStats

__all__ = [
    "BatcherCounts",
    "BatcherView",
    "DeadLetterView",
    "DriftView",
    "ModelView",
    "PipelineView",
    "WindowView",
]


class BatcherCounts(Protocol):
    """A model batcher's counters (``infer.batcher.BatcherStats``)."""

    @property
    def batches(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def timeouts(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def shed(self) -> int: ...
    @property
    def queued_rows(self) -> int: ...


class ModelView(Protocol):
    """The model a batcher calls (a runtime: its name, serving version and provider)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...


class BatcherView(Protocol):
    """A model step's dynamic batcher."""

    @property
    def stats(self) -> BatcherCounts: ...
    @property
    def runtime(self) -> Any: ...
    def settings(self) -> dict[str, float]: ...


class DriftView(Protocol):
    """A model step's drift scores (``observe.drift.DriftMonitor``): PSI and KS per feature."""

    @property
    def stage(self) -> str: ...
    @property
    def features(self) -> list[str]: ...
    @property
    def psi(self) -> Any: ...
    @property
    def ks(self) -> Any: ...
    @property
    def alerts(self) -> list[dict[str, Any]]: ...


class WindowView(Protocol):
    """A window step (``transform.window_base.WindowsBase``)."""

    @property
    def open_windows(self) -> int: ...
    @property
    def late_events(self) -> int: ...
    @property
    def watermark(self) -> int: ...


class DeadLetterView(Protocol):
    """Where a pipeline's dead letters go: how many, and by step."""

    @property
    def count(self) -> int: ...
    @property
    def by_step(self) -> Mapping[str, int]: ...


class PipelineView(Protocol):
    """A running pipeline, as observers see it."""

    @property
    def graph(self) -> Graph: ...
    @property
    def stats(self) -> RunStats: ...
    @property
    def dead_letter(self) -> DeadLetterView: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def batchers(self) -> Mapping[str, BatcherView]: ...
    @property
    def drift_monitors(self) -> Sequence[DriftView]: ...
    @property
    def windows(self) -> Mapping[str, WindowView]: ...
    def thread_of(self) -> dict[str, str]: ...
