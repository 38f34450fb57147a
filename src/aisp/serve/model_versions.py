"""The versions of one served model that are live at once, as its version policy says.

Each live version is a ``Served`` of its own (the version's runtime, its own dynamic batcher and
statistics), addressed by version number; a request that names no version goes to the newest
live one, as Triton does. ``reconcile`` moves the set of live versions to what the policy (or an
explicit load) asks: the versions missing are built and warmed up first, then published at once
with the newest as the default, then the versions no longer wanted are closed after a grace
period (requests that found them before the switch are answered by them: their queues drain), so
a hot swap fails no request. Other models are never touched.

During a rollout (``aisp.infer.rollout``) a request that names no version goes where the
rollout routes it (the stable version, the candidate, or the stable one with a shadow copy to
the candidate); a promotion retires the old stable version, a rollback the candidate (unless
the policy keeps it for inspection).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from aisp.errors import BadRequest, ModelError, NotFound
from aisp.infer.rollout import Rollout, RolloutPolicy
from aisp.serve.served import Served

__all__ = ["ModelVersions", "wanted_versions"]

log = logging.getLogger("aisp.serve")


def wanted_versions(selected: list[int], version: int | None) -> list[int]:
    """The versions to serve: those the policy ``selected`` from what is on disk, and an
    explicitly loaded ``version`` (alone when the policy serves one version: a swap to it).

    >>> wanted_versions([1, 2], None), wanted_versions([2], 1), wanted_versions([2, 3], 1)
    ([1, 2], [1], [1, 2, 3])
    """
    if version is None:
        return sorted(selected)
    if len(selected) <= 1:
        return [version]
    return sorted({*selected, version})


class ModelVersions:
    """The live versions of model ``name`` (see the module docstring); ``make(version)`` builds
    and starts one."""

    def __init__(self, name: str, make: Callable[[int], Served], *, grace_s: float = 1.0) -> None:
        self.name = name
        self._make = make
        self._grace_s = grace_s
        self.by_version: dict[str, Served] = {}
        self.latest: Served | None = None
        self.rollout: Rollout | None = None
        self._lock = threading.Lock()  # one reconcile at a time

    @property
    def versions(self) -> list[str]:
        """The live versions, ascending."""
        return sorted(self.by_version, key=int)

    def get(self, version: str | None) -> Served:
        """The live ``version`` (the newest when None); ``NotFound`` otherwise."""
        if not version:
            latest, rollout = self.latest, self.rollout
            if latest is None:
                raise NotFound(f"Request for unknown model: {self.name!r} has no version ready")
            if rollout is not None:  # the stable version, until a promotion
                return self.by_version.get(
                    rollout.candidate if rollout.state == "promoted" else rollout.stable, latest
                )
            return latest
        key = str(int(version)) if version.isdigit() else version
        served = self.by_version.get(key)  # one dict read: atomic; reconcile replaces the dict
        if served is None:
            raise NotFound(
                f"Request for unknown model: {self.name!r} version {version} is not found"
                f" (serving: {', '.join(self.versions) or 'none'})"
            )
        return served

    def route(self, version: str | None, key: str | None) -> tuple[Served, Served | None]:
        """The version that answers a request, and the one that gets a shadow copy of it."""
        rollout = self.rollout
        if version or rollout is None:
            return self.get(version), None
        target, shadow = rollout.route(key)
        served = self.by_version.get(target) or self.get(None)
        return served, self.by_version.get(rollout.candidate) if shadow else None

    def observe(self, served: Served, ok: bool, latency_ns: int, outputs: Any) -> None:
        rollout = self.rollout
        if rollout is not None and rollout.active:
            rollout.observe(served.model.version, ok, latency_ns, outputs)

    def start_rollout(self, policy: RolloutPolicy) -> Rollout:
        """Roll ``policy.version`` out over the version requests go to now (loaded first)."""
        if self.rollout is not None and self.rollout.active:
            raise BadRequest(
                f"model {self.name!r}: a rollout of version {self.rollout.candidate} is under way"
            )
        stable = self.get(None).model.version
        candidate = str(policy.version)
        if candidate == stable:
            raise BadRequest(f"model {self.name!r}: version {candidate} is the one serving already")
        self.reconcile(sorted({*map(int, self.by_version), policy.version}))
        rollout = Rollout(self.name, stable, policy, self._finished)
        self.rollout = rollout
        return rollout

    def _finished(self, decision: str) -> None:
        """(A rollout's call, under its lock) retire the version that lost, in the background."""
        rollout = self.rollout
        assert rollout is not None
        if decision == "promote":
            gone = rollout.stable
        elif not rollout.policy.keep_on_rollback:
            gone = rollout.candidate
        else:
            return
        wanted = [int(v) for v in self.by_version if v != gone]
        threading.Thread(target=self.reconcile, args=(wanted,), name="aisp-rollout", daemon=True).start()

    def reconcile(self, wanted: list[int]) -> str:
        """Serve exactly the versions ``wanted``; the newest live version. A version that fails
        to load raises ``ModelError`` and changes nothing."""
        if not wanted:
            raise ModelError(f"model {self.name!r}: no version to serve (check its version_policy)")
        with self._lock:
            keep = {str(v): self.by_version[str(v)] for v in wanted if str(v) in self.by_version}
            built: dict[str, Served] = {}
            try:
                for v in wanted:
                    if str(v) not in keep:
                        built[str(v)] = self._make(v)
            except BaseException:
                for s in built.values():
                    s.batcher.close()
                raise
            live = {**keep, **built}
            retired = [s for v, s in self.by_version.items() if v not in live]
            self.by_version = dict(sorted(live.items(), key=lambda kv: int(kv[0])))
            self.latest = self.by_version[max(live, key=int)]
            rollout = self.rollout
            if rollout is not None and rollout.active and rollout.candidate not in live:
                rollout.abort(f"version {rollout.candidate} is no longer served")
        if built or retired:
            log.info(
                "model %s: serving versions %s (loaded %s, retired %s)", self.name, self.versions,
                sorted(built, key=int), sorted(s.model.version for s in retired),
            )  # fmt: skip
        if retired:
            self._retire(retired)
        return self.latest.model.version

    def _retire(self, retired: list[Served]) -> None:
        """Close ``retired`` versions after the grace period, in the background."""

        def close() -> None:
            for s in retired:
                s.batcher.close()

        if self._grace_s <= 0:
            close()
            return
        timer = threading.Timer(self._grace_s, close)
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        """Close every version now (their queues drain)."""
        with self._lock:
            served, self.by_version, self.latest = list(self.by_version.values()), {}, None
        for s in served:
            s.batcher.close()
