"""The repository side of the model server: which models and versions are live.

``ModelControl`` loads and unloads models (each a ``ModelVersions``: the versions its policy
selects, live at once), and answers the repository index, metadata, readiness and statistics;
``ModelServer`` (``aisp.serve.models.server``) adds inference on top. Rollouts of a new version
(``aisp.infer.models.rollout``) start, report and stop here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from aisp.errors import AispError, BadRequest, NotFound
from aisp.infer.models.repository import ModelRepository, check_model_name
from aisp.infer.models.rollout import RolloutPolicy
from aisp.infer.models.versions import ServedModel
from aisp.serve.models.served import Served
from aisp.serve.models.versions import ModelVersions, wanted_versions
from aisp.serve.oip.request import Signature, TensorSignature

__all__ = ["MODEL_CONTROL_OFF", "ModelControl"]

MODEL_CONTROL_OFF = (
    "explicit model load / unload is not allowed: model control is off on this server"
    " (start it with --allow-model-control, or configure admin tokens)"
)
"""Why a load or unload is refused while model control is off (HTTP 403, gRPC PERMISSION_DENIED)."""


class ModelControl:
    """Live models and versions (see the module docstring); ``_make(name, version)`` builds and
    starts one version's ``Served``."""

    repository: ModelRepository

    def __init__(self) -> None:
        self._served: dict[str, ModelVersions] = {}
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # loads, unloads and rollouts one at a time

    def _make(self, name: str, version: int) -> Served:
        raise NotImplementedError

    # -- rollouts -----------------------------------------------------------------------------
    def start_rollout(self, name: str, policy: RolloutPolicy) -> dict[str, Any]:
        """Roll ``policy.version`` of ``name`` out (loading it beside the serving version)."""
        with self._loading:
            versions = self._versions(name)
            if policy.version not in self.repository.versions(name):
                raise NotFound(f"model {name!r} has no version {policy.version} in the repository")
            return versions.start_rollout(policy).status()

    def rollout(self, name: str) -> dict[str, Any]:
        """The status of ``name``'s rollout (the last one, when none is under way)."""
        rollout = self._versions(name).rollout
        if rollout is None:
            raise NotFound(f"model {name!r} has had no rollout")
        return rollout.status()

    def abort_rollout(self, name: str) -> dict[str, Any]:
        """Roll ``name``'s rollout back now."""
        rollout = self._versions(name).rollout
        if rollout is None or not rollout.watching:
            raise NotFound(f"model {name!r} has no rollout under way")
        rollout.abort("stopped by an operator")
        return rollout.status()

    def rollouts(self) -> dict[str, dict[str, Any]]:
        """Every model's rollout status, for metrics and the dashboard."""
        with self._lock:
            served = dict(self._served)
        return {name: v.rollout.status() for name, v in sorted(served.items()) if v.rollout is not None}

    def _versions(self, name: str) -> ModelVersions:
        versions = self._served.get(name)  # one dict read: atomic; writers hold the lock
        if versions is None:
            check_model_name(name)  # a name that could never be a model is a bad request
            raise NotFound(f"Request for unknown model: {name!r} is not found")
        return versions

    def _route(self, name: str, version: str | None, key: str | None) -> tuple[Served, Served | None]:
        """The version that answers a request, and the one a shadow copy goes to."""
        return self._versions(name).route(version, key)

    def _observe(self, name: str, served: Served, ok: bool, latency_ns: int, outputs: Any) -> None:
        versions = self._served.get(name)
        if versions is not None:
            versions.observe(served, ok, latency_ns, outputs)

    # -- repository ---------------------------------------------------------------------------
    def load(self, name: str, version: int | None = None) -> str:
        """Load ``name``: serve the versions its version policy selects (``version`` too, or
        instead when the policy serves one: a hot swap), each behind its own batcher; versions
        no longer selected are retired (``ModelVersions``). The newest live version. ``name`` is
        one path segment inside the repository (``BadRequest`` otherwise)."""
        check_model_name(name)
        with self._loading:
            selected = self.repository.serving_versions(name, self.repository.config(name))
            current = self._served.get(name)
            versions = current or ModelVersions(name, lambda v: self._make(name, v))
            latest = versions.reconcile(wanted_versions(selected, version))
            if current is None:
                with self._lock:
                    self._served[name] = versions
            return latest

    def unload(self, name: str) -> None:
        check_model_name(name)
        with self._loading:
            with self._lock:
                served = self._served.pop(name, None)
            if served is None:
                raise NotFound(f"Request for unknown model: {name!r} is not loaded")
            served.close()

    def index(self) -> list[dict[str, str]]:
        out = []
        for name in self.repository.models():
            served = self._served.get(name)
            live = set(served.by_version) if served is not None else set()
            try:
                versions = self.repository.versions(name) or [0]
            except AispError:
                versions = [0]  # a config that does not parse: listed, not loadable
            for v in versions:
                state = "READY" if str(v) in live else "UNAVAILABLE"
                out.append({"name": name, "version": str(v), "state": state})
        return out

    def _get(self, name: str, version: str | None = None) -> Served:
        return self._versions(name).get(version)

    def served(self, name: str, version: str | None = None) -> ServedModel:
        """The serving model ``name`` (at ``version``, if given); ``NotFound`` otherwise."""
        return self._get(name, version).model

    def signature(self, name: str, version: str | None = None) -> Signature:
        """What requests to model ``name`` are checked against; ``NotFound`` if not loaded."""
        return self._get(name, version).signature

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """OIP v2 model metadata: name, serving versions, platform, inputs/outputs with the batch
        dimension as -1 and OIP datatypes."""
        served = self._get(name, version)
        cfg, sig = served.model.config, served.signature

        def tensors(ts: Sequence[TensorSignature]) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]} for t in ts]

        versions = self._served[name].versions
        return {
            "name": cfg.name,
            "versions": versions,
            "platform": cfg.platform,
            "inputs": tensors(sig.inputs),
            "outputs": tensors(sig.outputs),
        }

    def ready(self, name: str, version: str | None = None) -> bool:
        try:
            self._get(name, version)
        except (NotFound, BadRequest):
            return False
        return True

    @property
    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._served)

    def is_loaded(self, name: str) -> bool:
        return name in self._served

    def statistics(self, name: str | None = None, version: str | None = None) -> list[dict[str, Any]]:
        """Triton statistics (``$model_stat`` objects) of the loaded models, or of one model
        (and version); a model not loaded raises ``NotFound``."""
        with self._lock:
            served = dict(self._served)
        if name is not None:
            if name not in served:
                raise NotFound(f"Request for unknown model: {name!r} is not found")
            served = {name: served[name]}
        out = []
        for _, versions in sorted(served.items()):
            for s in [versions.get(version)] if version else list(versions.by_version.values()):
                out += [s.stats_of(v).to_dict() for v in sorted(set(s.stats) | {s.model.version}, key=int)]
        return out

    def tier_of(self, name: str, priority: int) -> int:
        """The tier a request with OIP/Triton ``priority`` gets on model ``name``."""
        return self.served(name).config.tier(priority)

    def queue_rows(self) -> dict[str, int]:
        with self._lock:
            served = dict(self._served)
        return {name: sum(s.batcher.queued_rows for s in v.by_version.values()) for name, v in served.items()}
