"""Diagnosis of a pipeline's LLM steps (``aisp.infer.llm.stage``), from their metrics
(``aisp.observe.export.llm``), for ``aisp.observe.diagnose.pipeline``.

An LLM step's time to first token is its queueing (waiting for a free generation slot) plus the
server's time to a first token; then the generation streams. When requests wait longer for a
slot than the server takes to start answering, the endpoints are at capacity
(``llm_queueing``: more endpoints or slots, admission by a TTFT target, a lower offered rate);
otherwise generation itself is slow (``llm_slow_generation``: a faster or smaller model,
shorter prompts and answers; more endpoints raise throughput, not this latency). The score is
the share of the events' end-to-end time spent in the step.
"""

from __future__ import annotations

from typing import Any

from aisp.observe.export.scrape import _Window

__all__ = ["LLM_CAUSES", "llm_findings"]

LLM_CAUSES = ("llm_queueing", "llm_slow_generation")


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def llm_findings(
    w: _Window, steps: list[str], base: dict[str, Any]
) -> list[tuple[str, str, float, dict[str, Any], str]]:
    """(cause, step, score, evidence, suggestion) for each LLM step that generated in the window."""
    out = []
    e2e_mean_s = base.get("e2e_mean_ms", 0.0) / 1000
    for name in steps:
        ttft = w.hist("aisp_llm_ttft_seconds", stage=name)
        if not ttft.count:
            continue
        queue = w.hist("aisp_llm_queue_seconds", stage=name)
        first = w.hist("aisp_llm_first_token_seconds", stage=name)
        generation = w.hist("aisp_llm_generation_seconds", stage=name)
        gaps = w.hist("aisp_llm_inter_token_seconds", stage=name)
        outcomes = {
            dict(k)["outcome"]: w.delta("aisp_llm_requests_total", **dict(k))
            for k in w.after.series("aisp_llm_requests_total")
            if dict(k)["stage"] == name
        }
        turned_away = sum(n for o, n in outcomes.items() if o == "refused" or o.startswith("shed_"))
        limit = int(w.gauge("aisp_llm_limit", stage=name))
        ev: dict[str, Any] = {
            "ttft_p99_ms": _ms(ttft.quantile(0.99)), "ttft_mean_ms": _ms(ttft.mean),
            "queue_mean_ms": _ms(queue.mean), "first_token_mean_ms": _ms(first.mean),
            "generation_mean_ms": _ms(generation.mean), "inter_token_p50_ms": _ms(gaps.quantile(0.5)),
            "inter_token_p99_ms": _ms(gaps.quantile(0.99)),
            "jitter": round(w.gauge("aisp_llm_jitter", stage=name), 3),
            "tokens_per_s": round(w.gauge("aisp_llm_tokens_per_second", stage=name), 1),
            "running": int(w.gauge("aisp_llm_running", stage=name)), "limit": limit,
            "queued": int(w.gauge("aisp_llm_queued", stage=name)),
            **{f"requests_{o}": int(n) for o, n in sorted(outcomes.items()) if n},
            **base,
        }  # fmt: skip
        spent = queue.mean + generation.mean
        score = min(1.0, spent / e2e_mean_s) if e2e_mean_s > 0 else 1.0
        if turned_away:
            score = max(score, 1.0)  # requests turned away: the step is the limit
        if queue.mean >= first.mean and queue.mean >= 0.1 * generation.mean:
            out.append((
                "llm_queueing", name, score, ev,
                f"requests of LLM step {name!r} wait {_ms(queue.mean)} ms for one of its {limit} generation"
                f" slots before a {_ms(first.mean)} ms first token: its endpoints are at capacity; add"
                " endpoints or slots (concurrency), set LlmSlo(ttft_ms=...) so admission refuses what"
                " would wait too long, or lower the offered rate",
            ))  # fmt: skip
        else:
            out.append((
                "llm_slow_generation", name, score, ev,
                f"generation in LLM step {name!r} is slow: a first token {_ms(first.mean)} ms after the"
                f" request, {_ms(gaps.quantile(0.5))} ms between tokens, {_ms(generation.mean)} ms per"
                " answer: use a faster or smaller model or server, shorter prompts or max_tokens;"
                " more endpoints raise throughput, not this latency",
            ))  # fmt: skip
    return out
