"""What a run reports when it ends: ``RunSummary``, made from the executor (``summarize``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from aisp.infer.batching.batcher import DynamicBatcher
from aisp.observe.clock import wall_ms
from aisp.observe.stats import peak_rss_mb
from aisp.schedule.executor import LocalExecutor

__all__ = ["RunSummary", "summarize"]


@dataclass
class RunSummary:
    pipeline: str
    events_in: int
    events_out: int
    dead_letters: int
    seconds: float
    events_per_s: float
    latency_ms: dict[str, float]
    peak_rss_mb: float
    stopped_early: bool
    dead_letters_by_step: dict[str, int] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: int = 0
    restored_from: int | None = None
    model_changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Model steps restored across a change of model (``CheckpointOptions.allow_model_change``,
    or a savepoint start): the checkpoint's and this run's version and weights hash, by step."""
    slo_ms: float = 0.0
    """The latency target: ``ObserveOptions.slo_ms``, else the pipeline's latency bound."""
    slo_attainment: float = 0.0
    """The share of the events written within ``slo_ms``."""
    active_seconds: float = 0.0
    """From the first event read to the last row written (``seconds`` also holds the waits for
    input to begin and to end: a consumer group forming, an idle timeout)."""
    active_from_ms: int = 0
    """Wall-clock time (Unix ms) of the first event read, to line up several processes' runs."""
    state: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per key space: keys in memory at the end, keys evicted and read back (``state_max_keys``)."""
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Model rollouts (``Stream.infer_rollout``) by step: their state and decisions."""
    partitions: dict[str, float] = field(default_factory=dict)
    """State that follows input partitions: partitions taken over, and how (``stats()`` of the
    ``PartitionStateStore``)."""

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)


def summarize(ex: LocalExecutor) -> RunSummary:
    st = ex.stats
    secs = st.seconds()
    models = {sid: _model_summary(b) for sid, b in ex.batchers.items()}
    return RunSummary(
        pipeline=ex.graph.name,
        events_in=st.events_in,
        events_out=st.events_out,
        dead_letters=ex.dead_letter.count,
        seconds=round(secs, 3),
        events_per_s=round(st.events_in / secs, 1) if secs > 0 else 0.0,
        latency_ms=st.e2e.summary_ms(),
        peak_rss_mb=round(peak_rss_mb(), 1),
        stopped_early=ex.stopping,
        dead_letters_by_step=dict(ex.dead_letter.by_step),
        stages=[s.as_dict() for s in st.stages.values()],
        models=models,
        state=ex.keyed.stats(),
        partitions=ex.partition_states.stats() if ex.partition_states is not None else {},
        active_seconds=round(st.active_seconds(), 3),
        active_from_ms=wall_ms(st.first_read_ns) if st.first_read_ns is not None else 0,
    )


def _model_summary(b: DynamicBatcher) -> dict[str, Any]:
    st = b.stats
    rt = b.runtime
    return {
        "model": rt.name,
        "version": rt.version,
        "provider": rt.provider,
        "batches": st.batches,
        "rows": st.rows,
        "mean_batch_rows": round(st.rows / st.batches, 1) if st.batches else 0.0,
        "timeouts": st.timeouts,
        "errors": st.errors,
        "shed": st.shed,
        "batching": b.batching(),
        "swaps": getattr(b.runtime, "swaps", 0),
        "last_load_error": getattr(b.runtime, "last_error", None),
    }
