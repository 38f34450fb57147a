"""Diagnosis of a pipeline's vector search steps (``aisp.transform.text.vectors``) from their
metrics (``aisp_retrieval_*``, ``aisp.observe.retrieval``), for
``aisp.observe.diagnose.pipeline``.

A step whose queries' best scores fall under its threshold more often than its target share in
the window (``retrieval_confidence``) answers with passages that do not match the questions:
fast, and wrong. That is a failure of the answers, so it ranks with failing model calls (a
score of 0.5 plus the share), above the latency causes of a pipeline that meets its budget.
"""

from __future__ import annotations

from typing import Any

from aisp.observe.export.scrape import _Window

__all__ = ["RETRIEVAL_CAUSES", "retrieval_findings"]

RETRIEVAL_CAUSES = ("retrieval_confidence",)


def retrieval_findings(w: _Window, base: dict[str, Any]) -> list[tuple[str, str, float, dict[str, Any], str]]:
    """(cause, step, score, evidence, suggestion) for each vector search step with a confidence
    target whose queries in the window were low-confidence more often than it allows."""
    out = []
    for key in w.after.series("aisp_retrieval_threshold"):
        stage = dict(key)["stage"]
        queries = w.delta("aisp_retrieval_queries_total", stage=stage)
        if not queries:
            continue
        low = w.delta("aisp_retrieval_low_confidence_total", stage=stage)
        share = low / queries
        target = w.gauge("aisp_retrieval_low_confidence_share_target", stage=stage)
        threshold = w.gauge("aisp_retrieval_threshold", stage=stage)
        if share <= target:
            continue
        best = w.hist("aisp_retrieval_score", stage=stage, rank="best")
        ev = {
            "queries": int(queries),
            "low_confidence": int(low),
            "low_share": round(share, 3),
            "target_share": target,
            "threshold": threshold,
            "best_score_p50": round(best.quantile(0.5), 3),
            "alerts": int(w.delta("aisp_retrieval_alerts_total", stage=stage)),
            **base,
        }
        out.append((
            "retrieval_confidence", stage, 0.5 + share, ev,
            f"{100 * share:.1f}% of the queries of step {stage!r} found no document scoring "
            f"{threshold} or more (target: at most {100 * target:.0f}%; median best score "
            f"{ev['best_score_p50']}): the questions moved away from the index; add the documents "
            "they ask about, check that queries and documents use the same embedding model, or "
            "route low-confidence queries to a fallback answer",
        ))  # fmt: skip
    return out
