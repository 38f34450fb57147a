"""What a topology update carries: the state of each stateful step the new graph keeps with the
same state columns (or through its declared migration), with its key space; the rest is dropped
and reported."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from aisp import CollectSink, Pipeline, WorkloadFSource
from aisp.errors import ConfigError
from aisp.schedule.checkpointing.savepoints import carry_state


def graph(*, stats_id: str = "user_stats", key_id: str = "by_user") -> Pipeline:
    p = Pipeline("fraud")
    src = p.source("events", WorkloadFSource(events=10))
    stats = src.key_by(key_id, "user").running_stats(stats_id, "amount", count="n", mean="mean_amount")
    stats.filter("positive", lambda b: b.numpy("amount") > 0).sink("out", CollectSink())
    return p


def savepoint() -> dict[str, dict[str, np.ndarray]]:
    return {
        "user_stats": {"__count": np.array([3, 1], dtype=np.int64), "__sum": np.array([30.0, 5.0])},
        "gone_step": {"x": np.array([1, 2], dtype=np.int64)},
    }


def test_the_state_of_kept_steps_is_carried_and_the_rest_dropped() -> None:
    carried, report = carry_state(savepoint(), graph().build(), {}, ["by_user"])
    assert sorted(carried) == ["op.user_stats"]
    assert report == {"carried": ["user_stats"], "migrated": [], "new": [], "dropped": ["gone_step"]}


def test_a_renamed_step_starts_empty_and_a_renamed_key_space_takes_its_state_along() -> None:
    carried, report = carry_state(savepoint(), graph(stats_id="stats_v2").build(), {}, ["by_user"])
    assert report["new"] == ["stats_v2"] and "user_stats" in report["dropped"] and carried == {}
    carried, report = carry_state(savepoint(), graph(key_id="by_account").build(), {}, [])
    assert carried == {} and "user_stats" in report["dropped"]  # its keys are not carried


def test_a_declared_migration_changes_the_state_and_is_checked() -> None:
    def halve(table: pa.Table) -> pa.Table:
        return table.set_column(1, "__sum", pa.array(np.asarray(table.column("__sum")) / 2))

    carried, report = carry_state(savepoint(), graph().build(), {"user_stats": halve}, ["by_user"])
    assert report["migrated"] == ["user_stats"]
    assert carried["op.user_stats"].column("__sum").to_pylist() == [15.0, 2.5]
    with pytest.raises(ConfigError, match="its migration gives state columns"):
        carry_state(
            savepoint(), graph().build(), {"user_stats": lambda t: t.drop_columns(["__sum"])}, ["by_user"]
        )


def test_state_of_another_layout_is_not_carried_without_a_migration() -> None:
    other = savepoint()
    other["user_stats"] = {"__count": np.array([3.0, 1.0]), "__sum": np.array([30.0, 5.0])}
    carried, report = carry_state(other, graph().build(), {}, ["by_user"])
    assert "op.user_stats" not in carried and report["dropped"] == ["user_stats", "gone_step"]
