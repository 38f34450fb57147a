"""Where ``ModelVersions`` sends a request while a rollout starts: checked before every line of
AISP's code that starting it runs, so a moment in which the candidate answers outside its share
is found whenever it exists, not when a request happens to fall into it."""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace
from typing import Any

import pytest

from aisp.errors import BadRequest, ModelError
from aisp.infer.models.rollout import RolloutPolicy
from aisp.serve.models.versions import ModelVersions
from tests.support.stepping import at_every_step

KEYS = [f"user-{i}" for i in range(200)]


class FakeServed:
    """What ``ModelVersions`` reads of a live version: its number, and a batcher to close."""

    def __init__(self, version: int) -> None:
        self.model = SimpleNamespace(version=str(version))
        self.batcher = SimpleNamespace(close=lambda: None)


def bucket(key: str) -> float:
    """Where ``Rollout.route`` places a request's key in [0, 1): below the share, the candidate."""
    return (zlib.crc32(key.encode()) % 10_000) / 10_000


def roll_out(live: list[int], candidate: int, policy: RolloutPolicy) -> tuple[list[str], int, str]:
    """Serve ``live``, then start a rollout of ``candidate`` with ``policy``, checking the route of
    every key at every step: (what went wrong, steps checked, the stable version)."""
    versions = ModelVersions("m", FakeServed, grace_s=0)  # type: ignore[arg-type]
    versions.reconcile(live)
    stable = str(max(live))
    wrong: list[str] = []
    steps = [0]

    def check() -> None:
        steps[0] += 1
        rollout = versions.rollout
        for key in KEYS:
            served, shadow = versions.route(None, key)
            got = served.model.version
            allowed = {stable}
            if rollout is not None and rollout.state == "canary" and bucket(key) < rollout.share:
                allowed.add(str(candidate))
            if got not in allowed:
                state = rollout.state if rollout is not None else "no rollout yet"
                wrong.append(
                    f"step {steps[0]}: key {key!r} answered by {got} ({state}, live {versions.versions})"
                )
                return
            if shadow is not None and shadow.model.version != str(candidate):
                wrong.append(f"step {steps[0]}: a shadow copy went to {shadow.model.version}")
                return

    rollout = at_every_step(lambda: versions.start_rollout(policy), check)
    assert rollout.state == ("shadow" if policy.shadow else "canary")
    assert versions.get(str(candidate)).model.version == str(candidate)
    return wrong, steps[0], stable


def test_the_first_rollout_in_shadow_never_lets_the_candidate_answer() -> None:
    policy = RolloutPolicy(version=2, window_s=3600)
    wrong, steps, stable = roll_out([1], 2, policy)
    assert wrong == []
    assert steps > 10 and stable == "1"


def test_rollouts_keep_every_request_within_the_candidates_share() -> None:
    """A seeded family: live versions, candidate (newer, older, or already live), shadow or
    not, first share."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for case in range(60):
        live = sorted(rng.sample(range(1, 10), rng.randint(1, 3)))
        candidate = rng.choice([v for v in range(1, 11) if v != max(live)])
        if case < 10:
            candidate = max(live) + rng.randint(1, 3)  # the newest version: it would be the default
        first = rng.choice([0.01, 0.1, 0.5, 0.9])
        policy = RolloutPolicy(
            version=candidate, shadow=rng.random() < 0.6, steps=(first, 1.0), window_s=3600
        )
        wrong, _, _ = roll_out(live, candidate, policy)
        assert wrong == [], f"seed {seed}, case {case}: live {live}, {policy}: {wrong[:3]}"


def test_a_rollout_that_cannot_start_changes_no_routing() -> None:
    def make(version: int) -> FakeServed:
        if version == 3:
            raise ModelError("version 3 contradicts its config.pbtxt")
        return FakeServed(version)

    versions = ModelVersions("m", make, grace_s=0)  # type: ignore[arg-type]
    versions.reconcile([1])
    before = versions.routing
    with pytest.raises(ModelError, match="contradicts"):
        versions.start_rollout(RolloutPolicy(version=3, window_s=3600))
    with pytest.raises(BadRequest, match="version 1 is the one serving"):
        versions.start_rollout(RolloutPolicy(version=1, window_s=3600))
    assert versions.routing is before and versions.rollout is None
    versions.start_rollout(RolloutPolicy(version=2, window_s=3600))
    during = versions.routing
    with pytest.raises(BadRequest, match="rollout of version 2 is under way"):
        versions.start_rollout(RolloutPolicy(version=4, window_s=3600))
    assert versions.routing is during and versions.versions == ["1", "2"]


@pytest.mark.parametrize("ending", ["rollback", "promote"])
def test_a_rollout_of_the_version_that_just_lost_is_not_aborted_by_the_late_retire_job(
    monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """A finished rollout retires the version that lost in the background; a rollout of that
    same version started before the job runs must keep it (the job read the versions to keep
    when it was made, and aborted the new rollout: "version 2 is no longer served")."""
    import numpy as np

    import aisp.serve.models.versions as module

    jobs: list[tuple[Any, tuple[Any, ...]]] = []

    class Held:  # the retire job, held until the test runs it
        def __init__(self, target: Any, args: tuple[Any, ...], **_: Any) -> None:
            jobs.append((target, args))

        def start(self) -> None:
            pass

    monkeypatch.setattr(module.threading, "Thread", Held)
    versions = ModelVersions("m", FakeServed, grace_s=0)  # type: ignore[arg-type]
    versions.reconcile([1])
    first = versions.start_rollout(
        RolloutPolicy(version=2, shadow=False, steps=(1.0,), window_s=1e-9, min_samples=1)
    )
    if ending == "rollback":
        first.abort("an operator's call")
        again = 2  # the same candidate, tried again
    else:
        for v in ("1", "2"):
            first.observe_rows(v, np.array([1.0]), np.array([0.5]))
        assert first.state == "promoted"
        again = 1  # back to the old stable version, as a rollout
    assert len(jobs) == 1
    second = versions.start_rollout(RolloutPolicy(version=again, window_s=3600))
    target, args = jobs.pop()
    target(*args)  # the job runs late
    assert second.active, second.decisions[-1]
    assert versions.versions == ["1", "2"]
    served, shadow = versions.route(None, "user-1")
    assert shadow is not None and shadow.model.version == str(again)
