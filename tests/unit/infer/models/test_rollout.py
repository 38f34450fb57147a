"""Canary rollout decisions on a controlled clock: a healthy candidate is promoted through every
step, a slower, failing or shifted one is rolled back with its evidence, a step waits for enough
samples, and a key sticks to one version."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aisp.errors import ConfigError
from aisp.infer.models.rollout import Rollout, RolloutPolicy, SloGuard


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


# -- the SLO guard after promotion ------------------------------------------------------------


def _guarded(seed: int, **guard: Any) -> tuple[Rollout, Clock, list[str], SloGuard]:
    g = SloGuard(
        **{"p99_ms": 10.0, "period_s": 5.0, "periods": 3, "min_samples": 20, "keep_s": 120.0, **guard}
    )
    rollout, clock, finished = make(shadow=False, steps=(0.5, 1.0), window_s=1.0, min_samples=10, guard=g)
    rng = np.random.default_rng(seed)
    while rollout.active:  # the canary steps: healthy
        clock.now += 0.01
        rollout.observe(rollout.route(None)[0], True, int((2 + rng.random()) * 1e6), None)
    assert rollout.state == "guarded", rollout.decisions
    return rollout, clock, finished, g


@pytest.mark.parametrize("seed", range(6))
def test_a_version_that_degrades_after_promotion_is_rolled_back_within_k_plus_one_periods(seed: int) -> None:
    """Promoted and guarded, it answers within the SLO for a seeded while, then misses it (a
    seeded share of its requests slower than p99_ms, or failing): back to the old version within
    K+1 periods of the degradation, with the evidence; the old version was kept for it."""
    rng = np.random.default_rng(seed)
    print("seed", seed)
    rollout, clock, finished, g = _guarded(seed, periods=int(rng.integers(1, 5)))
    assert finished == [] and rollout.share == 1.0 and rollout.route(None) == ("2", False)
    rate = float(rng.uniform(20, 200))  # requests a second
    healthy_s = float(rng.uniform(0, 30))
    slow_share = float(rng.uniform(0.05, 1.0))
    degraded_at = clock.now + healthy_s
    while rollout.state == "guarded" and clock.now < degraded_at + 20 * g.period_s:
        clock.now += float(rng.exponential(1 / rate))
        bad = clock.now >= degraded_at and rng.random() < slow_share
        fails = bad and rng.random() < 0.3
        ms = 3.0 + (50.0 if bad else 0.0) + rng.random()
        rollout.observe(rollout.route(None)[0], not fails, int(ms * 1e6), None)
    assert rollout.state == "rolled_back", rollout.decisions[-3:]
    assert finished == ["rollback"] and rollout.route(None) == ("1", False)
    # the first period fully after the degradation, then K of them: the Kth ends it
    assert clock.now - degraded_at <= (g.periods + 1) * g.period_s + 1.0
    last = rollout.decisions[-1]
    assert last["decision"] == "rollback" and last["breaches"] == ["slo attainment after promotion"]
    assert last["evidence"]["attainment"] < g.attainment or last["evidence"]["error_rate"] > g.max_error_rate
    assert last["evidence"]["misses_in_a_row"] == g.periods


@pytest.mark.parametrize("seed", range(4))
def test_a_healthy_promoted_version_is_never_rolled_back_and_its_promotion_becomes_final(seed: int) -> None:
    """Within its SLO but for rare outliers (under the attainment's allowance), isolated bad
    periods, and quiet periods too small to judge: never rolled back; after keep_s, promoted."""
    rng = np.random.default_rng(seed)
    rollout, clock, finished, g = _guarded(seed, keep_s=60.0)
    bad_period = int(rng.integers(0, 10))  # one period of misses: fewer than K in a row
    while rollout.state == "guarded":
        quiet = int(clock.now / g.period_s) % 7 == 3  # a period with a request or two
        clock.now += float(rng.exponential(1.0 if quiet else 0.02))
        burst = int(clock.now / g.period_s) == bad_period
        slow = burst or rng.random() < 0.002
        rollout.observe(rollout.route(None)[0], True, int((60.0 if slow else 3.0) * 1e6), None)
        assert clock.now < 200, "the guard never ended"
    assert rollout.state == "promoted" and finished == ["promote"], rollout.decisions[-3:]
    assert not any(d["decision"] == "rollback" for d in rollout.decisions)


def test_misses_in_the_cooldown_after_promotion_are_not_judged() -> None:
    rollout, clock, finished, g = _guarded(0, cooldown_s=20.0, periods=1)
    start = clock.now
    while clock.now < start + 19.0:  # the traffic shift's blip
        clock.now += 0.01
        rollout.observe("2", True, int(80e6), None)
    assert rollout.state == "guarded"
    while rollout.state == "guarded" and clock.now < start + 40.0:
        clock.now += 0.01
        rollout.observe("2", True, int(80e6), None)
    assert rollout.state == "rolled_back" and clock.now >= start + 20.0 + g.period_s


def test_guard_settings_that_cannot_work_fail_where_declared() -> None:
    for bad in ({"p99_ms": 0}, {"p99_ms": 5, "attainment": 1.5}, {"p99_ms": 5, "periods": 0},
                {"p99_ms": 5, "keep_s": 0}):  # fmt: skip
        with pytest.raises(ConfigError):
            SloGuard(**bad)
    assert RolloutPolicy.parse({"version": 2, "guard": {"p99_ms": 25}}).guard == SloGuard(p99_ms=25)
