"""The model steps' side of the local executor: building an ``infer`` step's batcher and an
``llm`` step's stage, handing on the rows they emit from threads of their own, and what a
checkpoint records of the models.

A checkpoint records, per ``infer`` step, the model's version and the SHA-256 of its weights
(``model_record``; the runtime hashed its file once, at load). A restart checks them against
the models it loaded (``verify_models``): state built with one model is not resumed with
another unless the run asks for it (``allow_change``, ``aisp run --allow-model-change``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from aisp.batch import Batch
from aisp.errors import AispError, SinkError
from aisp.graph import Graph
from aisp.infer.batching.batcher import DynamicBatcher
from aisp.infer.llm.stage import LlmStage
from aisp.infer.models.versions import ServedModel
from aisp.infer.stage import InferSpec, build_batcher
from aisp.observe.stats import StageStats
from aisp.schedule.ops import model_batches

if TYPE_CHECKING:
    from aisp.state.checkpoint import Checkpoint

__all__ = ["ModelChanged", "StepPort", "make_batcher", "make_llm", "model_record", "verify_models"]

log = logging.getLogger("aisp.checkpoint")

Model = dict[str, str]
"""What a checkpoint records of a model step: ``{"version": V, "weights_sha256": H}`` (H is
empty for a model without a file here: a Python function, a remote server's model)."""


class ModelChanged(AispError):
    """A restart found a model step whose version or weights differ from its checkpoint's: the
    state would resume with another model. Restore the model, start with an empty checkpoint
    directory, or restore across the change on purpose (``aisp run --allow-model-change``)."""


@dataclass(frozen=True)
class StepPort:
    """What a model step may do to the executor that runs it, and nothing more: the step hands
    rows on from a thread of its own, so it never reads the executor's members."""

    emit: Callable[[Batch], None]
    """Hand rows on downstream (a sink chained after the model may raise ``SinkError``)."""
    dead_letter: Callable[[Batch, str], None]
    """Rows that leave the pipeline here, with the reason."""
    fail: Callable[[BaseException], None]
    """Stop the run with this error."""
    landed: Callable[[int], None]
    """Rows that came into being here (the flight's count of rows in the pipeline)."""
    traced: Callable[[Batch, int, int], None]
    """A model call's rows out for the run's tracer, if it traces (wait and compute ns)."""
    queued_rows: Callable[[], int]
    """Rows waiting in the step's input channel."""


def make_batcher(port: StepPort, spec: InferSpec, st: StageStats) -> DynamicBatcher:
    """An ``infer`` step's (not yet started) batcher, its rows handed on by ``emit_model``."""
    call = threading.local()  # the dispatcher's last call, for its trace span

    def emit(batch: Batch) -> None:
        port.traced(batch, getattr(call, "wait_ns", 0), getattr(call, "compute_ns", 0))
        emit_model(port, st, batch)

    batcher = build_batcher(spec, emit=emit, dead_letter=port.dead_letter, on_batch=model_batches(st, call))
    st.queue_rows = lambda: batcher.queued_rows + port.queued_rows()
    return batcher


def make_llm(port: StepPort, spec: Any, st: StageStats) -> LlmStage:
    """An ``llm`` step's stage (its loop starts with the first rows)."""

    def emit(batch: Batch) -> None:  # a row with its answer (its tokens went on before it)
        port.traced(batch, 0, 0)
        emit_model(port, st, batch)

    stage = LlmStage(
        spec, emit=emit, emit_made=partial(emit_model, port, st, made=True), dead_letter=port.dead_letter
    )
    st.queue_rows = lambda: stage.queued_rows
    return stage


def emit_model(port: StepPort, st: StageStats, batch: Batch, *, made: bool = False) -> None:
    """Rows a model step hands on from a thread of its own (``made``: new rows, not ones
    that replace rows it took: an LLM's tokens)."""
    if made:
        port.landed(batch.num_rows)
    st.rows_out += batch.num_rows
    try:
        port.emit(batch)
    except SinkError as exc:  # from a sink chained after the model: the pipeline stops
        port.fail(exc)


def model_of(runtime: Any) -> Model:
    """What a checkpoint records of ``runtime`` (attributes only: cheap under the pause)."""
    return {
        "version": str(getattr(runtime, "version", "")),
        "weights_sha256": str(getattr(runtime, "weights_sha256", "") or ""),
    }


def model_record(runtimes: Mapping[str, Any]) -> dict[str, Model]:
    """The ``models`` of a checkpoint: each model step's version and weights (``model_of``)."""
    return {sid: model_of(rt) for sid, rt in runtimes.items()}


def _recorded(value: Any) -> Model:
    """A checkpoint's entry for a step: older checkpoints hold the version alone (a string)."""
    if isinstance(value, Mapping):
        return {
            "version": str(value.get("version", "")),
            "weights_sha256": str(value.get("weights_sha256", "")),
        }
    return {"version": str(value), "weights_sha256": ""}


def _differ(then: Model, now: Model) -> bool:
    """A version that differs, or weights: hashed then and now and not equal, or hashed then and
    not verifiable now (a model without a file took the step)."""
    if then["version"] != now["version"]:
        return True
    return bool(then["weights_sha256"]) and then["weights_sha256"] != now["weights_sha256"]


def _describe(model: Model) -> str:
    return f"version {model['version'] or '?'}, weights sha256 {model['weights_sha256'] or 'not recorded'}"


def _serve_recorded(runtime: Any, then: Model) -> None:
    """A repository model that follows new versions serves the checkpoint's version again when
    the repository still has it (a newer one then follows as a hot swap, as in a run that never
    stopped)."""
    if not isinstance(runtime, ServedModel) or runtime.pinned or runtime.version == then["version"]:
        return
    version = then["version"]
    if version.isdigit() and int(version) in runtime.available():
        runtime.load(int(version))
        log.info(
            "model %s: serving version %s again, as when the checkpoint was taken", runtime.name, version
        )


def verify_models(graph: Graph, checkpoint: Checkpoint | None, *, allow_change: bool) -> dict[str, Any]:
    """Check each model step that ``graph`` and ``checkpoint`` share: the same version, and the
    same weights where the checkpoint has their hash; the changes found, by step
    (``{"checkpoint": Model, "now": Model}``), when ``allow_change`` (each logged as a warning),
    else ``ModelChanged`` naming the first. A checkpoint that records no hash for a step (taken
    before weights were hashed, or of a model without a file) has its version checked only."""
    if checkpoint is None:
        return {}
    recorded = checkpoint.meta.get("models")
    if recorded is None:
        log.warning("checkpoint %s records no models: the model steps are not checked", checkpoint.path)
        return {}
    runtimes = {n.step_id: n.spec.runtime for n in graph.nodes if n.kind == "infer"}
    changes: dict[str, Any] = {}
    unhashed = []
    for sid in sorted(set(recorded) & set(runtimes)):
        then = _recorded(recorded[sid])
        _serve_recorded(runtimes[sid], then)
        now = model_of(runtimes[sid])
        if not then["weights_sha256"]:
            unhashed.append(sid)
        if not _differ(then, now):
            continue
        if not allow_change:
            raise ModelChanged(
                f"model step {sid!r} was checkpointed ({checkpoint.path}) with {_describe(then)};"
                f" this run loaded {_describe(now)}. Restore that model, or restore across the"
                " change with --allow-model-change (RunOptions.checkpoints.allow_model_change)"
            )
        changes[sid] = {"checkpoint": then, "now": now}
        log.warning(
            "restoring %s across a model change: step %r was %s, is now %s",
            checkpoint.path, sid, _describe(then), _describe(now),
        )  # fmt: skip
    if unhashed:
        log.info(
            "checkpoint %s records no weights hash for %s: only the version is checked",
            checkpoint.path,
            unhashed,
        )
    return changes
