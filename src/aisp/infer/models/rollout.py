"""Canary rollout of a new model version with automatic rollback.

A rollout moves the requests that name no version from the stable version to a candidate in
steps. First, optionally, **shadow**: every request is answered by the stable version and a copy
goes to the candidate, whose answer is discarded (its latency, errors and scores are kept).
Then the candidate takes a share of the traffic at each step (``steps``, e.g. 1% -> 10% -> 50%
-> 100%), chosen by the hash of the request's ``rollout_key`` parameter when it has one (a key
sticks to one version) or at random.

Each step lasts at least ``window_s`` and until both versions have ``min_samples`` requests in
it (at 100% the stable version's last full window stands for it). Then the candidate's window
is compared with the stable one's: p99 latency (a breach above ``p99_ratio`` times the stable
p99 plus ``p99_slack_ms``), error rate (errors and timeouts; a breach ``max_error_rate`` above
the stable rate) and the distribution of the first output's values (PSI over the stable
values' deciles, a breach above ``max_psi``; the KS statistic is reported beside it). A breach
rolls back at once: the traffic returns to the stable version and the candidate is retired (or
kept, addressable by number only, for inspection). A pass moves to the next step; a pass of the
last step promotes the candidate and retires the old stable version. Every decision is kept with
its evidence (the windows' figures) and logged.

**After promotion**, a ``guard`` (``SloGuard``) holds the new version to an absolute SLO: it takes
all the traffic while the old stable version stays loaded (``keep_s``); its requests are judged
in periods (``period_s``): a period whose attainment (the share of requests answered within
``p99_ms``, errors counting as misses) is under ``attainment``, or whose error rate is over
``max_error_rate``, beyond what its number of requests leaves to chance (the Wilson 95% bound
of the proportion: 2 slow requests in 250 are not a miss of 99.5%), is a miss. ``periods``
misses in a row (hysteresis) roll back to the old version at once (the requests in flight are
answered by the version they reached); a period
with fewer than ``min_samples`` requests is not judged, and none is in the ``cooldown_s`` after
promotion (the traffic shift's own blip). ``keep_s`` after promotion without a rollback, the
promotion is final and the old version retired. A guard acts once per rollout and a rolled back
version needs a new rollout to come back: it never flaps.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError
from aisp.observe.clock import wall_ms
from aisp.observe.drift import ks_statistic, psi

__all__ = ["Rollout", "RolloutPolicy", "SloGuard"]

log = logging.getLogger("aisp.rollout")

_SCORES_KEPT = 20_000  # output values kept per version and step


class SloGuard(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The SLO a promoted version is held to (see the module docstring)."""

    p99_ms: float
    attainment: float = 0.995
    max_error_rate: float = 0.01
    period_s: float = 10.0
    periods: int = 3
    min_samples: int = 50
    cooldown_s: float = 0.0
    keep_s: float = 300.0

    def __post_init__(self) -> None:
        if self.p99_ms <= 0 or self.period_s <= 0 or self.keep_s <= 0 or self.cooldown_s < 0:
            raise ConfigError("guard: p99_ms, period_s and keep_s must be > 0, cooldown_s >= 0")
        if not 0.0 < self.attainment <= 1.0 or not 0.0 <= self.max_error_rate <= 1.0:
            raise ConfigError("guard: attainment must be in (0, 1], max_error_rate in [0, 1]")
        if self.periods < 1 or self.min_samples < 1:
            raise ConfigError("guard: periods and min_samples must be >= 1")


class RolloutPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a candidate version is rolled out (see the module docstring). ``version``: the
    candidate's version number (a served model's; a pipeline step's is informative)."""

    version: int = 0
    steps: tuple[float, ...] = (0.01, 0.1, 0.5, 1.0)
    shadow: bool = True
    window_s: float = 30.0
    min_samples: int = 200
    p99_ratio: float = 1.5
    p99_slack_ms: float = 5.0
    max_error_rate: float = 0.01
    max_psi: float = 0.2
    keep_on_rollback: bool = False
    guard: SloGuard | None = None

    def __post_init__(self) -> None:
        steps = self.steps
        if not steps or any(not 0 < s <= 1 for s in steps) or list(steps) != sorted(set(steps)):
            raise ConfigError(f"rollout steps must rise within (0, 1], got {list(steps)}")
        if steps[-1] != 1:
            raise ConfigError(f"the last rollout step must be 1 (all the traffic), got {steps[-1]}")
        if self.window_s <= 0 or self.min_samples < 1 or self.p99_ratio < 1 or self.max_psi <= 0:
            raise ConfigError("rollout window_s, min_samples, p99_ratio >= 1 and max_psi must be positive")

    @classmethod
    def parse(cls, data: Any) -> RolloutPolicy:
        """A policy from decoded JSON or TOML; ``ConfigError`` says what is wrong."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"rollout policy: {exc}") from exc


class _Window:
    """One version's requests (or rows) during a step."""

    def __init__(self) -> None:
        self.latencies_ms: list[npt.NDArray[np.float64]] = []
        self.answered = 0
        self.errors = 0
        self.scores: list[npt.NDArray[np.float64]] = []
        self.kept = 0

    @property
    def n(self) -> int:
        return self.answered + self.errors

    def add(self, errors: int, latencies_ms: npt.NDArray[Any], scores: npt.NDArray[Any] | None) -> None:
        self.errors += errors
        if not latencies_ms.size:
            return
        self.latencies_ms.append(np.asarray(latencies_ms, dtype=np.float64))
        self.answered += latencies_ms.size
        if scores is not None and self.kept < _SCORES_KEPT:
            values = np.asarray(scores, dtype=np.float64).ravel()[: _SCORES_KEPT - self.kept]
            self.scores.append(values)
            self.kept += values.size

    def figures(self) -> dict[str, Any]:
        lat = np.concatenate(self.latencies_ms) if self.latencies_ms else np.empty(0)
        return {
            "requests": self.n,
            "p99_ms": round(float(np.percentile(lat, 99)), 3) if lat.size else None,
            "mean_ms": round(float(lat.mean()), 3) if lat.size else None,
            "error_rate": round(self.errors / self.n, 4) if self.n else 0.0,
        }

    def values(self) -> npt.NDArray[np.float64]:
        return np.concatenate(self.scores) if self.scores else np.empty(0)


def _wilson(k: int, n: int, *, upper: bool, z: float = 1.96) -> float:
    """The Wilson score interval's upper (or lower) bound of the proportion ``k / n``.

    >>> round(_wilson(248, 250, upper=True), 4), round(_wilson(0, 250, upper=False), 4)
    (0.9978, 0.0)
    """
    p = k / n
    centre = p + z * z / (2 * n)
    margin = z * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)))
    return (centre + margin if upper else centre - margin) / (1 + z * z / n)


def _distribution(stable: npt.NDArray[np.float64], canary: npt.NDArray[np.float64]) -> dict[str, float]:
    """PSI of ``canary`` over the deciles of ``stable``, and the two-sample KS statistic."""
    if stable.size < 10 or canary.size < 10:
        return {}
    edges = np.unique(np.quantile(stable, np.linspace(0, 1, 11)[1:-1]))
    ref = np.bincount(np.searchsorted(edges, stable, side="right"), minlength=edges.size + 1) / stable.size
    now = np.bincount(np.searchsorted(edges, canary, side="right"), minlength=edges.size + 1) / canary.size
    ks = ks_statistic(np.sort(stable)[:, None], canary[:, None])
    return {"psi": round(float(psi(ref[None], now[None])[0]), 4), "ks": round(float(ks[0]), 4)}


class Rollout:
    """A rollout of ``policy.version`` over ``stable`` for model ``model`` (see the module
    docstring). ``finish(decision)`` is called once, with "promote" or "rollback"."""

    def __init__(
        self,
        model: str,
        stable: str,
        policy: RolloutPolicy,
        finish: Callable[[str], None],
        *,
        candidate: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.stable, self.policy = model, stable, policy
        self.candidate = candidate if candidate is not None else str(policy.version)
        self._finish, self._clock = finish, clock
        self._stages = ([0.0] if policy.shadow else []) + list(policy.steps)
        self._stage = 0
        self.state = "shadow" if policy.shadow else "canary"
        self.decisions: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._windows = {stable: _Window(), self.candidate: _Window()}
        self._reference: _Window | None = None
        self._since = clock()
        self._waiting_logged = False
        self._rng = random.Random()
        self._decide("start", {}, [])

    @property
    def active(self) -> bool:
        """Shadowing or in a canary step: the traffic is split."""
        return self.state in ("shadow", "canary")

    @property
    def watching(self) -> bool:
        """Its requests are still judged: split, or guarded after promotion."""
        return self.state in ("shadow", "canary", "guarded")

    @property
    def share(self) -> float:
        """The candidate's share of the traffic now (0 while shadowing)."""
        if self.state in ("promoted", "guarded"):
            return 1.0
        return self._stages[self._stage] if self.active else 0.0

    def route(self, key: str | None) -> tuple[str, bool]:
        """The version a request without one goes to, and whether a shadow copy goes to the
        candidate."""
        state = self.state
        if state == "shadow":
            return self.stable, True
        if state == "canary":
            share = self._stages[self._stage]
            pick = (zlib.crc32(key.encode()) % 10_000) / 10_000 if key is not None else self._rng.random()
            return (self.candidate if pick < share else self.stable), False
        return (self.candidate if state in ("promoted", "guarded") else self.stable), False

    def observe(self, version: str, ok: bool, latency_ns: int, outputs: Mapping[str, Any] | None) -> None:
        """A request answered (or failed) by ``version``."""
        if not self.watching:
            return
        scores = next(iter(outputs.values())) if outputs and ok else None
        latencies = np.array([latency_ns / 1e6]) if ok else np.empty(0)
        self.observe_rows(version, latencies, scores, errors=0 if ok else 1)

    def observe_rows(
        self,
        version: str,
        latencies_ms: npt.NDArray[Any],
        scores: npt.NDArray[Any] | None,
        *,
        errors: int = 0,
    ) -> None:
        """Rows (a pipeline's) answered by ``version``, with their latencies and scores, and
        ``errors`` that failed."""
        if not self.watching:
            return
        with self._lock:
            if self.state == "guarded":
                self._guarded(version, latencies_ms, errors)
                return
            window = self._windows.get(version) if self.active else None  # (decided meanwhile)
            if window is None:
                return
            window.add(errors, latencies_ms, scores)
            if self._clock() - self._since >= self.policy.window_s:
                self._evaluate()

    def abort(self, reason: str) -> None:
        """Roll back now (an operator's call)."""
        with self._lock:
            if self.watching:
                self._rollback({"reason": reason}, ["aborted"])

    def _evaluate(self) -> None:
        stable_window = self._windows[self.stable]
        stable = stable_window if stable_window.n >= self.policy.min_samples else self._reference
        canary = self._windows[self.candidate]
        if stable is None or canary.n < self.policy.min_samples:
            if not self._waiting_logged:
                have = {"stable": stable_window.n, "candidate": canary.n}
                self._decide("wait", {"samples": have, "needed": self.policy.min_samples}, [])
                self._waiting_logged = True
            return
        p = self.policy
        s, c = stable.figures(), canary.figures()
        evidence: dict[str, Any] = {
            "stable": s,
            "candidate": c,
            **_distribution(stable.values(), canary.values()),
        }
        breaches = []
        if (
            c["p99_ms"] is not None
            and s["p99_ms"] is not None
            and c["p99_ms"] > s["p99_ms"] * p.p99_ratio + p.p99_slack_ms
        ):
            breaches.append("p99 latency")
        if c["error_rate"] - s["error_rate"] > p.max_error_rate:
            breaches.append("error rate")
        if evidence.get("psi", 0.0) > p.max_psi:
            breaches.append("output distribution")
        if breaches:
            self._rollback(evidence, breaches)
            return
        if stable is stable_window:
            self._reference = stable_window
        if self._stage + 1 == len(self._stages):
            if p.guard is not None:
                self._guard_start(evidence)
                return
            self.state = "promoted"
            self._decide("promote", evidence, [])
            self._finish("promote")
            return
        self._decide("pass", evidence, [])
        self._stage += 1
        self.state = "canary"
        self._windows = {self.stable: _Window(), self.candidate: _Window()}
        self._since = self._clock()
        self._waiting_logged = False

    # -- the SLO guard after promotion ------------------------------------------------------
    def _guard_start(self, evidence: dict[str, Any]) -> None:
        self.state = "guarded"
        self._promoted_at = self._clock()
        self._period = _Window()
        self._period_start = self._promoted_at + (self.policy.guard.cooldown_s if self.policy.guard else 0.0)
        self._misses = 0
        self._good_rows = 0
        self._decide("guard", evidence, [])

    def _guarded(self, version: str, latencies_ms: npt.NDArray[Any], errors: int) -> None:
        """(Under the lock) the promoted version's rows, judged by period."""
        guard = self.policy.guard
        assert guard is not None
        now = self._clock()
        if now - self._promoted_at >= guard.keep_s:
            self.state = "promoted"
            self._decide("promote", {"guarded_s": round(now - self._promoted_at, 3)}, [])
            self._finish("promote")
            return
        if version != self.candidate or now < self._period_start:
            return  # the old version's last answers; the cool-down after the traffic shift
        self._period.add(errors, latencies_ms, None)
        self._good_rows += int((np.asarray(latencies_ms) <= guard.p99_ms).sum())
        if now - self._period_start < guard.period_s:
            return
        period, good = self._period, self._good_rows
        self._period, self._good_rows, self._period_start = _Window(), 0, now
        if period.n < guard.min_samples:
            return  # too few requests to judge
        figures = period.figures()
        attained = good / period.n
        # a miss is what the period shows beyond its noise: the attainment's 95% upper bound
        # under the target, or the error rate's lower bound over its limit
        missed = (
            _wilson(good, period.n, upper=True) < guard.attainment
            or _wilson(period.errors, period.n, upper=False) > guard.max_error_rate
        )
        self._misses = self._misses + 1 if missed else 0
        evidence = {**figures, "attainment": round(attained, 5), "misses_in_a_row": self._misses,
                    "slo": msgspec.to_builtins(guard)}  # fmt: skip
        if missed and self._misses >= guard.periods:
            self._rollback(evidence, ["slo attainment after promotion"])
        elif missed:
            self._decide("slo_miss", evidence, [])

    def _rollback(self, evidence: dict[str, Any], breaches: list[str]) -> None:
        self.state = "rolled_back"
        self._decide("rollback", evidence, breaches)
        self._finish("rollback")

    def _decide(self, decision: str, evidence: dict[str, Any], breaches: list[str]) -> None:
        stage = "shadow" if self._stages[self._stage] == 0.0 else f"{self._stages[self._stage]:g}"
        entry = {
            "at_ms": wall_ms(),
            "decision": decision,
            "stage": stage,
            "breaches": breaches,
            "evidence": evidence,
        }
        self.decisions.append(entry)
        log.info(
            "model %s: rollout of version %s over %s: %s at %s%s %s", self.model, self.candidate,
            self.stable, decision, stage, f" ({', '.join(breaches)})" if breaches else "", evidence,
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "model": self.model,
                "stable": self.stable,
                "candidate": self.candidate,
                "state": self.state,
                "share": self.share,
                "steps": ["shadow" if s == 0 else s for s in self._stages],
                "policy": msgspec.to_builtins(self.policy),
                "decisions": list(self.decisions),
            }
