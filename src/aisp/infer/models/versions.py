"""A repository model whose serving version can change while the pipeline runs (hot swap).

``ServedModel`` is a runtime: the batcher asks it to ``resolve()`` once per batch and runs that
version, so a batch is computed by exactly one version and reports it. Every version is checked
against the model's ``config.pbtxt`` when its session is built (``ModelConfig.check``: a version
that contradicts it is never served). ``load(version)`` builds the new version's session, checks
that its inputs and outputs match the serving version's, and warms it up (one zero
batch at ``max_batch_size`` and at each preferred size) *before* switching; the switch is one
reference assignment, so it happens between batches. Batches already running finish on the old
version, whose session is released when the last of them drops its reference. A load that fails
leaves the old version serving and records why in ``last_error``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt

from aisp.errors import ModelError, ModelNotFound
from aisp.infer.models.repository import ModelConfig, ModelRepository
from aisp.infer.runtimes.base import OnnxRuntime, TensorSpec

__all__ = ["ServedModel", "VersionWatcher"]

log = logging.getLogger("aisp.models")


class ServedModel:
    """The serving version of model ``name`` in ``repository``.

    Args:
        repository: the model repository.
        name: the model's directory name.
        version: the version to serve first; the newest one its version policy allows by default.
        pin: serve ``version`` only: ``refresh`` never moves it to a newer one (a pipeline step or
            server slot addressed to one version).
        providers: ONNX Runtime execution providers (see ``OnnxRuntime``).
        intra_op_threads: ONNX Runtime threads per operator.
    """

    def __init__(
        self,
        repository: ModelRepository | str,
        name: str,
        *,
        version: int | None = None,
        pin: bool = False,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 1,
    ) -> None:
        if pin and version is None:
            raise ModelError(f"model {name!r}: a pinned model needs the version to serve")
        if not isinstance(repository, ModelRepository):
            repository = ModelRepository(repository)
        self.repository = repository
        self.name = name
        self.config: ModelConfig = repository.config(name)  # warns about unsupported fields
        self._providers = providers
        self._threads = intra_op_threads
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self.swaps = 0
        self.pinned = pin
        self._failed: dict[int, float] = {}  # version -> model file mtime when its load failed
        first = version if version is not None else self._newest()
        self._current = self._build(first)  # warmed up by the batcher that serves it
        self.live_since = time.monotonic()
        """When the version in use began serving (``time.monotonic``): ``aisp diagnose`` reads a
        version's first calls as its cold start."""

    # -- the Runtime protocol (delegated to the serving version) -------------------------------
    def resolve(self) -> OnnxRuntime:
        return self._current

    @property
    def version(self) -> str:
        return self._current.version

    @property
    def weights_sha256(self) -> str:
        return self._current.weights_sha256

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._current.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._current.output_names

    @property
    def input_specs(self) -> Mapping[str, TensorSpec]:
        return self._current.input_specs

    @property
    def output_specs(self) -> Mapping[str, TensorSpec]:
        return self._current.output_specs

    @property
    def provider(self) -> str:
        return self._current.provider

    @property
    def precision(self) -> str:
        return self._current.precision

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        return self._current.run(inputs)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        self._current.warmup(batch_sizes)

    # -- versions -----------------------------------------------------------------------------
    def available(self) -> list[int]:
        """Versions the version policy lets serve, from what is on disk now."""
        return self.repository.serving_versions(self.name, self.config)

    def load(self, version: int | None = None) -> str:
        """Build, check and warm up ``version`` (default: the newest allowed), then switch to it.

        Raises ``ModelError`` (and keeps the old version serving) if it cannot be loaded.
        """
        with self._lock:
            target = version if version is not None else self._newest()
            if str(target) == self._current.version:
                return self._current.version
            try:
                new = self._build(target)
                self._check_compatible(new)
                new.warmup(self._warm_sizes())
            except ModelError as exc:
                self.last_error = str(exc)
                raise
            old, self._current = self._current, new
            self.live_since = time.monotonic()
            self.swaps += 1
            self.last_error = None
        log.info("model %s: version %s -> %s", self.name, old.version, new.version)
        return new.version

    def refresh(self) -> bool:
        """Serve the newest allowed version if it changed on disk; False if nothing changed or it
        failed, or the model is pinned to its version."""
        if self.pinned:
            return False
        try:
            newest = self._newest()
        except ModelError as exc:
            self.last_error = str(exc)
            return False
        if str(newest) == self._current.version:
            return False
        mtime = self._mtime(newest)
        if self._failed.get(newest) == mtime:
            return False  # same file as the failed attempt: wait until it changes
        try:
            self.load(newest)
        except ModelError as exc:
            self._failed[newest] = mtime
            log.warning(
                "model %s: version %s not loaded, %s keeps serving: %s", self.name, newest, self.version, exc
            )
            return False
        return True

    def _mtime(self, version: int) -> float:
        try:
            return self.repository.model_path(self.name, version, self.config).stat().st_mtime
        except OSError:
            return -1.0

    def _newest(self) -> int:
        versions = self.available()
        if not versions:
            raise ModelNotFound(
                f"model {self.name!r} has no version to serve in {str(self.repository.root)!r}"
            )
        return versions[-1]

    def _build(self, version: int) -> OnnxRuntime:
        path = self.repository.model_path(self.name, version, self.config)
        if not path.is_file():
            raise ModelNotFound(f"model {self.name!r} has no version {version} ({str(path)!r} is missing)")
        providers = self._providers
        if providers is None and self.config.device == "cpu":
            providers = ["CPUExecutionProvider"]
        runtime = OnnxRuntime(
            path, name=self.name, version=str(version), providers=providers, intra_op_threads=self._threads
        )
        self.config.check(runtime.version, runtime.input_specs, runtime.output_specs, runtime.run)
        runtime.input_specs = self.config.narrowed(runtime.input_specs)
        return runtime

    def _check_compatible(self, new: OnnxRuntime) -> None:
        old = self._current
        if set(new.input_names) != set(old.input_names) or not set(old.output_names) <= set(new.output_names):
            raise ModelError(
                f"model {self.name!r} version {new.version} has inputs {list(new.input_names)} and outputs "
                f"{list(new.output_names)}; version {old.version} has {list(old.input_names)} and "
                f"{list(old.output_names)}"
            )

    def _warm_sizes(self) -> list[int]:
        cfg = self.config.batcher
        return sorted({cfg.max_batch_size, *cfg.preferred_batch_sizes})

    def __repr__(self) -> str:
        return (
            f"ServedModel({self.name!r}, version={self.version!r}, repository={str(self.repository.root)!r})"
        )


class VersionWatcher:
    """Polls the versioned models among ``runtimes`` (``ServedModel.refresh``) every
    ``interval_s`` (0: never), so a new version in the repository is served; ``poll`` is
    called often, by the thread that drives a run."""

    def __init__(self, runtimes: Sequence[Any], interval_s: float) -> None:
        self._models = [rt for rt in runtimes if isinstance(rt, ServedModel)]
        self._interval_ns = int(interval_s * 1e9)
        self._next = time.monotonic_ns() + self._interval_ns

    def poll(self) -> None:
        if not self._models or self._interval_ns <= 0 or time.monotonic_ns() < self._next:
            return
        self._next = time.monotonic_ns() + self._interval_ns
        for model in self._models:
            model.refresh()
