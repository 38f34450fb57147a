"""Prometheus families of a pipeline's LLM steps (``aisp.infer.llm.stage``), read at scrape time:

* ``aisp_llm_ttft_seconds{stage}``: time to first token, from the event's ingest (the steps
  before and the queueing included); ``aisp_llm_first_token_seconds{stage}``: from the request's start (the
  server's share); ``aisp_llm_queue_seconds{stage}``: waiting for a slot;
  ``aisp_llm_inter_token_seconds{stage}``: the gaps between pieces of text;
  ``aisp_llm_generation_seconds{stage}``: request start to its last piece.
* ``aisp_llm_jitter{stage}`` (stdev / mean of the gaps, recent requests),
  ``aisp_llm_tokens_per_second{stage}`` (recent requests' streaming rate),
  ``aisp_llm_tokens_total{stage}``.
* ``aisp_llm_requests_total{stage, outcome}``: completed, failed, refused (by a served
  pipeline's admission) and shed_<why> (``ttft_slo``, ``tier``, ``queue_full``, ``waited``).
* ``aisp_llm_probes_total{stage}``: requests admitted as probes (the step idle for
  ``LlmSlo.probe_ms``, whatever the prediction).
* ``aisp_llm_running{stage}``, ``aisp_llm_queued{stage}``, ``aisp_llm_limit{stage}``
  (generations at a time) and ``aisp_llm_slo{stage, target}`` (``ttft_seconds``, ``jitter``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aisp.observe.latency import LatencyHistogram, histogram_buckets

__all__ = ["TOKEN_BUCKETS", "TTFT_BUCKETS", "llm_families", "llm_snapshot", "llm_views", "merge_llm"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

_HISTOGRAMS = (
    ("ttft", "aisp_llm_ttft_seconds", "Time to first token from the event's ingest", TTFT_BUCKETS),
    ("first_token", "aisp_llm_first_token_seconds", "Time to first token from the request's start",
     TTFT_BUCKETS),
    ("queue", "aisp_llm_queue_seconds", "Time a request waited for a free slot", TTFT_BUCKETS),
    ("inter_token", "aisp_llm_inter_token_seconds", "Gaps between streamed pieces of text", TOKEN_BUCKETS),
    ("generation", "aisp_llm_generation_seconds", "Request start to its last piece", TTFT_BUCKETS),
)  # fmt: skip


def llm_families(stages: Mapping[str, Any]) -> Iterator[Any]:
    """The families above for ``stages`` (step id -> ``LlmStage``); nothing when there are none."""
    if not stages:
        return
    for attr, name, doc, bounds in _HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=["stage"])
        for sid, stage in stages.items():
            pairs, total = histogram_buckets(getattr(stage.stats, attr), bounds, 1e9)
            family.add_metric([sid], pairs, total)
        yield family
    gauges = {
        "jitter": GaugeMetricFamily("aisp_llm_jitter", "Stdev / mean of the gaps between pieces, recent"
                                    " requests", labels=["stage"]),
        "rate": GaugeMetricFamily("aisp_llm_tokens_per_second", "Streaming rate of recent requests",
                                  labels=["stage"]),
        "running": GaugeMetricFamily("aisp_llm_running", "Generations in flight", labels=["stage"]),
        "queued": GaugeMetricFamily("aisp_llm_queued", "Requests waiting for a slot", labels=["stage"]),
        "limit": GaugeMetricFamily("aisp_llm_limit", "Generations at a time (the jitter control's)",
                                   labels=["stage"]),
    }  # fmt: skip
    slo = GaugeMetricFamily("aisp_llm_slo", "An LLM step's targets", labels=["stage", "target"])
    tokens = CounterMetricFamily("aisp_llm_tokens", "Pieces of text streamed", labels=["stage"])
    requests = CounterMetricFamily("aisp_llm_requests", "Requests by outcome", labels=["stage", "outcome"])
    probes = CounterMetricFamily("aisp_llm_probes", "Requests admitted as probes of an idle step",
                                 labels=["stage"])  # fmt: skip
    for sid, stage in stages.items():
        st = stage.stats
        for key, value in (("jitter", st.jitter), ("rate", st.tokens_per_s), ("running", stage.running),
                           ("queued", stage.queued_rows), ("limit", stage.limit)):  # fmt: skip
            gauges[key].add_metric([sid], value)
        if stage.spec.slo.ttft_ms is not None:
            slo.add_metric([sid, "ttft_seconds"], stage.spec.slo.ttft_ms / 1000)
        if stage.spec.slo.jitter is not None:
            slo.add_metric([sid, "jitter"], stage.spec.slo.jitter)
        tokens.add_metric([sid], st.tokens)
        probes.add_metric([sid], st.probes)
        for outcome, n in (("completed", st.completed), ("failed", st.failed), ("refused", st.refused)):
            requests.add_metric([sid, outcome], n)
        for why, n in sorted(st.shed.items()):
            requests.add_metric([sid, f"shed_{why}"], n)
    yield from (*gauges.values(), slo, tokens, requests, probes)


_COUNTS = ("tokens", "probes", "completed", "failed", "refused")


def llm_snapshot(stages: Mapping[str, Any]) -> dict[str, Any]:
    """What ``llm_families`` reads of each LLM step, as plain data: an observer process's
    snapshot of the run (``observe.remote``), which ``llm_views`` turns back."""
    out = {}
    for sid, stage in stages.items():
        st, slo = stage.stats, stage.spec.slo
        out[sid] = {
            "hist": {attr: getattr(st, attr).to_dict() for attr, *_ in _HISTOGRAMS},
            **{k: getattr(st, k) for k in _COUNTS},
            "shed": dict(st.shed), "jitter": st.jitter, "tokens_per_s": st.tokens_per_s,
            "running": stage.running, "queued_rows": stage.queued_rows, "limit": stage.limit,
            "slo": {"ttft_ms": slo.ttft_ms, "jitter": slo.jitter},
        }  # fmt: skip
    return out


def llm_views(data: Mapping[str, Any]) -> dict[str, Any]:
    """``llm_snapshot``'s data as objects ``llm_families`` reads like ``LlmStage``s."""
    views = {}
    for sid, d in data.items():
        hists = {attr: LatencyHistogram.from_dict(h) for attr, h in d["hist"].items()}
        stats = SimpleNamespace(**hists, **{k: d[k] for k in (*_COUNTS, "shed", "jitter", "tokens_per_s")})
        views[sid] = SimpleNamespace(
            stats=stats, running=d["running"], queued_rows=d["queued_rows"], limit=d["limit"],
            spec=SimpleNamespace(slo=SimpleNamespace(**d["slo"])),
        )  # fmt: skip
    return views


def merge_llm(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several workers' ``llm_snapshot``s as one: histograms merged, counts and generations in
    flight summed, jitter and streaming rates averaged over the workers."""
    merged: dict[str, Any] = {}
    for part in parts:
        for sid, d in part.items():
            if sid not in merged:
                merged[sid] = {**d, "hist": dict(d["hist"]), "shed": dict(d["shed"]), "_n": 1}
                continue
            into = merged[sid]
            for attr, h in d["hist"].items():
                both = LatencyHistogram.from_dict(into["hist"][attr])
                both.merge(LatencyHistogram.from_dict(h))
                into["hist"][attr] = both.to_dict()
            for k in (*_COUNTS, "running", "queued_rows", "limit"):
                into[k] += d[k]
            for why, n in d["shed"].items():
                into["shed"][why] = into["shed"].get(why, 0) + n
            into["jitter"] += d["jitter"]
            into["tokens_per_s"] += d["tokens_per_s"]
            into["_n"] += 1
    for d in merged.values():
        n = d.pop("_n")
        d["jitter"], d["tokens_per_s"] = d["jitter"] / n, d["tokens_per_s"] / n
    return merged
