"""Model steps of a pipeline that expand into several steps of its graph: a model per tier
(``Stream.infer_by_tier``, ``expand_by_tier``), and a rollout of a candidate model over the
stable one (``Stream.infer_rollout``), with the steps, comparisons and decisions of
``aisp.infer.models.rollout``.

The step expands into a few steps of the graph:

* ``{step}.route`` sends each row to ``{step}.stable`` or ``{step}.candidate`` (two infer
  steps): to the candidate when the hash of its key (the key code of the preceding ``key_by``,
  else the event id) falls under the candidate's traffic share, so a key sticks to one model;
* while the rollout shadows, ``{step}.shadow`` (an infer step of the candidate) also scores a
  copy of every row, observed and then dropped (``{step}.shadow.drop``, into
  ``{step}.shadow.sink``);
* ``{step}.stable.enter`` / ``{step}.candidate.enter`` / ``{step}.shadow.enter`` note when
  rows enter a model's branch, and after each model ``{step}.stable.observe`` /
  ``{step}.candidate.observe`` hand the rollout the latency the model step added (queueing in
  its batcher and the call) and the first output's values: a shadow copy, which reaches its
  model after the stable branch has taken the row, is not charged for that wait;
* ``{step}`` unites the two branches; each row's ``model_variant`` says which model scored it.
* rows a model step dead-letters (a failed call, rows past their deadline) count as that
  model's errors in the rollout's error rate.

A rollback sends every row to the stable model again, a promotion every row to the candidate;
the decisions are in the run's log and ``Rollout.status()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from aisp.batch import ID, KEY, TIER, Batch
from aisp.infer.models.rollout import Rollout, RolloutPolicy
from aisp.sinks.memory import NullSink

__all__ = ["expand_by_tier", "expand_rollout"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ENTERED = "__rollout_entered_ns"  # when a row entered a model's branch


def _buckets(batch: Batch) -> Any:
    """Each row's bucket in [0, 10000): the hash of its key code (after ``key_by``) or id."""
    keys = batch.numpy(KEY) if KEY in batch.column_names else batch.numpy(ID)
    with np.errstate(over="ignore"):
        mixed = keys.astype(np.uint64) * _GOLDEN
    return (mixed >> np.uint64(40)) % np.uint64(10_000)


def expand_rollout(
    stream: Any,
    step_id: str,
    stable: Any,
    candidate: Any,
    policy: RolloutPolicy,
    *,
    infer: Mapping[str, Any],
    on_decision: Callable[[str], None] | None = None,
) -> tuple[Any, Rollout]:
    """The steps of a rollout model step after ``stream`` (see the module docstring); the
    united stream and the ``Rollout``. ``infer``: the infer steps' keyword arguments."""
    rollout = Rollout(step_id, "stable", policy, on_decision or (lambda _: None), candidate="candidate")

    def to_candidate(batch: Batch) -> Any:
        if rollout.state in ("promoted", "guarded"):
            return np.ones(batch.num_rows, dtype=bool)
        return _buckets(batch) < int(rollout.share * 10_000)

    def enter(batch: Batch) -> Batch:
        return batch.with_columns({_ENTERED: np.full(batch.num_rows, time.monotonic_ns(), dtype=np.int64)})

    def observe(variant: str) -> Callable[[Batch], Batch]:
        first = next(iter(infer["outputs"].values()))

        def look(batch: Batch) -> Batch:
            if rollout.watching and batch.num_rows:
                latency_ms = (time.monotonic_ns() - batch.numpy(_ENTERED)) / 1e6
                rollout.observe_rows(variant, latency_ms, batch.numpy(first))
            return batch.drop([_ENTERED]).with_columns({"model_variant": np.full(batch.num_rows, variant)})

        return look

    routed = stream.route(
        f"{step_id}.route", ["candidate", "stable"], predicates={"candidate": to_candidate}, default="stable"
    )
    branches = []

    def failed(variant: str) -> Callable[[int], None]:
        return lambda rows: rollout.observe_rows(variant, np.empty(0), None, errors=rows)

    def counting(sid: str, variant: str) -> None:
        """The infer step ``sid``'s dead-lettered rows count as ``variant``'s errors."""
        graph = stream.pipeline.graph
        graph.replace(sid, spec=replace(graph.node(sid).spec, on_failed=failed(variant)))

    for variant, runtime in (("stable", stable), ("candidate", candidate)):
        entered = routed[variant].map_batch(f"{step_id}.{variant}.enter", enter)
        scored = entered.infer(f"{step_id}.{variant}", runtime, **infer)
        counting(f"{step_id}.{variant}", variant)
        branches.append(scored.map_batch(f"{step_id}.{variant}.observe", observe(variant)))
    if policy.shadow:
        copies = stream.filter(
            f"{step_id}.shadow.take", lambda b: np.full(b.num_rows, rollout.state == "shadow")
        )
        shadowed = copies.map_batch(f"{step_id}.shadow.enter", enter).infer(
            f"{step_id}.shadow", candidate, **infer
        )
        counting(f"{step_id}.shadow", "candidate")
        seen = shadowed.map_batch(f"{step_id}.shadow.observe", observe("candidate"))
        dropped = seen.filter(f"{step_id}.shadow.drop", lambda b: np.zeros(b.num_rows, dtype=bool))
        dropped.sink(f"{step_id}.shadow.sink", NullSink())
    return stream.pipeline.union(step_id, *branches), rollout


def expand_by_tier(
    stream: Any, step_id: str, variants: Mapping[int, Any], default: Any, *, infer: Mapping[str, Any]
) -> Any:
    """The steps of a model step whose model depends on the row's tier (``Stream.infer_by_tier``):
    ``{step}.route`` -> one infer step per model (``{step}.tier<N>``, ``{step}.default``) ->
    ``{step}`` (a union)."""

    def tier_is(tier: int) -> Callable[[Batch], Any]:
        return lambda batch: batch.meta(TIER) == tier

    names = [f"tier{t}" for t in variants]
    predicates = {f"tier{t}": tier_is(t) for t in variants}
    routed = stream.route(f"{step_id}.route", [*names, "default"], predicates=predicates, default="default")
    scored = [routed[f"tier{t}"].infer(f"{step_id}.tier{t}", rt, **infer) for t, rt in variants.items()]
    scored.append(routed["default"].infer(f"{step_id}.default", default, **infer))
    return stream.pipeline.union(step_id, *scored)
