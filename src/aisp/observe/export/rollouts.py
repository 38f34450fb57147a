"""What observers show of live operations: canary rollouts (``aisp.infer.models.rollout``), as
Prometheus families (the candidate's traffic share, the rollout's state, decisions by kind) and
the dashboard's rows, for served models' rollouts (``aisp serve``) and pipelines' rollout steps
(``Stream.infer_rollout``), from their ``status()``; and topology updates (``GraphVersions``:
each pipeline's running graph version and its updates by outcome, served or run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = [
    "DECISIONS_SHOWN",
    "GraphVersions",
    "rollout_families",
    "rollout_rows",
    "step_statuses",
    "update_counts",
]

DECISIONS_SHOWN = 10
"""The latest decisions of each rollout on the dashboard (all of them are in its status)."""


def step_statuses(graph: Any) -> dict[str, dict[str, Any]]:
    """The status of each rollout step of ``graph`` (``Graph.rollouts``), by step id."""
    return {sid: rollout.status() for sid, rollout in getattr(graph, "rollouts", {}).items()}


def rollout_families(prefix: str, label: str, statuses: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """``{prefix}_candidate_share``, ``{prefix}_state`` and ``{prefix}_decisions`` of the rollouts
    in ``statuses`` (by model or step name, the value of ``label``)."""
    share = GaugeMetricFamily(
        f"{prefix}_candidate_share",
        "Share of the traffic the rollout's candidate takes",
        labels=[label, "candidate"],
    )
    state = GaugeMetricFamily(
        f"{prefix}_state", "1 for the state the rollout is in", labels=[label, "candidate", "state"]
    )
    decisions = CounterMetricFamily(
        f"{prefix}_decisions",
        "Rollout decisions (start, wait, pass, promote, rollback)",
        labels=[label, "decision"],
    )
    for name, status in sorted(statuses.items()):
        candidate = str(status["candidate"])
        share.add_metric([name, candidate], status["share"])
        state.add_metric([name, candidate, status["state"]], 1)
        counts: dict[str, int] = {}
        for d in status["decisions"]:
            counts[d["decision"]] = counts.get(d["decision"], 0) + 1
        for decision, n in sorted(counts.items()):
            decisions.add_metric([name, decision], n)
    return [share, state, decisions]


def rollout_rows(kind: str, statuses: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's rows: one per rollout (``kind``: "model" or "step"), with its latest
    decisions and their evidence, newest first."""
    return [
        {
            "kind": kind,
            "name": name,
            "stable": str(status["stable"]),
            "candidate": str(status["candidate"]),
            "state": status["state"],
            "share": status["share"],
            "steps": status["steps"],
            "decisions": list(reversed(status["decisions"][-DECISIONS_SHOWN:])),
        }
        for name, status in sorted(statuses.items())
    ]


def update_counts(version: int, updates: Sequence[Mapping[str, Any]]) -> tuple[int, int, int]:
    """(running graph version, updates applied, updates failed) of a pipeline's history."""
    failed = sum(1 for u in updates if "failed" in u)
    return version, len(updates) - failed, failed


class GraphVersions:
    """``aisp_pipeline_graph_version{pipeline}`` and ``aisp_pipeline_graph_updates_total{pipeline,
    outcome}``; ``of()``: each pipeline's ``update_counts``, by name."""

    def __init__(self, of: Callable[[], Mapping[str, tuple[int, int, int]]]) -> None:
        self._of = of

    def collect(self) -> Iterator[Any]:
        version = GaugeMetricFamily(
            "aisp_pipeline_graph_version",
            "The running graph's version (one more per topology update)",
            labels=["pipeline"],
        )
        updates = CounterMetricFamily(
            "aisp_pipeline_graph_updates", "Topology updates by outcome", labels=["pipeline", "outcome"]
        )
        for name, (running, applied, failed) in sorted(self._of().items()):
            version.add_metric([name], running)
            updates.add_metric([name, "applied"], applied)
            updates.add_metric([name, "failed"], failed)
        yield version
        yield updates
