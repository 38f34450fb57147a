"""The fluent builder users write: ``Pipeline`` and ``Stream``.

>>> from aisp.sinks import CollectSink
>>> from aisp.ingest import WorkloadFSource
>>> p = Pipeline("demo")
>>> big = p.source("events", WorkloadFSource(events=1000)).filter(
...     "big", lambda b: b.numpy("amount") > 100)
>>> out = CollectSink(columns=["id", "amount"])
>>> big.sink("out", out)
>>> summary = p.run()
>>> summary.events_out == len(out.rows) and all(r["amount"] > 100 for r in out.rows)
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pyarrow as pa

from aisp.admission.anomaly import AnomalyPolicy
from aisp.admission.tiers import DEFAULT_TIERS
from aisp.batch import Batch
from aisp.connectors import connector_for
from aisp.errors import ConfigError, GraphError
from aisp.graph import DEFAULT_PORT, Graph, Node
from aisp.infer.batching.batcher import BatcherConfig
from aisp.infer.llm.stage import LlmSpec
from aisp.infer.models.rollout import Rollout, RolloutPolicy
from aisp.infer.runtimes.base import Runtime
from aisp.infer.stage import InferSpec
from aisp.infer.steps import expand_by_tier, expand_rollout
from aisp.ingest.base import Source
from aisp.observe.drift import DriftConfig, alert_sink, local_alert
from aisp.runner import RunOptions, RunSummary, run
from aisp.sinks.base import Sink
from aisp.transform.joins import IntervalJoinSpec, tag_side
from aisp.transform.operators import (
    AssignTier,
    Filter,
    KeyBy,
    MapBatch,
    MapRows,
    Passthrough,
    Route,
)
from aisp.transform.stateful import RunningStats, StateFn, Stateful
from aisp.transform.text.vectors import VectorIndex
from aisp.transform.windows.aggregates import Aggregate
from aisp.transform.windows.event_time import EventTime
from aisp.transform.windows.spec import Session, Sliding, Tumbling, WindowSpec

__all__ = ["KeyedStream", "Pipeline", "Stream"]

RowFn = Callable[[dict[str, Any]], dict[str, Any] | None]


class Pipeline:
    """A named DAG under construction. ``build()`` validates it and returns the ``Graph``."""

    def __init__(self, name: str, *, output_columns: Sequence[str] | None = None) -> None:
        self.name = name
        self.graph = Graph(name)
        self.input_schema: type[msgspec.Struct] | None = None
        self.output_columns = list(output_columns) if output_columns is not None else None
        self.anomaly: AnomalyPolicy | None = None
        """Sliding-window anomaly control of the admitted rate when served (``anomaly_control``)."""
        self.rollouts: dict[str, Rollout] = self.graph.rollouts
        """The model rollouts of ``Stream.infer_rollout`` steps, by step id (the graph's)."""
        self.migrations: dict[str, Callable[[pa.Table], pa.Table]] = {}
        """Per step, how its state changes when this pipeline replaces a running version of
        itself (``migrate``, ``aisp.serve.pipelines.topology``)."""

    def migrate(self, step_id: str, fn: Callable[[pa.Table], pa.Table]) -> None:
        """Declare how the state of ``step_id`` saved by the running version of this pipeline
        becomes this version's (a table of the step's state columns, one row per key, in and
        out), for a topology update of a served pipeline (``aisp.serve.pipelines.topology``)."""
        self.migrations[step_id] = fn

    def source(
        self,
        step_id: str,
        source: Source,
        *,
        schema: type[msgspec.Struct] | None = None,
        event_time: EventTime | None = None,
        latency_budget_ms: float = 1.0,
    ) -> Stream:
        """Add a source. ``schema`` types its records, so ``--input FILE`` can replace it.

        ``event_time`` gives its rows event time and watermarks, which windows need
        (``aisp.transform.windows.event_time``); it stays when ``--input`` replaces the source."""
        if schema is not None:
            self.input_schema = schema
        if event_time is not None and not isinstance(event_time, EventTime):
            raise GraphError(f"source {step_id!r}: event_time must be an EventTime", step=step_id)
        self.graph.add(
            Node(
                step_id=step_id,
                kind="source",
                spec=source,
                latency_budget_ms=latency_budget_ms,
                event_time=event_time,
            )
        )
        return Stream(self, step_id)

    def union(self, step_id: str, *streams: Stream) -> Stream:
        """Merge several streams into one (rows keep their ids and ingest times)."""
        if len(streams) < 2:
            raise GraphError(
                f"union {step_id!r} needs at least two streams, got {len(streams)}", step=step_id
            )
        self.graph.add(
            Node(step_id=step_id, kind="union", spec=Passthrough(), inputs=tuple(s.ref for s in streams))
        )
        return Stream(self, step_id)

    def anomaly_control(self, policy: AnomalyPolicy) -> None:
        """When served, watch events/s, e2e latency and a score column over a sliding window and
        lower the admitted rate while the policy's condition holds (``aisp.admission.anomaly``);
        a serve config's ``[anomaly.NAME]`` or the admin endpoint can change it."""
        if not isinstance(policy, AnomalyPolicy):
            raise GraphError(f"anomaly_control needs an AnomalyPolicy, got {type(policy).__name__}")
        self.anomaly = policy

    def build(self) -> Graph:
        self.graph.validate()
        return self.graph

    def bind(self, *, source: Source | None = None, sink: Sink | None = None) -> None:
        """Replace the single source and/or the primary sink (what ``--input``/``--output`` do):
        the sink named ``"out"`` if present, else the only sink."""
        if source is not None:
            srcs = [n for n in self.graph.nodes if n.kind == "source"]
            if len(srcs) != 1:
                raise GraphError(f"cannot bind an input: pipeline has {len(srcs)} sources")
            self.graph.replace(srcs[0].step_id, spec=source)
        if sink is not None:
            sinks = [n for n in self.graph.nodes if n.kind == "sink"]
            primary = [n for n in sinks if n.step_id == "out"] or sinks
            if len(primary) != 1:
                raise GraphError(
                    f"cannot bind an output: pipeline has {len(sinks)} sinks and none named 'out'"
                )
            self.graph.replace(primary[0].step_id, spec=sink)

    def run(self, options: RunOptions | None = None, **overrides: Any) -> RunSummary:
        """Run to completion in this process and return the ``RunSummary``; ``overrides``
        are ``RunOptions`` fields, e.g. ``p.run(dead_letter="dl.jsonl")``."""
        opts = options or RunOptions()
        return run(self, replace(opts, **overrides) if overrides else opts)


def _check_alert(step_id: str, alert: Any, what: str = "drift") -> None:
    """An alert target (drift, retrieval confidence) that cannot work fails where it is
    declared, naming the step."""
    if not isinstance(alert, str):
        return  # a callable
    try:
        if local_alert(alert):
            alert_sink(alert)
        else:  # a stream: its connector builds the record sink (connecting when the run starts)
            connector_for(alert).record_sink(alert)
    except ConfigError as exc:
        raise GraphError(f"step {step_id!r}: {what} alert target {alert!r}: {exc}", step=step_id) from exc


@dataclass(frozen=True)
class Stream:
    """The output of one step; each method adds a step reading it and returns that step's output."""

    pipeline: Pipeline
    step_id: str
    port: str = DEFAULT_PORT

    @property
    def ref(self) -> str:
        return self.step_id if self.port == DEFAULT_PORT else f"{self.step_id}:{self.port}"

    def output(self, port: str) -> Stream:
        """Another output port of this step (e.g. a window step's ``"late"`` port)."""
        return Stream(self.pipeline, self.step_id, port)

    def _add(
        self, step_id: str, kind: str, spec: Any, budget: float, ports: tuple[str, ...] = (DEFAULT_PORT,)
    ) -> Stream:
        self.pipeline.graph.add(
            Node(
                step_id=step_id,
                kind=kind,
                spec=spec,
                inputs=(self.ref,),
                ports=ports,
                latency_budget_ms=budget,
            )
        )
        return Stream(self.pipeline, step_id)

    def map_batch(
        self, step_id: str, fn: Callable[[Batch], Batch], *, latency_budget_ms: float = 1.0
    ) -> Stream:
        """Vectorised map: ``fn`` gets a whole ``Batch`` and returns one.

        >>> from aisp import CollectSink, WorkloadFSource
        >>> p, out = Pipeline("m"), CollectSink(columns=["id", "double"])
        >>> p.source("src", WorkloadFSource(events=3)).map_batch(
        ...     "double", lambda b: b.with_columns({"double": b.numpy("amount") * 2})).sink("out", out)
        >>> _ = p.run()
        >>> len(out.rows)
        3
        """
        return self._add(step_id, "map_batch", MapBatch(fn), latency_budget_ms)

    def map(self, step_id: str, fn: RowFn, *, latency_budget_ms: float = 5.0) -> Stream:
        """Per-row map (slower fallback): ``fn(row_dict) -> row_dict | None``."""
        return self._add(step_id, "map", MapRows(fn), latency_budget_ms)

    def filter(
        self, step_id: str, predicate: Callable[[Batch], Any], *, latency_budget_ms: float = 0.5
    ) -> Stream:
        """Keep rows where ``predicate(batch)`` (a boolean array) is true."""
        return self._add(step_id, "filter", Filter(predicate), latency_budget_ms)

    def tier(
        self,
        step_id: str,
        column: str,
        *,
        levels: Mapping[str, int] | None = None,
        default: int = 0,
        latency_budget_ms: float = 0.2,
    ) -> Stream:
        """Set each row's QoS tier from ``column`` (names such as gold/silver/bronze).

        Model steps serve higher tiers first and, under overload, shed the lowest first.

        >>> from aisp import CollectSink, WorkloadFSource
        >>> p, out = Pipeline("t"), CollectSink(columns=["tier"])
        >>> src = p.source("src", WorkloadFSource(events=4))
        >>> names = ["gold", "x", "bronze", "silver"]
        >>> named = src.map_batch("name", lambda b: b.with_columns({"tier": names}))
        >>> tiered = named.tier("qos", "tier")
        >>> tiered.map_batch("show", lambda b: b.with_columns({"tier": b.numpy("_tier")})).sink("out", out)
        >>> _ = p.run()
        >>> sorted(r["tier"] for r in out.rows)
        [0, 0, 1, 2]
        """
        spec = AssignTier(column, dict(levels) if levels is not None else dict(DEFAULT_TIERS), default)
        return self._add(step_id, "map_batch", spec, latency_budget_ms)

    def key_by(self, step_id: str, column: str, *, latency_budget_ms: float = 0.5) -> KeyedStream:
        """Partition by ``column``: adds the ``_key`` code that keyed state operators index by.

        >>> from aisp import CollectSink, WorkloadFSource
        >>> p, out = Pipeline("k"), CollectSink(columns=["user", "n"])
        >>> src = p.source("src", WorkloadFSource(events=500, users=3))
        >>> src.key_by("by_user", "user").running_stats("stats", "amount", count="n").sink("out", out)
        >>> _ = p.run()
        >>> sorted(max(r["n"] for r in out.rows if r["user"] == u) for u in ("u0", "u1", "u2")) == sorted(
        ...     sum(1 for r in out.rows if r["user"] == u) for u in ("u0", "u1", "u2"))
        True
        """
        self._add(step_id, "key_by", KeyBy(column, step_id), latency_budget_ms)
        return KeyedStream(self.pipeline, step_id, space=step_id)

    def infer(
        self,
        step_id: str,
        runtime: Runtime,
        *,
        inputs: Mapping[str, str],
        outputs: Mapping[str, str],
        batcher: BatcherConfig | None = None,
        latency_budget_ms: float = 10.0,
        drift: DriftConfig | None = None,
    ) -> Stream:
        """Model call with dynamic batching: model input name -> column, model output name -> column.

        ``drift`` watches the input features (PSI and KS per feature against a reference) and
        alerts when they shift (``aisp.observe.drift``)."""
        if drift is not None:
            _check_alert(step_id, drift.alert)
        if getattr(runtime, "cache", None) is not None:  # a model with a cache of its own
            self.pipeline.graph.caches[step_id] = runtime.cache  # type: ignore[attr-defined]
        spec = InferSpec(
            runtime=runtime,
            inputs=dict(inputs),
            outputs=dict(outputs),
            batcher=batcher or BatcherConfig(),
            drift=drift,
        )
        return self._add(step_id, "infer", spec, latency_budget_ms)

    def infer_by_tier(
        self,
        step_id: str,
        variants: Mapping[int, Runtime],
        *,
        default: Runtime,
        inputs: Mapping[str, str],
        outputs: Mapping[str, str],
        batcher: BatcherConfig | None = None,
        latency_budget_ms: float = 10.0,
    ) -> Stream:
        """A model step whose model depends on the row's tier, e.g. bronze on an INT8 variant.

        ``variants`` maps tiers to runtimes; other tiers use ``default``. Expands into
        ``{step_id}.route`` -> one infer step per model (``{step_id}.tier<N>``,
        ``{step_id}.default``) -> ``{step_id}`` (a union). Each row's ``model`` column names the
        model that scored it.
        """
        infer = dict(inputs=inputs, outputs=outputs, batcher=batcher, latency_budget_ms=latency_budget_ms)
        return expand_by_tier(self, step_id, variants, default, infer=infer)  # type: ignore[no-any-return]

    def infer_rollout(
        self,
        step_id: str,
        stable: Runtime,
        candidate: Runtime,
        policy: RolloutPolicy,
        *,
        inputs: Mapping[str, str],
        outputs: Mapping[str, str],
        batcher: BatcherConfig | None = None,
        latency_budget_ms: float = 10.0,
    ) -> Stream:
        """A model step that rolls ``candidate`` out over ``stable`` in the steps of ``policy``
        (shadow, then traffic shares by key), rolling back on a measured regression
        (``aisp.infer.steps``). The rollout's status: ``pipeline.rollouts[step_id]``."""
        infer: dict[str, Any] = dict(
            inputs=inputs, outputs=outputs, batcher=batcher, latency_budget_ms=latency_budget_ms
        )
        united, rollout = expand_rollout(self, step_id, stable, candidate, policy, infer=infer)
        self.pipeline.rollouts[step_id] = rollout
        return united  # type: ignore[no-any-return]

    def llm(self, step_id: str, spec: LlmSpec, *, latency_budget_ms: float = 1000.0) -> Stream:
        """An LLM generating from each row's prompt: its tokens go on as partial rows while they
        come, then the row with the answer (``aisp.infer.llm.stage``)."""
        return self._add(step_id, "llm", spec, latency_budget_ms)

    def route(
        self,
        step_id: str,
        branches: Sequence[str],
        *,
        column: str | None = None,
        predicates: Mapping[str, Callable[[Batch], Any]] | None = None,
        default: str | None = None,
        latency_budget_ms: float = 0.5,
    ) -> dict[str, Stream]:
        """Send each row to one branch, by a column of branch names or by predicates (first wins).

        >>> from aisp import CollectSink, WorkloadFSource
        >>> p, big, small = Pipeline("r"), CollectSink(columns=["amount"]), CollectSink(columns=["amount"])
        >>> is_big = {"big": lambda b: b.numpy("amount") > 20}
        >>> b = p.source("src", WorkloadFSource(events=200)).route(
        ...     "split", ["big", "small"], predicates=is_big, default="small")
        >>> b["big"].sink("big_out", big); b["small"].sink("small_out", small)
        >>> _ = p.run()
        >>> len(big.rows) + len(small.rows), all(r["amount"] > 20 for r in big.rows)
        (200, True)
        """
        spec = Route(tuple(branches), column=column, predicates=predicates, default=default)
        self._add(step_id, "route", spec, latency_budget_ms, ports=tuple(branches))
        return {b: Stream(self.pipeline, step_id, b) for b in branches}

    def apply(self, step_id: str, spec: Any, *, latency_budget_ms: float = 5.0) -> Stream:
        """A step of an operator spec (``build(ctx) -> Operator``): ``ImagePreprocess``,
        ``AudioDecode``, your own; its state, if it has any, is checkpointed. A spec with
        ``ports`` offers those outputs (``VideoDecode(audio=True)``: ``"audio"`` besides the
        default; read with ``.output(port)``)."""
        ports = tuple(getattr(spec, "ports", (DEFAULT_PORT,)))
        return self._add(step_id, "stateful", spec, latency_budget_ms, ports=ports)

    def vector_index(self, step_id: str, index: VectorIndex, *, latency_budget_ms: float = 5.0) -> Stream:
        """A vector index fed by this stream's upserts and deletes, answering its queries with
        the top k ids and scores (``aisp.transform.text.vectors``); its documents are checkpointed.
        ``index.confidence`` alerts when its queries stop matching it (``aisp.observe.retrieval``)."""
        if index.confidence is not None:
            _check_alert(step_id, index.confidence.alert, "retrieval confidence")
        return self.apply(step_id, index, latency_budget_ms=latency_budget_ms)

    def sink(self, step_id: str, sink: Sink, *, latency_budget_ms: float = 2.0) -> None:
        self.pipeline.graph.add(
            Node(
                step_id=step_id,
                kind="sink",
                spec=sink,
                inputs=(self.ref,),
                ports=(),
                latency_budget_ms=latency_budget_ms,
            )
        )


@dataclass(frozen=True)
class KeyedStream(Stream):
    """A stream whose rows carry ``_key``; keyed state operators are available on it."""

    space: str = ""

    def apply(self, step_id: str, spec: Any, *, latency_budget_ms: float = 5.0) -> KeyedStream:
        """``Stream.apply`` keyed: a spec whose ``space`` is empty gets this stream's."""
        if getattr(spec, "space", None) == "":
            spec = replace(spec, space=self.space)
        super().apply(step_id, spec, latency_budget_ms=latency_budget_ms)
        return KeyedStream(self.pipeline, step_id, space=self.space)

    def stateful(
        self,
        step_id: str,
        fn: StateFn,
        *,
        state: Sequence[tuple[str, str, float]] = (),
        latency_budget_ms: float = 1.0,
    ) -> KeyedStream:
        """``fn(batch, state_view) -> Batch`` over per-key state columns declared in ``state``."""
        self._add(step_id, "stateful", Stateful(fn, self.space, tuple(state)), latency_budget_ms)
        return KeyedStream(self.pipeline, step_id, space=self.space)

    def running_stats(
        self,
        step_id: str,
        column: str,
        *,
        count: str | None = "count",
        sum: str | None = None,  # noqa: A002 - mirrors the column it names
        mean: str | None = "mean",
        latency_budget_ms: float = 1.0,
    ) -> KeyedStream:
        """Per-key running count/sum/mean of ``column``, including the current row."""
        spec = RunningStats(column, self.space, count=count, sum=sum, mean=mean)
        self._add(step_id, "stateful", spec, latency_budget_ms)
        return KeyedStream(self.pipeline, step_id, space=self.space)

    def window(
        self,
        step_id: str,
        window: Tumbling | Sliding | Session,
        aggregates: Mapping[str, Aggregate],
        *,
        allowed_lateness_ms: int = 0,
        late: str = "dead_letter",
        early_every_ms: float = 0.0,
        start_column: str = "window_start",
        end_column: str = "window_end",
        latency_budget_ms: float = 1.0,
    ) -> KeyedStream:
        """Windows over event time per key: one row per window, ``{key, window_start,
        window_end, <aggregates>}``, once the watermark passes its end + ``allowed_lateness_ms``
        (``aisp.transform.windows.spec``). Events that missed their windows are dead letters with
        reason ``late`` (``late="side"``: rows on the ``"late"`` port, ``output("late")``;
        ``"drop"``: only counted). The source needs an ``EventTime``.

        >>> from aisp import CollectSink, Count, EventTime, Max, TestingSource, Tumbling
        >>> p, out = Pipeline("w"), CollectSink(columns=["user", "window_start", "n", "top"])
        >>> rows = [{"user": "a", "ts": t, "x": float(t)} for t in (1, 12, 3, 25)]
        >>> src = p.source("src", TestingSource(rows), event_time=EventTime("ts", max_out_of_orderness_ms=5))
        >>> src.key_by("by", "user").window("w", Tumbling(10), {"n": Count(), "top": Max("x")}).sink(
        ...     "out", out)
        >>> _ = p.run()
        >>> [(r["window_start"], r["n"], r["top"]) for r in out.rows]
        [(0, 2, 3.0), (10, 1, 12.0), (20, 1, 25.0)]
        """
        key_column = self.pipeline.graph.node(self.space).spec.column
        spec = WindowSpec(
            window=window,
            aggregates=tuple(aggregates.items()),
            space=self.space,
            key_column=key_column,
            allowed_lateness_ms=allowed_lateness_ms,
            late=late,
            early_every_ms=early_every_ms,
            start_column=start_column,
            end_column=end_column,
        )
        self._add(step_id, "window", spec, latency_budget_ms, ports=spec.ports)
        return KeyedStream(self.pipeline, step_id, space=self.space)

    def interval_join(
        self, step_id: str, right: KeyedStream, *, lower_ms: int, upper_ms: int, right_prefix: str = "right_"
    ) -> KeyedStream:
        """Rows of this stream and ``right`` with the same key whose event times satisfy
        ``left.t + lower_ms <= right.t <= left.t + upper_ms``, one output row per pair (the
        right row's columns under ``right_prefix``), keyed by this stream's key column; late
        rows are dead letters (``aisp.transform.joins``). Sources need an ``EventTime``."""
        spec = IntervalJoinSpec(
            column=self.pipeline.graph.node(self.space).spec.column,
            right_column=self.pipeline.graph.node(right.space).spec.column,
            lower_ms=lower_ms, upper_ms=upper_ms, space=step_id, right_prefix=right_prefix,
        )  # fmt: skip
        left = self.map_batch(f"{step_id}.left", tag_side(0))
        tagged = right.map_batch(f"{step_id}.right", tag_side(1))
        inputs = (left.ref, tagged.ref)
        self.pipeline.graph.add(
            Node(step_id=step_id, kind="join", spec=spec, inputs=inputs, latency_budget_ms=1.0)
        )
        return KeyedStream(self.pipeline, step_id, space=step_id)
