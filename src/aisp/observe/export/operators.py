"""Counters that operators keep of their own work, as metrics: the tokens a text tokenizer made
(``aisp_tokens_total{stage}``), what an image or audio step decoded
(``aisp_media_items_total{stage,outcome}``, ``aisp_media_bytes_total``,
``aisp_media_decode_seconds_total``, ``aisp_media_units_total{stage,unit}``: pixels or samples)
and what a response cache did (``aisp_cache_rows_total{stage,
outcome}``: hit or miss; ``aisp_cache_lookups_total``, store lookups, which the Bloom filter
spares a row it never saw; ``aisp_cache_evictions_total``; ``aisp_cache_entries``,
``aisp_cache_bytes``), and what a speech-to-text step did (``aisp_captions_total{stage,kind}``:
final or partial; ``aisp_asr_audio_seconds_total``, audio in; ``aisp_asr_model_seconds_total``,
time in the model, whose ratio to the audio is the real-time factor;
``aisp_asr_model_audio_seconds_total``, audio the model ran over, partials' again;
``aisp_asr_calls_total``; ``aisp_asr_refused_total``), and what a vector search step answered
(``aisp_retrieval_queries_total{stage}``, ``aisp_retrieval_search_seconds_total``, time spent
searching, ``aisp_retrieval_index{stage,field}``: documents, exact or a graph, its settings;
``aisp_retrieval_low_confidence_total``, queries whose
best score was under the step's threshold, ``aisp_retrieval_alerts_total``,
``aisp_retrieval_low_confidence_share``, the last window's, with its ``_target`` and
``aisp_retrieval_threshold``; histograms ``aisp_retrieval_score{stage,rank}`` of the best
score, ``rank="best"``, and of all top k, ``rank="topk"``). ``operator_counters`` reads them off a
graph (its ``map_batch`` steps' functions with a ``tokens`` count, its ``caches``, its steps'
``counters``); a run watched from another process sends them in its snapshots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aisp.observe.retrieval import SCORE_BUCKETS

__all__ = ["counter_families", "operator_counters"]


def operator_counters(graph: Any) -> dict[str, dict[str, Any]]:
    """``{"tokens": {stage: n}, "caches": {stage: stats}, "media": {stage: stats}, "speech":
    {stage: stats}, "retrieval": {stage: stats}}`` of ``graph``'s operators now."""
    tokens = {}
    for node in getattr(graph, "nodes", ()):
        made = getattr(getattr(node.spec, "fn", None), "tokens", None)
        if node.kind == "map_batch" and isinstance(made, int):
            tokens[node.step_id] = made
    caches = {sid: cache.stats() for sid, cache in getattr(graph, "caches", {}).items()}
    media: dict[str, Any] = {}
    speech: dict[str, Any] = {}
    retrieval: dict[str, Any] = {}
    for node in getattr(graph, "nodes", ()):
        stats = getattr(getattr(node.spec, "counters", None), "stats", None)
        if callable(stats):  # MediaCounters, SpeechCounters, a vector index's RetrievalCounters
            st = stats()
            kind = speech if "finals" in st else retrieval if "queries" in st else media
            kind[node.step_id] = st
    return {"tokens": tokens, "caches": caches, "media": media, "speech": speech, "retrieval": retrieval}


def counter_families(counters: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """The metric families of ``operator_counters``."""
    out: list[Any] = []
    if counters.get("tokens"):
        tokens = CounterMetricFamily("aisp_tokens", "Tokens a text tokenizer made", labels=["stage"])
        for sid, n in sorted(counters["tokens"].items()):
            tokens.add_metric([sid], n)
        out.append(tokens)
    caches = counters.get("caches") or {}
    if caches:
        rows = CounterMetricFamily(
            "aisp_cache_rows", "Rows a response cache answered or not", labels=["stage", "outcome"]
        )
        lookups = CounterMetricFamily(
            "aisp_cache_lookups", "Store lookups (rows the Bloom filter let through)", labels=["stage"]
        )
        evictions = CounterMetricFamily(
            "aisp_cache_evictions", "Answers evicted to stay under the bound", labels=["stage"]
        )
        entries = GaugeMetricFamily("aisp_cache_entries", "Answers stored", labels=["stage"])
        size = GaugeMetricFamily("aisp_cache_bytes", "Bytes of answers stored", labels=["stage"])
        for sid, st in sorted(caches.items()):
            rows.add_metric([sid, "hit"], st["hits"])
            rows.add_metric([sid, "miss"], st["misses"])
            lookups.add_metric([sid], st["lookups"])
            evictions.add_metric([sid], st["evictions"])
            entries.add_metric([sid], st["entries"])
            size.add_metric([sid], st["bytes"])
        out += [rows, lookups, evictions, entries, size]
    return (
        out
        + _media_families(counters.get("media") or {})
        + _speech_families(counters.get("speech") or {})
        + _retrieval_families(counters.get("retrieval") or {})
    )


def _media_families(media: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    if not media:
        return []
    items = CounterMetricFamily(
        "aisp_media_items", "Images or audio inputs decoded or refused", labels=["stage", "outcome"]
    )
    size = CounterMetricFamily("aisp_media_bytes", "Encoded bytes in", labels=["stage"])
    seconds = CounterMetricFamily(
        "aisp_media_decode_seconds", "Time spent decoding, summed over the decoding threads", labels=["stage"]
    )
    units = CounterMetricFamily("aisp_media_units", "Pixels or samples made", labels=["stage", "unit"])
    for sid, st in sorted(media.items()):
        items.add_metric([sid, "decoded"], st["items"])
        items.add_metric([sid, "refused"], st["refused"])
        size.add_metric([sid], st["bytes"])
        seconds.add_metric([sid], st["decode_seconds"])
        units.add_metric([sid, st["unit"]], st["units"])
    return [items, size, seconds, units]


def _speech_families(speech: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    if not speech:
        return []
    captions = CounterMetricFamily("aisp_captions", "Captions made", labels=["stage", "kind"])
    audio = CounterMetricFamily("aisp_asr_audio_seconds", "Seconds of audio in", labels=["stage"])
    model = CounterMetricFamily(
        "aisp_asr_model_seconds", "Seconds spent in the speech model", labels=["stage"]
    )
    heard = CounterMetricFamily(
        "aisp_asr_model_audio_seconds",
        "Seconds of audio the model ran over (partials again)",
        labels=["stage"],
    )
    calls = CounterMetricFamily("aisp_asr_calls", "Speech model calls", labels=["stage"])
    refused = CounterMetricFamily("aisp_asr_refused", "Rows sent to the dead letters", labels=["stage"])
    for sid, st in sorted(speech.items()):
        captions.add_metric([sid, "final"], st["finals"])
        captions.add_metric([sid, "partial"], st["partials"])
        audio.add_metric([sid], st["audio_seconds"])
        model.add_metric([sid], st["asr_seconds"])
        heard.add_metric([sid], st["asr_audio_seconds"])
        calls.add_metric([sid], st["calls"])
        refused.add_metric([sid], st["refused"])
    return [captions, audio, model, heard, calls, refused]


def _retrieval_families(retrieval: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    if not retrieval:
        return []
    queries = CounterMetricFamily(
        "aisp_retrieval_queries", "Queries a vector search answered", labels=["stage"]
    )
    low = CounterMetricFamily(
        "aisp_retrieval_low_confidence", "Queries whose best score was under the threshold", labels=["stage"]
    )
    alerts = CounterMetricFamily(
        "aisp_retrieval_alerts", "Retrieval confidence alerts raised", labels=["stage"]
    )
    share = GaugeMetricFamily(
        "aisp_retrieval_low_confidence_share",
        "The last window's share of low-confidence queries",
        labels=["stage"],
    )
    target = GaugeMetricFamily(
        "aisp_retrieval_low_confidence_share_target", "The share a window may hold", labels=["stage"]
    )
    threshold = GaugeMetricFamily(
        "aisp_retrieval_threshold", "A low-confidence query's best score is under this", labels=["stage"]
    )
    scores = HistogramMetricFamily(
        "aisp_retrieval_score", "Scores of the hits, the best and all top k", labels=["stage", "rank"]
    )
    searching = CounterMetricFamily(
        "aisp_retrieval_search_seconds", "Time spent searching the index", labels=["stage"]
    )
    index = GaugeMetricFamily(
        "aisp_retrieval_index",
        "The index: documents, exact (1: a matrix product, 0: a graph), exact_below, expansion_search, dim",
        labels=["stage", "field"],
    )
    for sid, st in sorted(retrieval.items()):
        queries.add_metric([sid], st["queries"])
        searching.add_metric([sid], st["search_seconds"])
        for name, value in sorted(st["index"].items()):
            index.add_metric([sid, name], value)
        low.add_metric([sid], st["low"])
        alerts.add_metric([sid], st["alerts"])
        if st["threshold"] is not None:
            share.add_metric([sid], st["share"])
            target.add_metric([sid], st["target_share"])
            threshold.add_metric([sid], st["threshold"])
        for rank in ("best", "topk"):
            counts = st[rank]["buckets"]
            running, buckets = 0, []
            for bound, n in zip((*(str(b) for b in SCORE_BUCKETS), "+Inf"), counts, strict=True):
                running += n
                buckets.append((bound, running))
            scores.add_metric([sid, rank], buckets, st[rank]["sum"])
    return [queries, searching, index, low, alerts, share, target, threshold, scores]
