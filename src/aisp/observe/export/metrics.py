"""Prometheus metrics of a running pipeline, read from the executor's counters at scrape time.

Families (seconds and rows in the names; labels bounded by the pipeline's steps):

* ``aisp_stage_latency_seconds{stage, phase}``: per batch, time spent in each phase: ``queue``
  (waiting in the stage's input channel), ``batch`` (a model's rows waiting in its batcher),
  ``serialize`` (a source reading and decoding, a sink encoding and writing), ``compute``
  (an operator's work, a model call). Every stage has all four phases (empty where one does
  not apply, e.g. no queue for a step chained into its upstream's thread).
* ``aisp_e2e_latency_seconds``: per event, from ingest to the sink's write.
* ``aisp_stage_rows_total{stage, direction}``: rows in and out.
* ``aisp_stage_queue_rows{stage}``: rows waiting for the stage now.
* ``aisp_batch_size_rows{stage}``: rows per batch.
* ``aisp_model_rows_total{stage, outcome}``: a model step's rows by fate: scored, timeout
  (deadline or queue timeout), error (the call failed after its retries), shed (overload);
  ``aisp_model_calls_total{stage}``, its calls, and ``aisp_model_cpu_seconds_total{stage}``, the
  CPU time of the threads making them inside the calls (the model's own work where it computes
  on that thread, as ONNX Runtime does with one intra-op thread: no GIL or core waits in it).
* ``aisp_stage_busy_seconds_total{stage}``: wall time spent on batches (its rate is the stage's
  utilisation); ``aisp_stage_cpu_seconds_total{stage}``: the thread CPU time of that work
  (sources, operators, sinks; a model computes on its runtime's threads). Busy far above CPU
  means the stage waits on something.
* ``aisp_stage_info{stage, kind, thread}`` (1: the thread group doing the stage's work),
  ``aisp_stage_latency_budget_seconds{stage}``, ``aisp_batcher_setting{stage, setting}``
  (a model step's batching as configured or tuned).
* ``aisp_model_info{stage, model, version, provider, precision}`` (1: the version in use;
  precision ``fp32``, ``fp16``, ``int8`` or ``int4`` where the runtime knows it) and
  ``aisp_model_swaps_total{stage}`` (hot swaps), ``aisp_model_live_seconds{stage}`` (since the
  version in use began serving: the pipeline's start, or its last swap).
* For a model pool: ``aisp_model_endpoint_up{stage, endpoint}`` (1: taking calls),
  ``aisp_model_endpoint_outstanding``, ``aisp_model_endpoint_calls_total`` and
  ``aisp_model_endpoint_failures_total`` (calls it could not answer).
* ``aisp_retries_total{target, reason}``: retried calls to brokers and remote models (the
  process's).
* ``aisp_admission_events_total{outcome}``: a served pipeline's events accepted or refused
  (``queue_full``, ``rate_limited``).
* With an anomaly policy (``aisp.admission.anomaly``): ``aisp_anomaly_triggered_total`` (times
  the condition lowered the admitted rate), ``aisp_admitted_rate_events_per_second`` and
  ``aisp_anomaly_window{stat}`` (the last sliding window: offered/admitted/written events/s,
  score share, e2e p50/p99 in ms).
* Per window step: ``aisp_window_open{stage}`` (open windows), ``aisp_window_late_events_total
  {stage}``, ``aisp_watermark_lag_seconds{stage}`` (the wall clock minus the step's watermark).
* Per LLM step: time to first token, inter-token gaps, jitter, tokens/s, queueing, requests by
  outcome (``aisp.observe.export.llm``).
* ``aisp_uptime_seconds``: since the pipeline started (the clock of rates between scrapes).
* ``aisp_stage_errors_total{stage}``, ``aisp_dead_letters_total{stage}``,
  ``aisp_events_total{direction}``, ``aisp_checkpoints_total``, ``aisp_checkpoint_last_seconds``.
* ``aisp_slo_attainment_ratio{stage, target_seconds}``: the share of events within the
  pipeline's latency bound (the sum of its stages' budgets along the critical path;
  ``stage="pipeline"``), and per stage the share of batches computed within its budget.
* ``process_*`` (CPU seconds, resident memory, open files) and ``python_gc_*`` collections,
  with ``aisp_gc_pause_seconds``: how long each garbage collection stopped the process.
* ``aisp_drift_psi{stage, feature}``, ``aisp_drift_ks{stage, feature}``,
  ``aisp_drift_alerts_total{stage, feature}`` for infer steps with drift monitoring.
* ``aisp_worker_events_total{worker, direction}`` for a run on several workers.

Histograms are exported from the executor's own log-linear histograms (about 1% resolution)
into fixed Prometheus buckets, so recording stays one vectorised call per batch.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString as _go_float

from aisp.observe.clock import wall_ms
from aisp.observe.export.llm import llm_families
from aisp.observe.export.operators import counter_families, operator_counters
from aisp.observe.export.rollouts import rollout_families, step_statuses
from aisp.observe.latency import LatencyHistogram, histogram_buckets
from aisp.observe.stats import AdmissionStats, StageStats
from aisp.observe.view import PipelineView
from aisp.retry import RETRIES

__all__ = [
    "GcPauses",
    "PipelineCollector",
    "TextExposition",
    "gc_pauses",
    "histogram_buckets",
    "metrics_registry",
]

LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

_NO_WATERMARK = -(2**63)  # a window step's watermark before any event (transform.event_time)


class PipelineCollector:
    """A ``prometheus_client`` collector over one executor (see the module docstring)."""

    def __init__(
        self,
        executor: PipelineView,
        admission: AdmissionStats | None = None,
        *,
        retries: Any = RETRIES,
        anomaly: Any = None,
    ) -> None:
        self._ex = executor
        self._admission = admission
        self._anomaly = anomaly
        """Returns a served pipeline's ``AnomalyControl`` (or None): its rate, triggers and the
        window statistics (a callable: a policy can be installed at run time)."""
        self._retries = retries
        """Retry counts by (target, reason): this process's, or another's (``observe.remote``)."""

    def collect(self) -> Iterator[Any]:
        stats = self._ex.stats
        stages: list[StageStats] = list(stats.stages.values())
        yield from self._latency(stats, stages)
        yield from self._stages(stages)
        yield from self._events(stats)
        yield from self._models()
        yield from self._serving()
        yield self._slo(stats, stages)
        yield from self._drift()
        yield from self._windows()
        yield from llm_families(getattr(self._ex, "llm_stages", {}))
        yield from rollout_families("aisp_step_rollout", "stage", step_statuses(self._ex.graph))
        counters = getattr(self._ex, "counters", None)  # a remote view's come with its snapshots
        yield from counter_families(counters if counters is not None else operator_counters(self._ex.graph))

    def _latency(self, stats: Any, stages: list[StageStats]) -> Iterator[Any]:
        latency = HistogramMetricFamily(
            "aisp_stage_latency_seconds", "Per-batch time in each phase of a stage", labels=["stage", "phase"]
        )
        empty = LatencyHistogram()
        for st in stages:
            for phase in StageStats.PHASES:
                pairs, total = histogram_buckets(st.phases.get(phase, empty), LATENCY_BUCKETS_S, 1e9)
                latency.add_metric([st.step_id, phase], pairs, total)
        yield latency
        e2e = HistogramMetricFamily("aisp_e2e_latency_seconds", "Per-event latency, ingest to sink write")
        pairs, total = histogram_buckets(stats.e2e, LATENCY_BUCKETS_S, 1e9)
        e2e.add_metric([], pairs, total)
        yield e2e

    def _stages(self, stages: list[StageStats]) -> Iterator[Any]:
        rows = CounterMetricFamily(
            "aisp_stage_rows", "Rows into and out of a stage", labels=["stage", "direction"]
        )
        queue = GaugeMetricFamily("aisp_stage_queue_rows", "Rows waiting for a stage", labels=["stage"])
        sizes = HistogramMetricFamily("aisp_batch_size_rows", "Rows per batch", labels=["stage"])
        errors = CounterMetricFamily("aisp_stage_errors", "Batches that failed in a stage", labels=["stage"])
        busy = CounterMetricFamily(
            "aisp_stage_busy_seconds", "Wall time a stage spent working on batches", labels=["stage"]
        )
        cpu = CounterMetricFamily(
            "aisp_stage_cpu_seconds", "Thread CPU time of that work (not a model's)", labels=["stage"]
        )
        info = GaugeMetricFamily(
            "aisp_stage_info",
            "A stage's kind and the thread doing its work",
            labels=["stage", "kind", "thread"],
        )
        budgets = GaugeMetricFamily(
            "aisp_stage_latency_budget_seconds", "A stage's share of the latency budget", labels=["stage"]
        )
        threads = self._ex.thread_of()
        for st in stages:
            rows.add_metric([st.step_id, "in"], st.rows_in)
            rows.add_metric([st.step_id, "out"], st.rows_out)
            queue.add_metric([st.step_id], st.queue_rows())
            pairs, total = histogram_buckets(st.batch_rows, BATCH_BUCKETS, 1.0)
            sizes.add_metric([st.step_id], pairs, st.batch_rows.sum_ns)
            errors.add_metric([st.step_id], st.errors)
            busy.add_metric([st.step_id], st.busy_ns / 1e9)
            cpu.add_metric([st.step_id], st.cpu_ns / 1e9)
            info.add_metric([st.step_id, st.kind, threads.get(st.step_id, st.step_id)], 1)
            budgets.add_metric([st.step_id], self._ex.graph.node(st.step_id).latency_budget_ms / 1000)
        yield from (rows, queue, sizes, errors, busy, cpu, info, budgets)

    def _events(self, stats: Any) -> Iterator[Any]:
        dead = CounterMetricFamily("aisp_dead_letters", "Events dead-lettered, by the step", labels=["stage"])
        for step, n in sorted(self._ex.dead_letter.by_step.items()):
            dead.add_metric([step], n)
        yield dead
        events = CounterMetricFamily("aisp_events", "Events read and written", labels=["direction"])
        events.add_metric(["in"], stats.events_in)
        events.add_metric(["out"], stats.events_out)
        yield events
        workers = getattr(self._ex, "workers", None)  # a run on several workers (observe.remote)
        if workers:
            by_worker = CounterMetricFamily(
                "aisp_worker_events",
                "Events each worker process took and wrote",
                labels=["worker", "direction"],
            )
            for w in workers:
                by_worker.add_metric([str(w["worker"]), "in"], w["events_in"])
                by_worker.add_metric([str(w["worker"]), "out"], w["events_out"])
            yield by_worker
        yield CounterMetricFamily("aisp_checkpoints", "Checkpoints written", value=stats.checkpoints)
        yield GaugeMetricFamily(
            "aisp_checkpoint_last_seconds",
            "How long the durable part of the last checkpoint took (state, manifest, commits)",
            value=stats.checkpoint_s,
        )
        yield GaugeMetricFamily(
            "aisp_uptime_seconds", "Seconds since the pipeline started", value=stats.seconds()
        )

    def _models(self) -> Iterator[Any]:
        fates = CounterMetricFamily(
            "aisp_model_rows", "Rows a model step took, by fate", labels=["stage", "outcome"]
        )
        for sid, batcher in self._ex.batchers.items():
            b = batcher.stats
            for outcome, n in (
                ("scored", b.rows),
                ("timeout", b.timeouts),
                ("error", b.errors),
                ("shed", b.shed),
            ):
                fates.add_metric([sid, outcome], n)
        yield fates
        cpu = CounterMetricFamily(
            "aisp_model_cpu_seconds",
            "CPU time of the threads making a step's model calls, inside the calls",
            labels=["stage"],
        )
        calls = CounterMetricFamily("aisp_model_calls", "Model calls a step made", labels=["stage"])
        for sid, batcher in self._ex.batchers.items():
            cpu.add_metric([sid], getattr(batcher.stats, "cpu_ns", 0) / 1e9)
            calls.add_metric([sid], batcher.stats.batches)
        yield from (cpu, calls)
        models = GaugeMetricFamily(
            "aisp_model_info",
            "The model a step calls now (1), with its version, execution provider and precision",
            labels=["stage", "model", "version", "provider", "precision"],
        )
        swaps = CounterMetricFamily(
            "aisp_model_swaps", "Hot swaps to a newer model version", labels=["stage"]
        )
        live = GaugeMetricFamily(
            "aisp_model_live_seconds",
            "Seconds since the version a step calls began serving (its start, or its last swap)",
            labels=["stage"],
        )
        uptime, now = self._ex.stats.seconds(), time.monotonic()
        for sid, batcher in self._ex.batchers.items():
            rt = batcher.runtime
            precision = str(getattr(rt, "precision", "") or "")
            models.add_metric([sid, str(rt.name), str(rt.version), str(rt.provider), precision], 1)
            swaps.add_metric([sid], getattr(rt, "swaps", 0))
            since = getattr(rt, "live_since", None)
            live.add_metric([sid], min(uptime, now - since) if isinstance(since, float) else uptime)
        yield from (models, swaps, live)
        yield from self._pools()
        if self._ex.batchers:
            setting = GaugeMetricFamily(
                "aisp_batcher_setting",
                "A model step's batching: max_batch_rows, max_queue_delay_seconds, instances, capacity_rows",
                labels=["stage", "setting"],
            )
            for sid, batcher in self._ex.batchers.items():
                for name, value in batcher.settings().items():
                    setting.add_metric([sid, name], value)
            yield setting

    def _pools(self) -> Iterator[Any]:
        """Model pools' endpoints (``aisp.infer.runtimes.pool.RemotePool``)."""
        pools = {sid: ends() for sid, b in self._ex.batchers.items()
                 if callable(ends := getattr(b.runtime, "endpoints", None))}  # fmt: skip
        if not pools:
            return
        labels = ["stage", "endpoint"]
        up = GaugeMetricFamily(
            "aisp_model_endpoint_up", "A pool endpoint taking calls (1) or not", labels=labels
        )
        busy = GaugeMetricFamily(
            "aisp_model_endpoint_outstanding", "Calls in flight to a pool endpoint", labels=labels
        )
        calls = CounterMetricFamily("aisp_model_endpoint_calls", "Calls to a pool endpoint", labels=labels)
        failed = CounterMetricFamily(
            "aisp_model_endpoint_failures", "Calls a pool endpoint could not answer", labels=labels
        )
        for sid, endpoints in pools.items():
            for e in endpoints:
                up.add_metric([sid, e["url"]], 1.0 if e["state"] == "up" else 0.0)
                busy.add_metric([sid, e["url"]], e["outstanding"])
                calls.add_metric([sid, e["url"]], e["calls"])
                failed.add_metric([sid, e["url"]], e["failures"])
        yield from (up, busy, calls, failed)

    def _serving(self) -> Iterator[Any]:
        retries = CounterMetricFamily(
            "aisp_retries",
            "Retried calls to brokers and remote models, by target and reason",
            labels=["target", "reason"],
        )
        for (target, reason), n in self._retries.items():
            retries.add_metric([target, reason], n)
        yield retries
        if self._admission is not None:
            admission = CounterMetricFamily(
                "aisp_admission_events", "Events offered to a served pipeline, by outcome", labels=["outcome"]
            )
            for outcome in AdmissionStats.OUTCOMES:
                admission.add_metric([outcome], getattr(self._admission, outcome))
            yield admission
        control = self._anomaly() if self._anomaly is not None else None
        if control is not None:
            yield from self._anomaly_metrics(control.status())

    @staticmethod
    def _anomaly_metrics(status: dict[str, Any]) -> Iterator[Any]:
        yield CounterMetricFamily(
            "aisp_anomaly_triggered", "Times the anomaly condition lowered the admitted rate",
            value=status["triggered"],
        )  # fmt: skip
        yield GaugeMetricFamily(
            "aisp_admitted_rate_events_per_second", "The admitted rate the anomaly control allows",
            value=status["rate_events_per_s"],
        )  # fmt: skip
        window = GaugeMetricFamily(
            "aisp_anomaly_window", "The anomaly monitor's last sliding-window statistics", labels=["stat"]
        )
        for stat, value in status["window"].items():
            window.add_metric([stat], value)
        yield window

    def _slo(self, stats: Any, stages: list[StageStats]) -> Any:
        slo = GaugeMetricFamily(
            "aisp_slo_attainment_ratio",
            "Share of events (pipeline) or batches (stage compute) within the latency budget",
            labels=["stage", "target_seconds"],
        )
        target_ms = self._ex.graph.latency_bound_ms()
        if target_ms > 0 and stats.e2e.count:
            within = stats.e2e.cumulative([target_ms * 1e6])[0]
            slo.add_metric(["pipeline", repr(target_ms / 1000)], within / stats.e2e.count)
        for st in stages:
            budget = self._ex.graph.node(st.step_id).latency_budget_ms
            hist = st.phases.get("compute")
            if budget > 0 and hist is not None and hist.count:
                slo.add_metric(
                    [st.step_id, repr(budget / 1000)], hist.cumulative([budget * 1e6])[0] / hist.count
                )
        return slo

    def _windows(self) -> Iterator[Any]:
        windows = self._ex.windows
        if not windows:
            return
        now_s = wall_ms() / 1000
        open_ = GaugeMetricFamily("aisp_window_open", "Windows open in a window step", labels=["stage"])
        late = CounterMetricFamily(
            "aisp_window_late_events", "Events that missed every window they belong to", labels=["stage"]
        )
        lag = GaugeMetricFamily(
            "aisp_watermark_lag_seconds", "The wall clock minus a window step's watermark", labels=["stage"]
        )
        for sid, w in windows.items():
            open_.add_metric([sid], w.open_windows)
            late.add_metric([sid], w.late_events)
            if w.watermark > _NO_WATERMARK:
                lag.add_metric([sid], max(0.0, now_s - w.watermark / 1000))
        yield from (open_, late, lag)

    def _drift(self) -> Iterator[Any]:
        monitors = self._ex.drift_monitors
        if monitors:
            labels = ["stage", "feature"]
            psi = GaugeMetricFamily(
                "aisp_drift_psi", "PSI of the last window vs the reference", labels=labels
            )
            ks = GaugeMetricFamily(
                "aisp_drift_ks", "KS statistic of the last window vs the reference", labels=labels
            )
            alerts = CounterMetricFamily("aisp_drift_alerts", "Drift alerts raised", labels=labels)
            for m in monitors:
                raised = Counter(a["feature"] for a in m.alerts)
                for j, feature in enumerate(m.features):
                    psi.add_metric([m.stage, feature], float(m.psi[j]))
                    ks.add_metric([m.stage, feature], float(m.ks[j]))
                    alerts.add_metric([m.stage, feature], raised.get(feature, 0))
            yield from (psi, ks, alerts)


class GcPauses:
    """``aisp_gc_pause_seconds``: the duration of every garbage collection (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses = LatencyHistogram()
        self._started = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self.pauses.record_one(time.perf_counter_ns() - self._started)

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily("aisp_gc_pause_seconds", "Garbage collection pauses")
        pairs, total = histogram_buckets(self.pauses, LATENCY_BUCKETS_S, 1e9)
        family.add_metric([], pairs, total)
        yield family


_GC_PAUSES: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """The process's one ``GcPauses`` (installed into ``gc.callbacks`` on first use)."""
    global _GC_PAUSES  # noqa: PLW0603 - one hook per process
    if _GC_PAUSES is None:
        _GC_PAUSES = GcPauses()
        gc.callbacks.append(_GC_PAUSES)
    return _GC_PAUSES


def metrics_registry(
    executor: PipelineView, *, pid: int | None = None, gc_collector: Any = None, retries: Any = RETRIES
) -> CollectorRegistry:
    """A registry of ``executor``'s families with the process's (CPU, memory, GC and its pauses).

    For a pipeline in another process (``observe.remote``): ``pid`` is that process (its CPU
    and memory are read from ``/proc``), ``gc_collector`` yields its GC families and
    ``retries`` holds its retry counts.
    """
    registry = CollectorRegistry()
    registry.register(PipelineCollector(executor, retries=retries))
    ProcessCollector(registry=registry, pid=(lambda: str(pid)) if pid is not None else (lambda: "self"))
    if gc_collector is None:
        GCCollector(registry=registry)
        registry.register(gc_pauses())
    else:
        registry.register(gc_collector)
    return registry


class TextExposition:
    """The Prometheus text format of a registry, as ``prometheus_client.generate_latest`` writes
    it, with each series' name and labels formatted once and kept: a scrape then formats only
    the values (~5x less of the pipeline's GIL per scrape). Series are keyed by name and
    labels, so a new series (a model loaded, a dead letter of a new step) is formatted when it
    first appears. Thread-safe: concurrent scrapes may both format a new series once.
    """

    _OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._heads: dict[tuple[str, str, str], str] = {}

    def render(self) -> bytes:
        out: list[str] = []
        for metric in self._registry.collect():
            out.append(self._head(metric.name, metric.type, metric.documentation))
            extra: dict[str, list[str]] = {}
            only = {metric.name + x: x for x in self._OPENMETRICS_ONLY}
            for sample in metric.samples:
                line = self._line(sample.name, sample.labels, sample.value, sample.timestamp)
                suffix = only.get(sample.name)
                if suffix is None:
                    out.append(line)
                else:  # as generate_latest: a gauge of its own after the family
                    extra.setdefault(suffix, []).append(line)
            for suffix, lines in sorted(extra.items()):
                out.append(self._head(metric.name + suffix, "gauge", metric.documentation))
                out.extend(lines)
        return "".join(out).encode()

    def _head(self, name: str, mtype: str, doc: str) -> str:
        key = (name, mtype, doc)
        head = self._heads.get(key)
        if head is None:
            shown = {"counter": "counter", "info": "gauge", "stateset": "gauge"}.get(mtype, mtype)
            shown = {"gaugehistogram": "histogram", "unknown": "untyped"}.get(shown, shown)
            name = name + {"counter": "_total", "info": "_info"}.get(mtype, "")
            text = doc.replace("\\", r"\\").replace("\n", r"\n")
            head = self._heads[key] = f"# HELP {name} {text}\n# TYPE {name} {shown}\n"
        return head

    def _line(self, name: str, labels: dict[str, str], value: float, timestamp: Any) -> str:
        key = (name, tuple(labels.items()))
        prefix = self._prefixes.get(key)
        if prefix is None:
            pairs = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()))
            prefix = self._prefixes[key] = f"{name}{{{pairs}}} " if pairs else f"{name} "
        if timestamp is not None:
            return f"{prefix}{_number(value)} {int(float(timestamp) * 1000):d}\n"
        return f"{prefix}{_number(value)}\n"


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """A sample value as Prometheus writes it (``+Inf``, ``1e+06``, ...)."""
    return str(_go_float(value))  # type: ignore[no-untyped-call]
