"""Root-cause diagnosis of a running pipeline from its Prometheus metrics.

``diagnose(before, after)`` compares two scrapes of ``/metrics`` (or reads one, cumulative)
and returns findings, most likely cause first. Each names a ``cause``, the ``stage`` it is in,
the ``evidence`` (the numbers it rests on) and a concrete ``suggestion``.

How it reasons:

1. Per stage, the time an event spends there: waiting in the stage's queue, waiting in a
   model's batcher, (de)serialising, computing (``aisp_stage_latency_seconds``), and how busy
   the stage's thread is (``aisp_stage_busy_seconds_total`` over the window: its utilisation)
   and how much of that busy time is CPU (``aisp_stage_cpu_seconds_total``).
2. The bottleneck: the thread (group) nearest to saturation. When it is saturated, every wait
   upstream of it (queues, batchers, a paced source falling behind) is its doing and is
   charged to it.
3. The cause in that stage, from its kind and phases: a model whose calls dominate
   (``slow_model``), a model held to tiny batches (``small_batches``) or whose batches wait for
   rows that do not come (``slow_batch_fill``), encoding or decoding that burns CPU
   (``serialization``), a sink that waits on its destination (``slow_sink``), a per-row Python
   function (``row_udf``), a vector index's search (``index_bound``), image or audio decoding
   (``decode_bound``), a speech-to-text step's
   model (``asr_bound``), another operator
   (``slow_operator``); and for the whole pipeline, events refused or shed at admission
   (``admission_overload``), model calls failing or rows expiring (``model_errors``); an LLM
   step's requests waiting for a slot (``llm_queueing``) or slow generation
   (``llm_slow_generation``, see ``diagnose.llm``); a vector search step whose queries stop
   matching its index (``retrieval_confidence``, see ``diagnose.retrieval``). When nothing
   stands out: ``healthy``.

Failures rank above the latency causes: events lost to failing model calls (``model_errors``)
or turned away (``admission_overload``) score 1 plus their share; answers built on retrieval
that found nothing close (``retrieval_confidence``), and a quantized tier variant slower than
the FP32 model it stands in for (``quantization_tradeoff``, see ``diagnose.quantization``) 0.5
plus theirs; a model's slow calls on a version that began serving moments ago are its
``cold_start``. Otherwise a
finding's ``score`` is the share of the events' time it explains (0..1) or, for causes that
are work done (``slow_model``, ``row_udf``, ``slow_operator``, ``decode_bound``, ``asr_bound``,
``serialization``), the stage's share of all the stages' work when that is larger (Python work
under the GIL slows every other stage); a stage over its own latency budget ranks above
admission overload, which otherwise ranks first (when events are turned away, the load is the
story, not the stages that work as configured).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aisp.observe.diagnose.llm import LLM_CAUSES, llm_findings
from aisp.observe.diagnose.quantization import QUANTIZATION_CAUSES, ModelPoint, slower_variants, suggestion
from aisp.observe.diagnose.retrieval import RETRIEVAL_CAUSES, retrieval_findings
from aisp.observe.export.scrape import Scrape, _Hist, _Window, metrics_url

__all__ = ["CAUSES", "Finding", "Scrape", "diagnose", "metrics_url"]

CAUSES = (
    "slow_model",
    "small_batches",
    "slow_batch_fill",
    "serialization",
    "row_udf",
    "slow_operator",
    "index_bound",
    "decode_bound",
    "asr_bound",
    "slow_sink",
    "admission_overload",
    "model_errors",
    *LLM_CAUSES,
    *RETRIEVAL_CAUSES,
    *QUANTIZATION_CAUSES,
    "cold_start",
    "healthy",
)
PHASES = ("queue", "batch", "serialize", "compute")
SATURATED = 0.8  # a thread busy this share of the time is the bottleneck
TINY_BATCH_ROWS = 32  # a cap this low makes a model call's fixed cost dominate
BUSY_MODEL = 0.5  # a model busy this share of the time makes its rows wait for it
HOT_SPOTS = (
    "row_udf",
    "index_bound",
    "slow_operator",
    "decode_bound",
    "asr_bound",
    "serialization",
    "slow_model",
)  # work done
WAITING_CPU_SHARE = 0.25  # busy with less CPU than this: waiting, not working
IDLE_WORK = 0.1  # stages busy less than this in all (of one thread): their shares of it mean nothing
MODEL_CAUSES = ("slow_model", "small_batches")  # a model step's own calls
COLD_S = 60.0  # a version serving for less than this may still be warming up
COLD_TAIL = 4.0  # ... when its mean call is this many times its median one
FAILURES = ("admission_overload", "model_errors", *RETRIEVAL_CAUSES, *QUANTIZATION_CAUSES)  # never healthy


@dataclass
class _Stage:
    name: str
    kind: str
    thread: str
    phases: dict[str, _Hist]
    busy: float  # share of the window the stage worked (1.0: one thread's worth)
    cpu_share: float | None  # CPU / busy; None where not measured
    rows_in: float  # rows per second
    batch_rows: float  # mean rows per batch
    rows_p50: float  # median rows per batch (the mean where no buckets were exported)
    queue_rows: float
    budget_s: float
    settings: dict[str, float] = field(default_factory=dict)
    media: dict[str, float] = field(default_factory=dict)  # an image or audio step's work, per second
    speech: dict[str, float] = field(default_factory=dict)  # a speech-to-text step's, per second
    search: dict[str, float] = field(
        default_factory=dict
    )  # a vector index's: seconds searching a second, ...
    precision: str = ""  # a model step's: fp32, fp16, int8 or int4 where known

    def mean(self, phase: str) -> float:
        return self.phases[phase].mean

    def p99(self, phase: str) -> float:
        return self.phases[phase].quantile(0.99)

    @property
    def own_s(self) -> float:
        """Mean time per batch of this stage's own work that its events wait for (a source
        stamps ingest times once a batch is read, so its reading precedes them)."""
        return 0.0 if self.kind == "source" else self.mean("compute") + self.mean("serialize")

    @property
    def wait_s(self) -> float:
        return self.mean("queue") + self.mean("batch")


@dataclass(frozen=True)
class Finding:
    """A likely cause of latency or loss, with the numbers behind it."""

    cause: str
    stage: str
    score: float
    evidence: dict[str, Any]
    suggestion: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "stage": self.stage,
            "score": round(self.score, 3),
            "evidence": self.evidence,
            "suggestion": self.suggestion,
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _stages(w: _Window, seconds: float) -> list[_Stage]:
    info = w.after.series("aisp_stage_info")
    if info:
        meta = [(d["stage"], d["kind"], d.get("thread", d["stage"])) for d in map(dict, info)]
    else:  # an older exporter: stages from the latency family, kinds unknown
        names = {dict(k)["stage"] for k in w.after.series("aisp_stage_latency_seconds_count")}
        meta = [(n, "", n) for n in sorted(names)]
    precision = {dict(k)["stage"]: dict(k).get("precision", "") for k in w.after.series("aisp_model_info")}
    out = []
    for name, kind, thread in meta:
        busy_s = w.delta("aisp_stage_busy_seconds_total", stage=name)
        cpu_s = w.delta("aisp_stage_cpu_seconds_total", stage=name)
        sizes = w.hist("aisp_batch_size_rows", stage=name)
        settings = {
            dict(k)["setting"]: v
            for k, v in w.after.series("aisp_batcher_setting").items()
            if dict(k)["stage"] == name
        }
        out.append(
            _Stage(
                name=name,
                kind=kind,
                thread=thread,
                phases={p: w.hist("aisp_stage_latency_seconds", stage=name, phase=p) for p in PHASES},
                busy=busy_s / seconds if seconds > 0 else 0.0,
                cpu_share=cpu_s / busy_s if kind != "infer" and busy_s > 0 and cpu_s > 0 else None,
                rows_in=w.delta("aisp_stage_rows_total", stage=name, direction="in") / max(seconds, 1e-9),
                batch_rows=sizes.mean,
                rows_p50=sizes.quantile(0.5) or sizes.mean,
                queue_rows=w.gauge("aisp_stage_queue_rows", stage=name),
                budget_s=w.gauge("aisp_stage_latency_budget_seconds", stage=name),
                settings=settings,
                media={
                    m: w.delta(f"aisp_media_{m}_total", stage=name) / max(seconds, 1e-9)
                    for m in ("decode_seconds", "bytes", "units")
                },
                speech={
                    m: w.delta(f"aisp_asr_{m}_total", stage=name) / max(seconds, 1e-9)
                    for m in ("model_seconds", "audio_seconds", "model_audio_seconds")
                },
                precision=precision.get(name, ""),
                search=_search(w, name, seconds),
            )
        )
    return out


def _search(w: _Window, stage: str, seconds: float) -> dict[str, float]:
    """A vector index's search: seconds spent a second, queries a second, and its index as
    exported (documents, exact, exact_below, expansion_search, dim); empty for other steps."""
    queries = w.delta("aisp_retrieval_queries_total", stage=stage)
    if not queries:
        return {}
    index = {
        dict(k)["field"]: v
        for k, v in w.after.series("aisp_retrieval_index").items()
        if dict(k)["stage"] == stage
    }
    span = max(seconds, 1e-9)
    searching = w.delta("aisp_retrieval_search_seconds_total", stage=stage)
    return {
        "seconds": searching / span,
        "queries": queries / span,
        "per_query_s": searching / queries,
        **index,
    }


def _pow2_at_least(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, 2 ** math.ceil(math.log2(max(x, 1.0))))))


def _classify(st: _Stage, thread_busy: float) -> tuple[str, str, dict[str, Any]] | None:
    """The cause inside one stage: (cause, suggestion, evidence), or None. ``thread_busy`` is
    the utilisation of the thread doing its work (a model's: with what runs after it)."""
    ev: dict[str, Any] = {
        "busy_share": round(st.busy, 3),
        "rows_per_batch": round(st.batch_rows, 1),
        "queue_rows": int(st.queue_rows),
    }
    for p in PHASES:
        if st.phases[p].count:
            ev[f"{p}_mean_ms"], ev[f"{p}_p99_ms"] = _ms(st.mean(p)), _ms(st.p99(p))
    if st.cpu_share is not None:
        ev["cpu_share_of_busy"] = round(st.cpu_share, 2)
    if st.budget_s:
        ev["budget_ms"] = _ms(st.budget_s)
    per_row_us = round(st.own_s / st.batch_rows * 1e6, 2) if st.batch_rows else 0.0
    if st.kind == "llm":
        return None  # (``diagnose.llm``)
    if st.kind == "infer":
        return _classify_model(st, thread_busy, ev, per_row_us)
    if st.kind in ("sink", "source"):
        return _classify_io(st, ev, per_row_us)
    return _classify_operator(st, ev, per_row_us)


def _classify_model(
    st: _Stage, thread_busy: float, ev: dict[str, Any], per_row_us: float
) -> tuple[str, str, dict[str, Any]]:
    """A model step's cause: batches too small, batches slow to fill, or the model itself."""
    cap = st.settings.get("max_batch_rows", 0.0)
    delay = st.settings.get("max_queue_delay_seconds", 0.0)
    instances = int(st.settings.get("instances", 1) or 1)
    ev.update(max_batch_rows=int(cap), instances=instances, compute_us_per_row=per_row_us)
    at_cap = cap > 0 and st.batch_rows >= 0.8 * cap
    # rows wait for calls in the batcher, or (calls run in the thread that feeds the model,
    # back to back) in the batch being fed: either way the model is kept busy a row at a time
    kept_busy = st.wait_s >= st.mean("compute") or st.busy / instances >= BUSY_MODEL
    if at_cap and cap <= TINY_BATCH_ROWS and kept_busy:
        need = st.rows_in * st.mean("compute") * 4  # rows arriving during four calls
        size = _pow2_at_least(need, int(cap) * 4, 1024)
        return (
            "small_batches",
            f"raise max_batch_size of step {st.name!r} from {int(cap)} to {size}: each call takes "
            f"{_ms(st.mean('compute'))} ms for {st.batch_rows:.0f} rows while rows wait "
            f"{_ms(st.wait_s)} ms for a call",
            ev,
        )
    # rows also wait in the batcher while every instance is busy: then the model is the
    # reason, not the batching
    idle = thread_busy < BUSY_MODEL
    filling = cap > 0 and st.batch_rows < 0.5 * cap and delay > 0 and st.mean("batch") >= 0.5 * delay
    if idle and filling and st.mean("batch") > st.mean("compute"):
        target = max(st.mean("compute"), delay / 4)
        ev["max_queue_delay_ms"] = _ms(delay)
        return (
            "slow_batch_fill",
            f"batches of step {st.name!r} wait {_ms(st.mean('batch'))} ms to fill and hold "
            f"{st.batch_rows:.0f} of {int(cap)} rows: lower max_queue_delay_ms from "
            f"{_ms(delay)} to {_ms(target)} (or set eager=True)",
            ev,
        )
    return (
        "slow_model",
        f"calls of step {st.name!r} take {_ms(st.mean('compute'))} ms (p99 {_ms(st.p99('compute'))} ms) "
        f"for {st.batch_rows:.0f} rows ({per_row_us} us/row): add instances (now {instances}), use a "
        "faster execution provider or a quantized (int8) or smaller model",
        ev,
    )


def _classify_io(st: _Stage, ev: dict[str, Any], per_row_us: float) -> tuple[str, str, dict[str, Any]] | None:
    """A source's or a sink's cause: waiting on its peer, or (de)serialising on the CPU."""
    # busy wall time off the CPU: waiting on I/O or a peer (or for the GIL, in a busy process)
    waiting = st.cpu_share is not None and st.cpu_share < WAITING_CPU_SHARE
    if st.kind == "sink":
        if waiting:
            return (
                "slow_sink",
                f"writes of sink {st.name!r} take {_ms(st.mean('serialize'))} ms per batch, "
                f"{100 * (1 - (st.cpu_share or 0)):.0f}% of it waiting on the destination: write "
                "bigger batches, write asynchronously or to more partitions, or speed up the store",
                ev,
            )
        return (
            "serialization",
            f"sink {st.name!r} spends {_ms(st.mean('serialize'))} ms per batch encoding "
            f"({per_row_us} us/row, "
            "on the CPU): write fewer or narrower columns, a binary format (Arrow IPC), or encode in "
            "a worker process",
            ev,
        )
    if waiting:  # a source waiting for input is idle, not slow
        return None
    return (
        "serialization",
        f"source {st.name!r} spends {_ms(st.mean('serialize'))} ms per batch decoding "
        f"({per_row_us} us/row): "
        "drop unused fields at the source, declare a schema with fixed types, use a binary "
        "format, or decode in a worker process",
        ev,
    )


def _classify_operator(
    st: _Stage, ev: dict[str, Any], per_row_us: float
) -> tuple[str, str, dict[str, Any]] | None:
    """An operator's cause: a per-row Python function, or slow vectorised work."""
    ev["compute_us_per_row"] = per_row_us
    decoding = st.media.get("decode_seconds", 0.0)
    if decoding > 0 and decoding >= 0.5 * st.busy:  # its decoding threads summed
        ev.update(decode_threads_busy=round(decoding, 2), mb_in_per_s=round(st.media["bytes"] / 1e6, 2),
                  units_per_s=round(st.media["units"]))  # fmt: skip
        return (
            "decode_bound",
            f"step {st.name!r} spends its time decoding ({round(decoding, 2)} threads busy, "
            f"{ev['mb_in_per_s']} MB/s in): give it more cores (its threads, or workers), or "
            "send smaller inputs (a JPEG no larger than the tensor needs decodes at a DCT scale)",
            ev,
        )
    if st.search.get("seconds", 0.0) >= 0.5 * st.busy > 0:
        return _index_bound(st, ev)
    asr = st.speech.get("model_seconds", 0.0)
    if asr > 0 and asr >= 0.5 * st.busy:
        audio = st.speech.get("audio_seconds", 0.0)
        heard = st.speech.get("model_audio_seconds", 0.0) / max(audio, 1e-9)
        ev.update(
            model_busy=round(asr, 2), audio_s_per_s=round(audio, 2), model_audio_per_audio=round(heard, 2)
        )
        return (
            "asr_bound",
            f"step {st.name!r} spends its time in the speech model ({round(asr, 2)} s a second for "
            f"{ev['audio_s_per_s']} s of audio a second, the model hearing "
            f"{ev['model_audio_per_audio']}x the audio): make fewer partial captions (a larger "
            "partial_every_s, or 0), pad clips less (pad_s), run a smaller model, or give it more "
            "cores or a GPU",
            ev,
        )
    if st.kind == "map":
        return (
            "row_udf",
            f"step {st.name!r} calls a Python function per row ({per_row_us} us/row, "
            f"{_ms(st.mean('compute'))} ms per batch) and holds the GIL: rewrite it with map_batch "
            "over numpy/Arrow columns",
            ev,
        )
    if st.own_s > 0:
        return (
            "slow_operator",
            f"step {st.name!r} takes {_ms(st.mean('compute'))} ms per batch ({per_row_us} us/row): "
            "profile it (py-spy) and vectorise its hot loop",
            ev,
        )
    return None


def _index_bound(st: _Stage, ev: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """A vector index whose searches are most of its step's work: exact over too many documents,
    or a graph searched wider than it needs."""
    s = st.search
    docs, exact = int(s.get("documents", 0)), bool(s.get("exact", 0))
    ev.update(
        documents=docs,
        search="exact" if exact else "hnsw",
        search_ms_per_query=_ms(s["per_query_s"]),
        queries_per_s=round(s["queries"], 1),
        searching_share=round(s["seconds"] / max(st.busy, 1e-9), 2),
    )
    if exact:
        how = (
            f"it searches all {docs} documents exactly ({_ms(s['per_query_s'])} ms a query; exact_below="
            f"{int(s.get('exact_below', 0))}): lower exact_below so that an HNSW graph answers (recall "
            "above 0.95 at a fraction of the cost), or fewer dimensions"
        )
    else:
        how = (
            f"its HNSW graph of {docs} documents takes {_ms(s['per_query_s'])} ms a query: lower "
            f"expansion_search (now {int(s.get('expansion_search', 0))}) or connectivity, use fewer "
            "dimensions, or split the index across workers"
        )
    return "index_bound", f"step {st.name!r} spends its time searching its vector index: {how}", ev


def _waits_on_itself(st: _Stage, cause: str) -> bool:
    """Rows wait in this model's batcher because of the model: its batching, or its calls
    keeping every instance busy."""
    if cause in ("small_batches", "slow_batch_fill"):
        return True
    instances = st.settings.get("instances", 1) or 1
    return cause == "slow_model" and st.busy / instances >= BUSY_MODEL


def _thread_busy(stages: list[_Stage]) -> dict[str, float]:
    """Each thread group's utilisation (a model's: per instance)."""
    busy: dict[str, float] = defaultdict(float)
    for st in stages:
        instances = st.settings.get("instances", 1) or 1 if st.kind == "infer" else 1
        busy[st.thread] += st.busy / instances
    return dict(busy)


def _admission(w: _Window, stages: list[_Stage]) -> tuple[float, float, dict[str, Any], str]:
    """(refused, offered, evidence, where): events turned away at a served pipeline's admission
    queue or rate limits, or shed by a model's bounded queue; offered is everything that came."""
    full = w.delta("aisp_admission_events_total", outcome="queue_full")
    limited = w.delta("aisp_admission_events_total", outcome="rate_limited")
    offered = w.delta("aisp_events_total", direction="in") + full + limited
    ev: dict[str, Any] = {"offered": int(offered)}
    if full or limited:
        ev.update(refused_queue_full=int(full), refused_rate_limited=int(limited))
    shed = {st.name: w.delta("aisp_model_rows_total", stage=st.name, outcome="shed") for st in stages}
    ev.update({f"shed_{name}": int(n) for name, n in shed.items() if n})
    top = max(shed, key=lambda n: shed[n], default="")
    where = top if top and shed[top] > full + limited else "admission"
    return full + limited + sum(shed.values()), offered, ev, where


def diagnose(before: Scrape | None, after: Scrape, *, seconds: float | None = None) -> list[Finding]:
    """Findings over the window between two scrapes (``before`` None: since the start),
    most likely first. ``seconds`` is the window's length when the pipeline's own uptime
    gauge is missing."""
    w = _Window(before, after)
    span = w.delta("aisp_uptime_seconds") or (seconds or 0.0)
    stages = _stages(w, span)
    e2e = w.hist("aisp_e2e_latency_seconds")
    findings: list[Finding] = []
    base = {"e2e_p99_ms": _ms(e2e.quantile(0.99)), "e2e_mean_ms": _ms(e2e.mean), "window_s": round(span, 2)}
    # where each event's time goes: stages' own work and waits, plus lag before the source read
    accounted = sum(st.own_s + st.wait_s for st in stages)
    lag = max(e2e.mean - accounted, 0.0)
    total = max(accounted + lag, 1e-12)
    busy = _thread_busy(stages)
    hot_thread = max(busy, key=lambda t: busy[t]) if busy else ""
    saturated = busy.get(hot_thread, 0.0) >= SATURATED
    owners = [st for st in stages if st.thread == hot_thread]
    bottleneck = max(owners, key=lambda st: st.busy).name if saturated and owners else ""
    work = sum(st.busy for st in stages)
    for st in stages:
        found = _classify(st, busy.get(st.thread, 0.0))
        if found is None:
            continue
        cause, suggestion, ev = found
        explained = st.own_s + (st.mean("batch") if _waits_on_itself(st, cause) else 0.0)
        if st.name == bottleneck:  # every wait in the pipeline is behind this stage
            explained = st.own_s + sum(s.wait_s for s in stages) + lag
            ev["bottleneck_thread_busy_share"] = round(busy[hot_thread], 3)
        score = min(explained / total, 1.0)
        if cause in HOT_SPOTS and work >= IDLE_WORK:  # the pipeline's work is mostly here
            ev["share_of_pipeline_work"] = round(st.busy / work, 3)
            score = max(score, st.busy / work)
        if st.budget_s and st.own_s > st.budget_s:
            ev["over_budget"] = True
        findings.append(Finding(cause, st.name, score, {**ev, **base}, suggestion))
    findings.extend(_pipeline_findings(w, stages, findings, base))
    findings.extend(_model_server_findings(w, base))
    findings.extend(
        Finding(*f) for f in llm_findings(w, [st.name for st in stages if st.kind == "llm"], base)
    )
    findings.extend(Finding(*f) for f in retrieval_findings(w, base))
    findings = _quantization(stages, findings, w, base)
    findings = _cold_start(w, stages, findings)
    findings.sort(key=lambda f: -f.score)
    meaningful = [f for f in findings if f.score >= 0.05 or f.cause in FAILURES]
    if not meaningful or (e2e.count and _healthy(stages, e2e, after, meaningful)):
        target = _target_s(after)
        ev = {**base, "slo_target_ms": _ms(target)} if target else base
        top = meaningful[0].stage if meaningful else ""
        return [
            Finding("healthy", top, 1.0, ev, "no bottleneck: every stage is within its budget"),
            *meaningful,
        ]
    return meaningful


def _quantization(
    stages: list[_Stage], findings: list[Finding], w: _Window, base: dict[str, Any]
) -> list[Finding]:
    """A quantized tier variant slower than its FP32 sibling (``diagnose.quantization``): a
    defect whatever the latency, scored 0.5 plus its share of the model steps' time; it takes
    the place of its step's slow-call finding."""
    points = []
    for st in stages:
        calls = w.delta("aisp_model_calls_total", stage=st.name)
        cpu_s = w.delta("aisp_model_cpu_seconds_total", stage=st.name)
        if st.kind == "infer" and calls > 0 and cpu_s > 0:
            rows = w.delta("aisp_model_rows_total", stage=st.name, outcome="scored") / calls
            points.append(ModelPoint(st.name, st.precision, rows, cpu_s / calls, calls))
    model_time = sum(p.call_s * p.calls for p in points)
    for q, f, ev in slower_variants(points):
        share = q.call_s * q.calls / max(model_time, 1e-12)
        old = next((x for x in findings if x.stage == q.stage and x.cause in MODEL_CAUSES), None)
        if old is not None:
            findings.remove(old)
            ev = {**old.evidence, **ev}
        ev["share_of_model_time"] = round(share, 3)
        score = max(old.score if old is not None else 0.0, 0.5 + share)
        findings.append(Finding("quantization_tradeoff", q.stage, score, {**ev, **base}, suggestion(q, f)))
    return findings


def _cold_start(w: _Window, stages: list[_Stage], findings: list[Finding]) -> list[Finding]:
    """A model step's slow calls that are its version's first ones: it began serving within
    ``COLD_S`` (at the start, or a hot swap) and a few of its calls take so much longer than the
    rest that they are most of its time (the mean call ``COLD_TAIL`` times the median, beyond
    what the spread of the batches' sizes explains), as a model's do while it compiles,
    allocates or loads for the shapes it meets under traffic."""
    out = []
    for f in findings:
        st = next((x for x in stages if x.name == f.stage and x.kind == "infer"), None)
        if st is None or f.cause not in MODEL_CAUSES or not st.phases["compute"].count:
            out.append(f)
            continue
        known = any(dict(k).get("stage") == st.name for k in w.after.series("aisp_model_live_seconds"))
        live_s = w.gauge("aisp_model_live_seconds", stage=st.name) if known else math.inf  # (older exporters)
        swapped = w.delta("aisp_model_swaps_total", stage=st.name)
        p50, mean = st.phases["compute"].quantile(0.5), st.mean("compute")
        # a few calls far longer than the rest, so that they are most of the step's time: the
        # mean that many times the median call, beyond what the batches' sizes make of it
        tail = mean / p50 / max(st.batch_rows / max(st.rows_p50, 1e-9), 1.0) if p50 > 0 else 0.0
        long_tail = tail >= COLD_TAIL
        if (live_s <= COLD_S or swapped > 0) and long_tail:
            since = f"{round(live_s, 1)} s ago" if known else "in this window (a swap)"
            ev = {**f.evidence, "live_s": round(live_s, 1) if known else None, "swaps": int(swapped),
                  "compute_p50_ms": _ms(p50), "compute_mean_ms": _ms(mean),
                  "tail_factor": round(tail, 1)}  # fmt: skip
            f = Finding(
                "cold_start",
                st.name,
                f.score,
                ev,
                f"the model of step {st.name!r} began serving {since} and a few of its "
                f"calls take so long that they average {_ms(mean)} ms against a median of {_ms(p50)} ms:"
                " it is warming up "
                "under traffic; give it input shapes (input_specs) so AISP warms it up at its batch "
                "sizes before the first event, fix the sizes it meets (preferred_batch_sizes, "
                "padding), keep an engine or compile cache, and load new versions beside the old one",
            )
        out.append(f)
    return out


def _target_s(after: Scrape) -> float:
    for key in after.series("aisp_slo_attainment_ratio"):
        d = dict(key)
        if d.get("stage") == "pipeline":
            return float(d["target_seconds"])
    return 0.0


def _healthy(stages: list[_Stage], e2e: _Hist, after: Scrape, findings: Iterable[Finding]) -> bool:
    """Nothing to fix: the pipeline meets its latency target, no stage is near saturation or over
    its budget, nothing is refused."""
    target = _target_s(after)
    if not target or e2e.quantile(0.99) > target:
        return False
    if any(f.cause in FAILURES or f.evidence.get("over_budget") for f in findings):
        return False
    return max(_thread_busy(stages).values(), default=0.0) < SATURATED


def _pipeline_findings(
    w: _Window, stages: list[_Stage], found: list[Finding], base: dict[str, Any]
) -> list[Finding]:
    out = []
    refused, offered, ev, where = _admission(w, stages)
    if offered and refused / offered >= 0.01:
        share = refused / offered
        strong = [
            f.score
            for f in found
            if f.evidence.get("over_budget") and "bottleneck_thread_busy_share" in f.evidence
        ]
        score = 0.9 * max(strong) if strong else 1.0 + share
        out.append(
            Finding(
                "admission_overload",
                where,
                score,
                {**ev, "refused_share": round(share, 3), **base},
                f"{100 * share:.1f}% of the offered events were turned away: the offered rate exceeds "
                "what the pipeline sustains; add capacity (model instances, workers), lower the "
                "offered rate, or raise the admission queue if bursts are short",
            )
        )
    for st in stages:
        if st.kind != "infer":
            continue
        errors = w.delta("aisp_model_rows_total", stage=st.name, outcome="error")
        timeouts = w.delta("aisp_model_rows_total", stage=st.name, outcome="timeout")
        scored = w.delta("aisp_model_rows_total", stage=st.name, outcome="scored")
        failed = errors + timeouts
        if failed and failed / (failed + scored) >= 0.01:
            share = failed / (failed + scored)
            out.append(
                Finding(
                    "model_errors",
                    st.name,
                    1.0 + share,  # events lost, not late: ranked with admission overload
                    {"errors": int(errors), "timeouts": int(timeouts), "scored": int(scored), **base},
                    f"{100 * share:.1f}% of the rows of step {st.name!r} failed or expired: check the "
                    "model's dead letters for the cause; give deadlines more room or the model more capacity",
                )
            )
    return out


def _model_server_findings(w: _Window, base: dict[str, Any]) -> list[Finding]:
    """A model server's own requests (``aisp serve REPOSITORY``): 429s are admission overload,
    5xx model errors, by model."""
    by_model: dict[str, Counter[str]] = defaultdict(Counter)
    for key in w.after.series("aisp_requests_total"):
        d = dict(key)
        by_model[d["model"]][d["code"]] += int(w.delta("aisp_requests_total", **d))
    out = []
    for model, codes in sorted(by_model.items()):
        total = sum(codes.values())
        refused = codes.get("429", 0) + codes.get("RESOURCE_EXHAUSTED", 0)
        failed = sum(
            n for code, n in codes.items() if code.startswith("5") or code in ("INTERNAL", "UNAVAILABLE")
        )
        queue = w.gauge("aisp_model_queue_rows", model=model)
        ev = {"requests": total, "refused": refused, "failed": failed, "queue_rows": int(queue), **base}
        if total and refused / total >= 0.01:
            out.append(
                Finding(
                    "admission_overload",
                    model,
                    1.0 + refused / total,
                    ev,
                    f"{100 * refused / total:.1f}% of the requests for model {model!r} were refused (429): "
                    "raise its capacity (instances, max_batch_size), its queue, or lower the offered rate",
                )
            )
        if total and failed / total >= 0.01:
            out.append(
                Finding(
                    "model_errors",
                    model,
                    1.0 + failed / total,
                    ev,
                    f"{100 * failed / total:.1f}% of the requests for model {model!r} failed: "
                    "see the server's log",
                )
            )
    return out
