"""A Triton-style model repository: ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<n>/model.onnx``.

``config.pbtxt`` is read with protobuf's text format into Triton's own ``ModelConfig`` message
(the generated classes that ship in ``tritonclient``), so a file copied from a Triton repository
means the same here. Honoured: ``name``, ``platform``/``backend`` (ONNX Runtime), ``max_batch_size``,
``input``/``output`` (``name``, ``data_type``, ``dims``), ``dynamic_batching``
(``max_queue_delay_microseconds``, ``preferred_batch_size``, ``priority_levels``,
``default_priority_level``, ``default_queue_policy`` and ``priority_queue_policy`` with
``timeout_action``, ``default_timeout_microseconds``, ``max_queue_size``), ``version_policy``
(latest N, all, specific), ``instance_group`` (``count``, ``kind``) and ``default_model_filename``.
Any other field set in the file is reported with an ``UnsupportedConfigWarning`` naming it;
a malformed file is a ``ConfigError`` naming the file and line.

Each version is checked against the file when it loads, as Triton does (``ModelConfig.check``):
every input and output the file lists must exist in the model with the same datatype and shape
(``max_batch_size`` > 0 puts a batch dimension first, which the model must leave dynamic; a
dynamic model dimension matches any configured size, a fixed one must equal it), the model may
have no input the file leaves out, and outputs the model leaves dynamic where the file fixes a
size are run once on a zero row to see the size they really have. A version that contradicts its
file is refused with a ``ModelContradictsConfig`` naming each tensor and both shapes or datatypes.

Triton priorities run from 1 (highest) to ``priority_levels``; AISP tiers run the other way
(higher is served first), so priority ``p`` is tier ``priority_levels - p``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aisp.errors import BadRequest, ConfigError, ModelError, ModelNotFound
from aisp.infer.batching.config import BatcherConfig

if TYPE_CHECKING:
    import numpy.typing as npt
    from google.protobuf.message import Message

    from aisp.infer.runtimes.base import TensorSpec

__all__ = [
    "ModelConfig",
    "ModelContradictsConfig",
    "ModelRepository",
    "TensorConfig",
    "UnsupportedConfigWarning",
    "VersionPolicy",
    "check_model_name",
    "priority_to_tier",
]

ONNX_PLATFORMS = {"onnxruntime_onnx", "onnxruntime"}
DTYPES: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# Fields understood, as paths in the message; anything else set in a file is warned about.
SUPPORTED = {
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "default_model_filename",
    "input.name",
    "input.data_type",
    "input.dims",
    "output.name",
    "output.data_type",
    "output.dims",
    "version_policy.latest.num_versions",
    "version_policy.all",
    "version_policy.specific.versions",
    "instance_group.name",
    "instance_group.count",
    "instance_group.kind",
    "dynamic_batching.preferred_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.priority_levels",
    "dynamic_batching.default_priority_level",
    "dynamic_batching.preserve_ordering",
    *(
        f"dynamic_batching.{policy}.{leaf}"
        for policy in ("default_queue_policy", "priority_queue_policy.value")
        for leaf in (
            "timeout_action",
            "default_timeout_microseconds",
            "allow_timeout_override",
            "max_queue_size",
        )
    ),
    "dynamic_batching.priority_queue_policy.key",
}


class UnsupportedConfigWarning(UserWarning):
    """A ``config.pbtxt`` field AISP does not implement; it is ignored."""


def check_model_name(name: str) -> str:
    """``name`` if it can name a model: one path segment, never a way out of the repository.

    >>> check_model_name("fraud")
    'fraud'
    >>> check_model_name("../etc")
    Traceback (most recent call last):
    ...
    aisp.errors.BadRequest: invalid model name '../etc', model name must not contain path traversal characters
    """
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("Model name cannot be empty. Please enter a valid name to deploy.")
    if name.strip() in (".", "..") or any(c in name for c in "/\\\x00"):
        raise BadRequest(
            f"invalid model name {name!r}, model name must not contain path traversal characters"
        )
    return name


def priority_to_tier(priority: int, levels: int) -> int:
    """Triton priority level (1 = highest) to an AISP tier (0 = lowest).

    >>> [priority_to_tier(p, 3) for p in (1, 2, 3)]
    [2, 1, 0]
    """
    if not 1 <= priority <= levels:
        raise ConfigError(f"priority must be between 1 and priority_levels ({levels}), got {priority}")
    return levels - priority


@dataclass(frozen=True)
class TensorConfig:
    name: str
    dtype: Any
    dims: tuple[int, ...]


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions serve: the ``latest`` N (default 1), ``all``, or ``specific`` ones."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions :] if self.num_versions > 0 else []


@dataclass(frozen=True)
class ModelConfig:
    """What AISP takes from one ``config.pbtxt``."""

    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    batcher: BatcherConfig
    version_policy: VersionPolicy
    instances: int = 1
    device: str = "cpu"
    priority_levels: int = 0
    default_model_filename: str = "model.onnx"
    source: str = ""
    ignored: tuple[str, ...] = field(default=(), compare=False)
    message: Any = field(default=None, compare=False, repr=False)
    """The parsed ``tritonclient`` ``ModelConfig`` message (what a ModelConfig RPC returns)."""

    @classmethod
    def parse(cls, text: str, *, source: str = "<config>", model_dir: str | None = None) -> ModelConfig:
        """Parse ``config.pbtxt`` text; ``ConfigError`` names ``source`` and the line on bad input."""
        from google.protobuf import text_format

        pb = _pb()
        msg = pb.ModelConfig()
        try:
            text_format.Parse(text, msg)
        except text_format.ParseError as exc:
            line = exc.GetLine() if hasattr(exc, "GetLine") else None
            detail = re.sub(r"^\d+:\d+ : ", "", str(exc))
            raise ConfigError(f"{source}:{line or '?'}: malformed config.pbtxt: {detail}") from exc
        ignored = tuple(sorted(set(_set_paths(msg)) - SUPPORTED))
        for path in ignored:
            warnings.warn(
                f"{source}: field {path!r} is not supported by AISP and is ignored",
                UnsupportedConfigWarning,
                stacklevel=3,
            )
        return cls._from_message(msg, source=source, model_dir=model_dir, ignored=ignored)

    @classmethod
    def _from_message(
        cls, msg: Any, *, source: str, model_dir: str | None, ignored: tuple[str, ...]
    ) -> ModelConfig:
        name = msg.name or (Path(model_dir).name if model_dir else "")
        if not name:
            raise ConfigError(f"{source}: the model has no name")
        if model_dir and msg.name and msg.name != Path(model_dir).name:
            raise ConfigError(
                f"{source}: name {msg.name!r} differs from its directory {Path(model_dir).name!r}"
            )
        platform = msg.platform or msg.backend or "onnxruntime_onnx"
        if platform not in ONNX_PLATFORMS:
            raise ConfigError(f"{source}: platform/backend {platform!r} is not supported (only onnxruntime)")
        if msg.max_batch_size < 1:
            raise ConfigError(
                f"{source}: max_batch_size must be >= 1 (models without batching are not supported)"
            )
        db = msg.dynamic_batching
        levels = db.priority_levels
        default_tier = (
            priority_to_tier(db.default_priority_level, levels) if levels and db.default_priority_level else 0
        )
        qp = db.default_queue_policy
        timeout_ms = qp.default_timeout_microseconds / 1000 if qp.default_timeout_microseconds else None
        tier_timeouts = {
            priority_to_tier(int(p), levels): pol.default_timeout_microseconds / 1000
            for p, pol in db.priority_queue_policy.items()
            if pol.default_timeout_microseconds
        }
        preferred = tuple(int(s) for s in db.preferred_batch_size)
        batcher = BatcherConfig(
            max_batch_size=msg.max_batch_size,
            preferred_batch_sizes=preferred,
            max_queue_delay_ms=db.max_queue_delay_microseconds / 1000,
            eager=not msg.HasField("dynamic_batching") or not (preferred or db.max_queue_delay_microseconds),
            timeout_ms=timeout_ms,
            tier_timeout_ms=tier_timeouts,
            default_tier=default_tier,
            capacity_rows=max(qp.max_queue_size, msg.max_batch_size) if qp.max_queue_size else 8192,
            overload="shed" if qp.max_queue_size else "block",
            instances=sum(g.count or 1 for g in msg.instance_group) or 1,
        )
        kinds = {_pb().ModelInstanceGroup.Kind.Name(g.kind) for g in msg.instance_group}
        return cls(
            name=name,
            platform=platform,
            max_batch_size=msg.max_batch_size,
            inputs=tuple(_tensor(t) for t in msg.input),
            outputs=tuple(_tensor(t) for t in msg.output),
            batcher=batcher,
            version_policy=_policy(msg.version_policy),
            instances=batcher.instances,
            device="gpu" if "KIND_GPU" in kinds else "cpu",
            priority_levels=levels,
            default_model_filename=msg.default_model_filename or "model.onnx",
            source=source,
            ignored=ignored,
            message=msg,
        )

    def check(
        self,
        version: str,
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        run: Callable[[dict[str, npt.NDArray[Any]]], Mapping[str, npt.NDArray[Any]]] | None = None,
    ) -> None:
        """Raise ``ModelContradictsConfig`` unless version ``version`` of the model, whose
        inputs and outputs are ``inputs`` and ``outputs`` (batch dimension first), is what this
        file says (see the module docstring); ``run`` calls it on one zero row when an output's
        size is dynamic in the model but fixed here."""
        listed = [t.name for t in self.inputs]
        problems = [
            f"the model's input {n!r} is not in config.pbtxt (it lists {listed})"
            for n in inputs
            if listed and n not in listed
        ]
        for kind, tensors, specs in (("input", self.inputs, inputs), ("output", self.outputs, outputs)):
            problems += [p for t in tensors if (p := self._problem(kind, t, specs.get(t.name), list(specs)))]
        if not problems and run is not None:
            problems += self._probe(inputs, outputs, run)
        if problems:
            raise ModelContradictsConfig(
                f"model {self.name!r} version {version} contradicts {self.source}: {'; '.join(problems)}",
                problems=tuple(problems),
            )

    def _problem(self, kind: str, t: TensorConfig, spec: TensorSpec | None, names: list[str]) -> str:
        """What ``spec`` (the model's tensor ``t.name``) contradicts of ``t``; "" if nothing."""
        if spec is None:
            return f"config.pbtxt lists {kind} {t.name!r}, the model has no such {kind} (it has {names})"
        said = [f"{kind} {t.name!r}"]
        if spec.dtype is not None and spec.dtype != np.dtype(t.dtype):
            said.append(f"is {_type_name(spec.dtype)} in the model, {_type_name(t.dtype)} in config.pbtxt")
        model, full = _dims(spec.shape), [-1, *t.dims]
        batch = f"max_batch_size {self.max_batch_size} > 0: the batch dimension, then dims {list(t.dims)}"
        if spec.shape is None:
            pass
        elif not model or model[0] != -1:
            said.append(
                f"has shape {model} in the model, config.pbtxt gives {full} ({batch}): the model must"
                " leave its first dimension, the batch, dynamic"
            )
        elif len(model) != len(full) or any(m not in (-1, c) for m, c in zip(model, full, strict=True)):
            said.append(f"has shape {model} in the model, config.pbtxt gives {full} ({batch})")
        return f"{said[0]} {' and '.join(said[1:])}" if len(said) > 1 else ""

    def _probe(
        self,
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        run: Callable[[dict[str, npt.NDArray[Any]]], Mapping[str, npt.NDArray[Any]]],
    ) -> list[str]:
        """The outputs whose sizes the model leaves dynamic and this file fixes, checked on its
        answer to one zero row (no call when none is, or an input's type is unknown)."""
        unsure = [
            t for t in self.outputs
            if any(m == -1 != c for m, c in zip(_dims(outputs[t.name].shape)[1:], t.dims, strict=False))
        ]  # fmt: skip
        if not unsure:
            return []
        configured = {t.name: t for t in self.inputs}
        row: dict[str, npt.NDArray[Any]] = {}
        for name, spec in inputs.items():
            t = configured.get(name)
            dims = t.dims if t is not None else _dims(spec.shape)[1:]
            dtype = spec.dtype if spec.dtype is not None or t is None else np.dtype(t.dtype)
            if dtype is None:
                return []
            row[name] = np.full((1, *(max(d, 1) for d in dims)), "" if dtype.kind == "O" else 0, dtype)
        got = {t.name: list(run(row)[t.name].shape) for t in unsure}
        return [
            f"output {t.name!r} answers one row with shape {got[t.name]} (the model declares"
            f" {_dims(outputs[t.name].shape)}), config.pbtxt gives {[-1, *t.dims]}"
            for t in unsure
            if len(got[t.name]) != len(t.dims) + 1
            or any(c not in (-1, g) for g, c in zip(got[t.name][1:], t.dims, strict=True))
        ]

    def narrowed(self, inputs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """A checked model's ``inputs`` with the sizes this file fixes where the model leaves
        them dynamic (so warm-up batches have the sizes requests will have)."""
        dims = {t.name: t.dims for t in self.inputs}
        out = dict(inputs)
        for name, spec in inputs.items():
            if name in dims and spec.shape is not None:
                fixed = (m if c == -1 else c for m, c in zip(spec.shape[1:], dims[name], strict=True))
                out[name] = dataclasses.replace(spec, shape=(spec.shape[0], *fixed))
        return out

    def tier(self, priority: int) -> int:
        """The tier of a request with Triton ``priority``: 0, or a level the model does not
        have, means the model's default (as Triton does)."""
        if not self.priority_levels or not 1 <= priority <= self.priority_levels:
            return self.batcher.default_tier
        return priority_to_tier(priority, self.priority_levels)


class ModelContradictsConfig(ModelError):
    """A model version whose inputs or outputs contradict its ``config.pbtxt`` (Triton refuses
    it at load too); ``problems`` names each tensor and both shapes or datatypes. The version is
    not served: fix the file or the model."""

    def __init__(self, message: str, *, problems: tuple[str, ...]) -> None:
        super().__init__(message)
        self.problems = problems


def _dims(shape: tuple[int | None, ...] | None) -> list[int]:
    """A model's shape as ``config.pbtxt`` writes one: -1 for a dynamic dimension."""
    return [-1 if d is None else d for d in shape or ()]


def _type_name(dtype: Any) -> str:
    """A numpy dtype as ``config.pbtxt`` names it (``TYPE_FP32``)."""
    return next((name for name, t in DTYPES.items() if np.dtype(t) == dtype), str(dtype))


def _pb() -> Any:
    """Triton's model configuration protobuf module, imported when a configuration is read
    (``tritonclient.grpc`` brings gRPC with it: a run without a repository does not pay for it)."""
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _tensor(t: Any) -> TensorConfig:
    dtype_name = _pb().DataType.Name(t.data_type)
    if dtype_name not in DTYPES:
        raise ConfigError(f"tensor {t.name!r}: data_type {dtype_name} is not supported")
    return TensorConfig(t.name, DTYPES[dtype_name], tuple(int(d) for d in t.dims))


def _policy(vp: Any) -> VersionPolicy:
    which = vp.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        return VersionPolicy("specific", versions=tuple(int(v) for v in vp.specific.versions))
    if which == "latest":
        return VersionPolicy("latest", num_versions=int(vp.latest.num_versions))
    return VersionPolicy()


def _set_paths(msg: Message, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every field set in ``msg`` (map entries as ``.key``/``.value``)."""
    from google.protobuf.message import Message

    for fd, value in msg.ListFields():
        path = f"{prefix}{fd.name}"
        if fd.message_type is None:
            yield path
            continue
        if fd.message_type.GetOptions().map_entry:
            for v in value.values():
                yield f"{path}.key"
                if isinstance(v, Message):
                    yield from _set_paths(v, f"{path}.value.") if v.ListFields() else iter([f"{path}.value"])
            continue
        items = value if fd.is_repeated else [value]
        for item in items:
            sub = list(_set_paths(item, f"{path}."))
            yield from sub or [path]


class ModelRepository:
    """A directory of models in Triton's layout.

    >>> import tempfile; from pathlib import Path
    >>> root = Path(tempfile.mkdtemp())
    >>> _ = (root / "m" / "3").mkdir(parents=True); _ = (root / "m" / "3" / "model.onnx").write_bytes(b"")
    >>> _ = (root / "m" / "config.pbtxt").write_text('max_batch_size: 8')
    >>> repo = ModelRepository(root); repo.models(), repo.versions("m")
    (['m'], [3])
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"model repository {str(self.root)!r} is not a directory")

    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / "config.pbtxt").is_file())

    def model_dir(self, name: str) -> Path:
        """The directory of model ``name``: ``BadRequest`` unless it is one segment inside the root."""
        path = self.root / check_model_name(name)
        if Path(os.path.normpath(path)).parent != Path(os.path.normpath(self.root)):
            raise BadRequest(f"invalid model name {name!r}: it resolves outside the model repository")
        return path  # symbolic links an operator put in the repository are followed

    def config(self, name: str) -> ModelConfig:
        path = self.model_dir(name) / "config.pbtxt"
        if not path.is_file():
            raise ModelNotFound(f"no model {name!r} in repository {str(self.root)!r} (no {path.name})")
        return ModelConfig.parse(path.read_text(), source=str(path), model_dir=str(path.parent))

    def versions(self, name: str, config: ModelConfig | None = None) -> list[int]:
        """Versions present on disk (numeric directories holding the model file)."""
        filename = (config or self._quiet_config(name)).default_model_filename
        model_dir = self.model_dir(name)
        return sorted(
            int(p.name) for p in model_dir.iterdir() if p.name.isdigit() and (p / filename).is_file()
        )

    def serving_versions(self, name: str, config: ModelConfig | None = None) -> list[int]:
        cfg = config or self._quiet_config(name)
        return cfg.version_policy.select(self.versions(name, cfg))

    def model_path(self, name: str, version: int, config: ModelConfig | None = None) -> Path:
        cfg = config or self._quiet_config(name)
        return self.model_dir(name) / str(version) / cfg.default_model_filename

    def _quiet_config(self, name: str) -> ModelConfig:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsupportedConfigWarning)
            return self.config(name)
