"""The versions of one served model that are live at once, as its version policy says.

Each live version is a ``Served`` of its own (the version's runtime, its own dynamic batcher and
statistics), addressed by version number; a request that names no version goes to the newest
live one, as Triton does. ``reconcile`` moves the set of live versions to what the policy (or an
explicit load) asks: the versions missing are built and warmed up first, then published at once
with the newest as the default, then the versions no longer wanted are closed after a grace
period (requests that found them before the switch are answered by them: their queues drain), so
a hot swap fails no request. Other models are never touched.

During a rollout (``aisp.infer.models.rollout``) a request that names no version goes where the
rollout routes it (the stable version, the candidate, or the stable one with a shadow copy to
the candidate); a promotion retires the old stable version (with an SLO guard, only once the
guard's time is over: until then it stays loaded, so that a rollback after promotion is one
routing change), a rollback the candidate (unless the policy keeps it for inspection).

What a request reads to find its version (the live versions, the default, the rollout) is one
immutable ``Routing``, replaced in one assignment once everything it names is built: a reader
sees the routing before a change or after it, never a mix. So the first rollout of a model
publishes its candidate and the rollout that confines it together, and no request reaches the
candidate outside its share, not even while the rollout starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aisp.errors import BadRequest, ModelError, NotFound
from aisp.infer.models.rollout import Rollout, RolloutPolicy
from aisp.serve.models.served import Served

__all__ = ["ModelVersions", "Routing", "wanted_versions"]

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


@dataclass(frozen=True)
class Routing:
    """Where the requests to one model go: its live versions by number, the newest of them, and
    its rollout (the last one, finished or not). Never changed: a change is a new ``Routing``."""

    by_version: dict[str, Served] = field(default_factory=dict)
    latest: Served | None = None
    rollout: Rollout | None = None

    def default(self) -> Served | None:
        """The version a request that names none goes to, outside a rollout's canary share: the
        newest live one, or, once the model has had a rollout, its stable version until a
        promotion and its candidate after."""
        rollout, latest = self.rollout, self.latest
        if rollout is None or latest is None:
            return latest
        return self.by_version.get(
            rollout.candidate if rollout.state in ("promoted", "guarded") else rollout.stable, latest
        )


class ModelVersions:
    """The live versions of model ``name`` (see the module docstring); ``make(version)`` builds
    and starts one."""

    def __init__(self, name: str, make: Callable[[int], Served], *, grace_s: float = 1.0) -> None:
        self.name = name
        self._make = make
        self._grace_s = grace_s
        self.routing = Routing()
        """What requests read (see the module docstring); replaced whole, under ``_lock``."""
        self._lock = threading.Lock()  # one reconcile at a time

    @property
    def by_version(self) -> dict[str, Served]:
        """The live versions by number (a snapshot: never changed in place)."""
        return self.routing.by_version

    @property
    def latest(self) -> Served | None:
        return self.routing.latest

    @property
    def rollout(self) -> Rollout | None:
        return self.routing.rollout

    @property
    def versions(self) -> list[str]:
        """The live versions, ascending."""
        return sorted(self.routing.by_version, key=int)

    def get(self, version: str | None, routing: Routing | None = None) -> Served:
        """The live ``version`` (the default one when None); ``NotFound`` otherwise."""
        routing = self.routing if routing is None else routing  # one read: one routing per lookup
        if not version:
            served = routing.default()
            if served is None:
                raise NotFound(f"Request for unknown model: {self.name!r} has no version ready")
            return served
        key = str(int(version)) if version.isdigit() else version
        served = routing.by_version.get(key)
        if served is None:
            raise NotFound(
                f"Request for unknown model: {self.name!r} version {version} is not found"
                f" (serving: {', '.join(sorted(routing.by_version, key=int)) or 'none'})"
            )
        return served

    def route(self, version: str | None, key: str | None) -> tuple[Served, Served | None]:
        """The version that answers a request, and the one that gets a shadow copy of it."""
        routing = self.routing
        rollout = routing.rollout
        if version or rollout is None:
            return self.get(version, routing), None
        target, shadow = rollout.route(key)
        served = routing.by_version.get(target) or self.get(None, routing)
        return served, routing.by_version.get(rollout.candidate) if shadow else None

    def observe(self, served: Served, ok: bool, latency_ns: int, outputs: Any) -> None:
        rollout = self.routing.rollout
        if rollout is not None and rollout.watching:
            rollout.observe(served.model.version, ok, latency_ns, outputs)

    def start_rollout(self, policy: RolloutPolicy) -> Rollout:
        """Roll ``policy.version`` out over the version requests go to now: the candidate is
        loaded first, then it and the rollout are published together."""
        rollout = self.routing.rollout
        if rollout is not None and rollout.watching:
            raise BadRequest(f"model {self.name!r}: a rollout of version {rollout.candidate} is under way")
        stable = self.get(None).model.version
        candidate = str(policy.version)
        if candidate == stable:
            raise BadRequest(f"model {self.name!r}: version {candidate} is the one serving already")
        started: list[Rollout] = []

        def start() -> Rollout:
            started.append(Rollout(self.name, stable, policy, self._finished))
            return started[0]

        self.reconcile(sorted({*map(int, self.routing.by_version), policy.version}), rollout=start)
        return started[0]

    def _finished(self, decision: str) -> None:
        """(A rollout's call, under its lock) retire the version that lost, in the background."""
        rollout = self.routing.rollout
        assert rollout is not None
        if decision == "promote":
            gone = rollout.stable
        elif not rollout.policy.keep_on_rollback:
            gone = rollout.candidate
        else:
            return
        threading.Thread(target=self._drop, args=(gone, rollout), name="aisp-rollout", daemon=True).start()

    def _drop(self, version: str, finished: Rollout) -> None:
        """Stop serving ``version``, which lost the rollout ``finished``, unless a rollout started
        since names it (this runs in the background: the versions it keeps are read when it runs,
        and a rollout of the same version started meanwhile is not aborted under it)."""
        with self._lock:
            now = self.routing
            running = now.rollout
            if (
                running is not None
                and running is not finished
                and version in (running.candidate, running.stable)
            ):
                return
            if version not in now.by_version or len(now.by_version) < 2:
                return
            _, built, retired = self._publish([int(v) for v in now.by_version if v != version], None)
        self._announce(built, retired)

    def reconcile(self, wanted: list[int], *, rollout: Callable[[], Rollout] | None = None) -> str:
        """Serve exactly the versions ``wanted``; the newest live version. A version that fails
        to load raises ``ModelError`` and changes nothing. ``rollout`` makes the rollout to
        publish with the new versions (once they are built): a request finds both or neither."""
        if not wanted:
            raise ModelError(f"model {self.name!r}: no version to serve (check its version_policy)")
        with self._lock:
            newest, built, retired = self._publish(wanted, rollout)
        self._announce(built, retired)
        return newest

    def _publish(
        self, wanted: list[int], rollout: Callable[[], Rollout] | None
    ) -> tuple[str, dict[str, Served], list[Served]]:
        """(Under ``_lock``) build what ``wanted`` lacks, publish the new routing in one
        assignment: the newest version, what was built, what is no longer served."""
        now = self.routing
        keep = {str(v): now.by_version[str(v)] for v in wanted if str(v) in now.by_version}
        built: dict[str, Served] = {}
        try:
            for v in wanted:
                if str(v) not in keep:
                    built[str(v)] = self._make(v)
        except BaseException:
            for s in built.values():
                s.batcher.close()
            raise
        live = dict(sorted({**keep, **built}.items(), key=lambda kv: int(kv[0])))
        retired = [s for v, s in now.by_version.items() if v not in live]
        running = rollout() if rollout is not None else now.rollout
        newest = live[max(live, key=int)]
        self.routing = Routing(live, newest, running)  # the one assignment readers see
        if running is not None and running.watching and running.candidate not in live:
            running.abort(f"version {running.candidate} is no longer served")
        return newest.model.version, built, retired

    def _announce(self, built: dict[str, Served], retired: list[Served]) -> None:
        """Log a change of the live versions and close the retired ones after the grace period."""
        if built or retired:
            log.info(
                "model %s: serving versions %s (loaded %s, retired %s)", self.name, self.versions,
                sorted(built, key=int), sorted(s.model.version for s in retired),
            )  # fmt: skip
        if retired:
            self._retire(retired)

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
            served, self.routing = list(self.routing.by_version.values()), Routing()
        for s in served:
            s.batcher.close()
