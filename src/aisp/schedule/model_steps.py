"""The model steps' side of the local executor: building an ``infer`` step's batcher and an
``llm`` step's stage, and handing on the rows they emit from threads of their own."""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING

from aisp.batch import Batch
from aisp.errors import SinkError
from aisp.graph import Node
from aisp.infer.batcher import DynamicBatcher
from aisp.infer.llm_stage import LlmStage
from aisp.infer.stage import InferSpec, build_batcher
from aisp.observe.stats import StageStats
from aisp.schedule.ops import model_batches

if TYPE_CHECKING:
    from aisp.schedule.executor import LocalExecutor

__all__ = ["make_batcher", "make_llm"]


def make_batcher(ex: LocalExecutor, node: Node, st: StageStats) -> DynamicBatcher:
    """An ``infer`` step's (not yet started) batcher, its rows handed on by ``emit_model``."""
    spec: InferSpec = node.spec
    sid = node.step_id

    call = threading.local()  # the dispatcher's last call, for its trace span

    def emit(batch: Batch) -> None:
        if ex.tracer is not None and ex.tracer.active:
            ex.tracer.model_out(sid, batch, getattr(call, "wait_ns", 0), getattr(call, "compute_ns", 0))
        emit_model(ex, sid, st, batch)

    batcher = build_batcher(
        spec,
        emit=emit,
        dead_letter=lambda b, reason: ex._dead_letter_rows(b, sid, reason),
        on_batch=model_batches(st, call),
    )
    ch = ex._channels.get(sid)
    st.queue_rows = lambda: batcher.queued_rows + (ch.rows if ch else 0)
    ex.batchers[sid] = batcher
    return batcher


def make_llm(ex: LocalExecutor, node: Node, st: StageStats) -> LlmStage:
    """An ``llm`` step's stage (its loop starts with the first rows)."""
    sid = node.step_id

    def emit(batch: Batch) -> None:  # a row with its answer (its tokens went on before it)
        if ex.tracer is not None and ex.tracer.active:
            ex.tracer.model_out(sid, batch, 0, 0)
        emit_model(ex, sid, st, batch)

    stage = LlmStage(
        node.spec,
        emit=emit,
        emit_made=partial(emit_model, ex, sid, st, made=True),
        dead_letter=lambda b, reason: ex._dead_letter_rows(b, sid, reason),
    )
    st.queue_rows = lambda: stage.queued_rows
    ex.llm_stages[sid] = stage
    return stage


def emit_model(ex: LocalExecutor, sid: str, st: StageStats, batch: Batch, *, made: bool = False) -> None:
    """Rows a model step hands on from a thread of its own (``made``: new rows, not ones
    that replace rows it took: an LLM's tokens)."""
    if made:
        ex.flight.landed(batch.num_rows)
    st.rows_out += batch.num_rows
    try:
        ex._emit(sid, "out", batch)
    except SinkError as exc:  # from a sink chained after the model: the pipeline stops
        ex._errors.append(exc)
        ex._stop.set()
