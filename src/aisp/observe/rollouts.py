"""What observers show of canary rollouts (``aisp.infer.rollout``): Prometheus families (the
candidate's traffic share, the rollout's state, decisions by kind) and the dashboard's rows,
for served models' rollouts (``aisp serve``) and pipelines' rollout steps
(``Stream.infer_rollout``), from their ``status()``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["DECISIONS_SHOWN", "rollout_families", "rollout_rows", "step_statuses"]

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
