"""A pipeline's model step rolls a candidate model out over the stable one (``infer_rollout``):
a healthy candidate is promoted through shadow and every traffic share, one with shifted scores
or 20 ms slower per batch is rolled back; every event is scored once either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from aisp import BatcherConfig, CollectSink, ExecutorOptions, OnnxRuntime, Pipeline, WorkloadFSource
from aisp.errors import ModelError
from aisp.infer.rollout import RolloutPolicy
from aisp.observe.dashboard import DashboardState
from aisp.observe.metrics import PipelineCollector
from aisp.schedule.executor import LocalExecutor
from aisp.sinks.deadletter import DeadLetterSink
from benchmarks.workload import load_fraud_example
from tests.support.models import linear_model, slow_linear_model

EVENTS = 60_000


def rolled_out(
    tmp_path: Path, candidate: Path, *, runtime: type[OnnxRuntime] = OnnxRuntime
) -> tuple[Pipeline, CollectSink]:
    fraud = load_fraud_example()
    stable = linear_model(tmp_path / "stable.onnx", 0.1)
    policy = RolloutPolicy(steps=(0.5, 1.0), window_s=0.3, min_samples=300, p99_slack_ms=10.0)
    p = Pipeline("fraud")
    out = CollectSink(columns=["id", "user", "model_variant"])
    stats = (
        p.source("events", WorkloadFSource(events=EVENTS, seed=4))
        .key_by("by_user", "user")
        .running_stats("user_stats", "amount", count="n", mean="mean_amount")
    )
    scored = stats.map_batch("features", fraud.features).infer_rollout(
        "score",
        OnnxRuntime(str(stable), name="fraud"),
        runtime(str(candidate), name="fraud"),
        policy,
        inputs={"features": "features"},
        outputs={"score": "score"},
        batcher=BatcherConfig(max_batch_size=256, max_queue_delay_ms=1.0),
    )
    scored.sink("out", out)
    return p, out


class _Failing(OnnxRuntime):
    """A candidate whose calls fail after its warm-up: every row it takes is dead-lettered."""

    def warmup(self, batch_sizes: Any) -> None:  # once per step that runs it
        self.broken = False
        super().warmup(batch_sizes)
        self.broken = True

    def run(self, inputs: Any) -> Any:
        if getattr(self, "broken", False):
            raise ModelError("the candidate cannot score")
        return super().run(inputs)


def test_rows_a_failing_candidate_dead_letters_count_as_its_errors_and_roll_it_back(
    tmp_path: Path,
) -> None:
    p, out = rolled_out(tmp_path, linear_model(tmp_path / "candidate.onnx", 0.1), runtime=_Failing)
    p.run(execution=ExecutorOptions(rate_events_per_s=20_000))
    status = p.rollouts["score"].status()
    assert status["state"] == "rolled_back", status["decisions"]
    last = status["decisions"][-1]
    assert "error rate" in last["breaches"] and last["evidence"]["candidate"]["error_rate"] == 1.0, last
    assert {r["model_variant"] for r in out.rows} == {"stable"}  # shadow: no row was the candidate's


def observed(p: Pipeline) -> str:
    """The pipeline's /metrics and dashboard rollouts as a running process shows them; checks
    that both agree with the rollout's status."""
    executor = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    registry = CollectorRegistry()
    registry.register(PipelineCollector(executor))
    metrics = generate_latest(registry).decode()
    (row,) = DashboardState(executor).update()["rollouts"]
    status = p.rollouts["score"].status()
    assert (row["kind"], row["name"], row["state"]) == ("step", "score", status["state"])
    assert row["decisions"][0] == status["decisions"][-1]  # the latest first, with its evidence
    return metrics


@pytest.mark.parametrize(
    ("candidate", "outcome", "breach"),
    [("healthy", "promoted", None), ("shifted", "rolled_back", "output distribution"),
     ("slow", "rolled_back", "p99 latency")],
)  # fmt: skip
def test_a_pipeline_rollout_promotes_or_rolls_back_and_scores_every_event_once(
    tmp_path: Path, candidate: str, outcome: str, breach: str | None
) -> None:
    model = tmp_path / f"{candidate}.onnx"
    if candidate == "slow":
        slow_linear_model(model, 0.1)
    else:
        linear_model(model, 0.1 if candidate == "healthy" else 0.6)
    p, out = rolled_out(tmp_path, model)
    summary = p.run(execution=ExecutorOptions(rate_events_per_s=20_000))  # 3 s: time for every window
    status = p.rollouts["score"].status()
    assert summary.rollouts["score"]["state"] == status["state"]  # in the run summary too
    assert status["state"] == outcome, status["decisions"]
    decisions = [d["decision"] for d in status["decisions"] if d["decision"] != "wait"]
    if breach is None:
        assert decisions == ["start", "pass", "pass", "promote"]
    else:
        assert decisions[-1] == "rollback" and breach in status["decisions"][-1]["breaches"]
    ids = [r["id"] for r in out.rows]
    assert len(ids) == EVENTS and len(set(ids)) == EVENTS  # each event scored once
    variants = {r["model_variant"] for r in out.rows}
    shown = observed(p)
    assert f'aisp_step_rollout_state{{candidate="candidate",stage="score",state="{outcome}"}} 1.0' in shown
    if breach is None:
        assert variants == {"stable", "candidate"}
    elif status["decisions"][-1]["stage"] == "shadow":  # the candidate never answered a row
        assert variants == {"stable"}
    else:
        assert "stable" in variants
