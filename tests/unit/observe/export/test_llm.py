"""An LLM step's measurements cross to an observer process (``aisp run --metrics-port``) intact:
a snapshot renders the same families as the step itself, and workers' snapshots merge."""

from __future__ import annotations

import json

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from aisp.infer.llm.admission import LlmSlo
from aisp.infer.llm.client import OpenAIClient
from aisp.infer.llm.stage import LlmSpec, LlmStage
from aisp.observe.export.llm import llm_families, llm_snapshot, llm_views, merge_llm


def _stage(seed: int) -> LlmStage:
    spec = LlmSpec(client=OpenAIClient("http://127.0.0.1:9"), slo=LlmSlo(ttft_ms=500, jitter=0.5))
    s = LlmStage(spec, emit=lambda b: None, emit_made=lambda b: None, dead_letter=lambda b, r: None)
    rng = np.random.default_rng(seed)
    for attr in ("ttft", "first_token", "queue", "inter_token", "generation"):
        getattr(s.stats, attr).record((rng.exponential(0.05, 200) * 1e9).astype(np.int64))
    s.stats.tokens, s.stats.completed, s.stats.failed = 900 + seed, 10, seed
    s.stats.shed_one("ttft_slo")
    s.stats.recent_jitter.extend([0.1 + seed, 0.3])
    s.stats.recent_rates.extend([40.0, 60.0 + seed])
    return s


def _text(stages: dict[str, object]) -> str:
    registry = CollectorRegistry()

    class _C:
        def collect(self) -> object:
            return llm_families(stages)

    registry.register(_C())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_a_snapshot_renders_what_the_step_does() -> None:
    stages = {"llm": _stage(0)}
    data = json.loads(json.dumps(llm_snapshot(stages)))  # as it crosses the pipe: plain data
    assert _text(llm_views(data)) == _text(stages)


def test_workers_snapshots_merge() -> None:
    a, b = _stage(1), _stage(2)
    merged = llm_views(merge_llm([llm_snapshot({"llm": a}), llm_snapshot({"llm": b})]))["llm"]
    assert merged.stats.tokens == a.stats.tokens + b.stats.tokens
    assert merged.stats.failed == 3 and merged.stats.shed == {"ttft_slo": 2}
    assert merged.stats.ttft.count == a.stats.ttft.count + b.stats.ttft.count
    assert merged.stats.jitter == (a.stats.jitter + b.stats.jitter) / 2
    assert merged.spec.slo.ttft_ms == 500
