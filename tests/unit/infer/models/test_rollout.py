"""Canary rollout decisions on a controlled clock: a healthy candidate is promoted through every
step, a slower, failing or shifted one is rolled back with its evidence, a step waits for enough
samples, and a key sticks to one version."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aisp.errors import ConfigError
from aisp.infer.models.rollout import Rollout, RolloutPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**policy: Any) -> tuple[Rollout, Clock, list[str]]:
    clock, finished = Clock(), []
    settings = {"version": 2, "steps": (0.5, 1.0), "window_s": 10.0, "min_samples": 50, **policy}
    rollout = Rollout("fraud", "1", RolloutPolicy(**settings), finished.append, clock=clock)
    return rollout, clock, finished


def traffic(
    rollout: Rollout,
    clock: Clock,
    n: int,
    *,
    candidate_ms: float = 2.0,
    shift: float = 0.0,
    fail: float = 0.0,
) -> None:
    """``n`` requests over the next 11 s: the stable version answers in ~2 ms, the candidate in
    ``candidate_ms``, with scores shifted by ``shift`` and a ``fail`` share of errors."""
    rng = np.random.default_rng(len(rollout.decisions))
    for i in range(n):
        clock.now += 11.0 / n
        version, shadow = rollout.route(f"user-{i}")
        targets = [version] + ([rollout.candidate] if shadow else [])
        for v in targets:
            is_candidate = v == rollout.candidate
            ms = (candidate_ms if is_candidate else 2.0) + rng.random()
            ok = not (is_candidate and rng.random() < fail)
            scores = {"score": rng.random((1, 1)) + (shift if is_candidate else 0.0)}
            rollout.observe(v, ok, int(ms * 1e6), scores if ok else None)


def test_a_healthy_candidate_is_promoted_through_every_step() -> None:
    rollout, clock, finished = make()
    assert rollout.state == "shadow" and rollout.route("k") == ("1", True)
    for _ in range(3):
        traffic(rollout, clock, 400)
    assert finished == ["promote"] and rollout.state == "promoted"
    assert [d["decision"] for d in rollout.decisions] == ["start", "pass", "pass", "promote"]
    assert [d["stage"] for d in rollout.decisions[1:]] == ["shadow", "0.5", "1"]
    assert rollout.route("anyone") == ("2", False) and rollout.share == 1.0
    evidence = rollout.decisions[-1]["evidence"]
    assert evidence["candidate"]["requests"] >= 50 and "psi" in evidence and "ks" in evidence


def test_a_slower_candidate_is_rolled_back_with_the_evidence() -> None:
    rollout, clock, finished = make()
    traffic(rollout, clock, 400, candidate_ms=22.0)
    assert finished == ["rollback"] and rollout.state == "rolled_back"
    last = rollout.decisions[-1]
    assert last["decision"] == "rollback" and last["breaches"] == ["p99 latency"]
    assert last["evidence"]["candidate"]["p99_ms"] > 20 > last["evidence"]["stable"]["p99_ms"]
    assert rollout.route("k") == ("1", False) and rollout.share == 0.0


def test_a_candidate_with_shifted_scores_or_errors_is_rolled_back() -> None:
    shifted, clock, _ = make(shadow=False)
    traffic(shifted, clock, 400, shift=0.5)
    assert shifted.decisions[-1]["breaches"] == ["output distribution"]
    assert shifted.decisions[-1]["evidence"]["psi"] > 0.2
    failing, clock, _ = make(shadow=False)
    traffic(failing, clock, 400, fail=0.1)
    assert failing.decisions[-1]["breaches"] == ["error rate"]


def test_a_step_waits_for_enough_samples() -> None:
    rollout, clock, finished = make(min_samples=500)
    traffic(rollout, clock, 200)
    assert rollout.state == "shadow" and not finished
    assert [d["decision"] for d in rollout.decisions] == ["start", "wait"]
    traffic(rollout, clock, 400)  # enough now: the step is judged
    assert rollout.decisions[-1]["decision"] == "pass" and rollout.state == "canary"


def test_a_key_sticks_to_one_version_and_the_share_holds() -> None:
    rollout, clock, _ = make(shadow=False, steps=(0.1, 1.0))
    picks = [rollout.route(f"user-{i}")[0] for i in range(5000)]
    assert picks == [rollout.route(f"user-{i}")[0] for i in range(5000)]
    assert 0.08 < picks.count("2") / len(picks) < 0.12
    unkeyed = [rollout.route(None)[0] for _ in range(5000)]
    assert 0.08 < unkeyed.count("2") / len(unkeyed) < 0.12


def test_an_operator_can_roll_back() -> None:
    rollout, _, finished = make()
    rollout.abort("stopped by an operator")
    assert finished == ["rollback"] and rollout.decisions[-1]["breaches"] == ["aborted"]
    assert rollout.status()["state"] == "rolled_back"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"steps": (0.5, 0.1, 1.0)}, "must rise"),
        ({"steps": (0.1, 0.5)}, "last rollout step must be 1"),
        ({"steps": (0.0, 1.0)}, "must rise within"),
        ({"window_s": 0}, "must be positive"),
        ({"colour": "blue"}, "unknown field"),
        ({"version": "two"}, "Expected `int`"),
    ],
)
def test_bad_policies_are_refused_clearly(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RolloutPolicy.parse({"version": 2, **settings})
