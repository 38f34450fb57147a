"""Diagnosis rules on recorded /metrics text (the planted scenarios run for real in
tests/integration/test_diagnose.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from aisp.cli import app
from aisp.observe.diagnose.pipeline import Scrape, _Hist, diagnose, metrics_url

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)


def _hist(name: str, labels: str, values: list[float]) -> list[str]:
    sep = "," if labels else ""
    lines = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {sum(v <= b for v in values)}' for b in BOUNDS]
    lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {len(values)}')
    lines.append(f"{name}_count{{{labels}}} {len(values)}")
    lines.append(f"{name}_sum{{{labels}}} {sum(values)}")
    return lines


def metrics_text(
    uptime: float,
    stages: dict[str, dict[str, Any]],
    *,
    e2e: list[float],
    events_in: int,
    extra: tuple[str, ...] = (),
) -> str:
    """An exposition like PipelineCollector's; each stage: kind, thread, busy/cpu seconds,
    budget, per-phase values (seconds per batch), rows per batch."""
    out = ["# TYPE aisp_uptime_seconds gauge", f"aisp_uptime_seconds {uptime}"]
    out += ["# TYPE aisp_stage_info gauge"]
    out += [
        f'aisp_stage_info{{stage="{n}",kind="{s["kind"]}",thread="{s.get("thread", n)}"}} 1'
        for n, s in stages.items()
    ]
    for family in ("busy", "cpu"):
        out.append(f"# TYPE aisp_stage_{family}_seconds counter")
        out += [
            f'aisp_stage_{family}_seconds_total{{stage="{n}"}} {s.get(family, 0.0)}'
            for n, s in stages.items()
        ]
    out.append("# TYPE aisp_stage_latency_budget_seconds gauge")
    out += [
        f'aisp_stage_latency_budget_seconds{{stage="{n}"}} {s.get("budget", 0.001)}'
        for n, s in stages.items()
    ]
    out.append("# TYPE aisp_stage_latency_seconds histogram")
    for n, s in stages.items():
        for phase in ("queue", "batch", "serialize", "compute"):
            out += _hist("aisp_stage_latency_seconds", f'stage="{n}",phase="{phase}"', s.get(phase, []))
    out.append("# TYPE aisp_batch_size_rows histogram")
    for n, s in stages.items():
        rows = s.get("rows", [])
        out += [
            f'aisp_batch_size_rows_count{{stage="{n}"}} {len(rows)}',
            f'aisp_batch_size_rows_sum{{stage="{n}"}} {sum(rows)}',
        ]
    out.append("# TYPE aisp_e2e_latency_seconds histogram")
    out += _hist("aisp_e2e_latency_seconds", "", e2e)
    out += ["# TYPE aisp_events counter", f'aisp_events_total{{direction="in"}} {events_in}']
    out += [
        "# TYPE aisp_slo_attainment_ratio gauge",
        'aisp_slo_attainment_ratio{stage="pipeline",target_seconds="0.05"} 1.0',
    ]
    out += list(extra)
    return "\n".join(out) + "\n"


CALM = {
    "events": {"kind": "source", "busy": 0.2, "cpu": 0.18, "serialize": [0.001] * 10, "rows": [512] * 10},
    "score": {
        "kind": "infer",
        "busy": 0.5,
        "compute": [0.002] * 100,
        "batch": [0.001] * 100,
        "rows": [50] * 100,
        "budget": 0.01,
    },
    "out": {
        "kind": "sink",
        "thread": "score",
        "busy": 0.1,
        "cpu": 0.09,
        "serialize": [0.0005] * 100,
        "rows": [50] * 100,
    },
}


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    h = _Hist([(0.01, 50.0), (0.02, 100.0), (float("inf"), 100.0)], 100.0, 1.2)
    assert h.quantile(0.5) == pytest.approx(0.01)
    assert h.quantile(0.75) == pytest.approx(0.015)
    assert h.mean == pytest.approx(0.012)


def test_a_calm_pipeline_is_healthy() -> None:
    scrape = Scrape(metrics_text(10.0, CALM, e2e=[0.004] * 1000, events_in=5000))
    findings = diagnose(None, scrape)
    assert findings[0].cause == "healthy"
    assert findings[0].evidence["slo_target_ms"] == 50.0


def test_refusals_at_a_served_pipeline_rank_first_as_admission_overload() -> None:
    def at(uptime: float, accepted: int, full: int) -> Scrape:
        extra = (
            "# TYPE aisp_admission_events counter",
            f'aisp_admission_events_total{{outcome="accepted"}} {accepted}',
            f'aisp_admission_events_total{{outcome="queue_full"}} {full}',
            'aisp_admission_events_total{outcome="rate_limited"} 0',
        )
        return Scrape(metrics_text(uptime, CALM, e2e=[0.004] * accepted, events_in=accepted, extra=extra))

    findings = diagnose(at(10.0, 1000, 0), at(12.0, 3000, 1000))
    assert findings[0].cause == "admission_overload"
    assert findings[0].stage == "admission"
    assert findings[0].evidence["refused_share"] == pytest.approx(1000 / 3000, abs=1e-3)
    assert findings[0].evidence["window_s"] == 2.0


def test_failing_model_calls_are_a_finding() -> None:
    extra = (
        "# TYPE aisp_model_rows counter",
        'aisp_model_rows_total{stage="score",outcome="scored"} 900',
        'aisp_model_rows_total{stage="score",outcome="error"} 100',
        'aisp_model_rows_total{stage="score",outcome="timeout"} 0',
        'aisp_model_rows_total{stage="score",outcome="shed"} 0',
    )
    scrape = Scrape(metrics_text(10.0, CALM, e2e=[0.004] * 900, events_in=1000, extra=extra))
    causes = [f.cause for f in diagnose(None, scrape)]
    assert "model_errors" in causes
    assert causes[0] != "healthy"


def test_a_sink_waiting_on_its_store_is_told_from_one_burning_cpu() -> None:
    stages = {
        **CALM,
        "out": {
            "kind": "sink",
            "thread": "score",
            "busy": 9.0,
            "cpu": 0.2,
            "serialize": [0.02] * 450,
            "rows": [50] * 450,
        },
    }
    waiting = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.04] * 1000, events_in=5000)))
    assert (waiting[0].cause, waiting[0].stage) == ("slow_sink", "out")
    stages["out"] = {**stages["out"], "cpu": 8.5}
    burning = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.04] * 1000, events_in=5000)))
    assert (burning[0].cause, burning[0].stage) == ("serialization", "out")


def test_metrics_url_takes_a_base_or_the_metrics_address() -> None:
    assert metrics_url("http://127.0.0.1:9464") == "http://127.0.0.1:9464/metrics"
    assert metrics_url("http://127.0.0.1:9464/metrics/") == "http://127.0.0.1:9464/metrics"


def test_cli_diagnoses_two_recorded_snapshots(tmp_path: Path) -> None:
    before, after = tmp_path / "a.txt", tmp_path / "b.txt"
    before.write_text(metrics_text(10.0, CALM, e2e=[0.004] * 100, events_in=500))
    # in the next 10 s the model's calls take 90 ms: counters go on from the first snapshot
    score = CALM["score"]
    slow = {
        **CALM,
        "score": {
            **score,
            "busy": 9.5,
            "compute": score["compute"] + [0.09] * 100,
            "batch": score["batch"] + [0.05] * 100,
            "rows": score["rows"] + [50] * 100,
        },
    }
    after.write_text(metrics_text(20.0, slow, e2e=[0.004] * 100 + [0.2] * 100, events_in=1000))
    result = CliRunner().invoke(
        app, ["diagnose", "--snapshot", str(before), "--snapshot", str(after), "--json"]
    )
    assert result.exit_code == 0, result.output
    findings = json.loads(result.output)
    assert (findings[0]["cause"], findings[0]["stage"]) == ("slow_model", "score")
    assert findings[0]["evidence"]["window_s"] == 10.0
    assert findings[0]["evidence"]["compute_mean_ms"] == 90.0
    assert findings[0]["evidence"]["over_budget"] is True


def test_cli_wants_one_source_of_metrics() -> None:
    result = CliRunner().invoke(app, ["diagnose", "--json"])
    assert result.exit_code != 0


def test_a_model_servers_429s_are_admission_overload_by_model() -> None:
    def at(ok: int, refused: int) -> Scrape:
        return Scrape(
            "# TYPE aisp_requests counter\n"
            f'aisp_requests_total{{protocol="http",model="fraud",code="200"}} {ok}\n'
            f'aisp_requests_total{{protocol="http",model="fraud",code="429"}} {refused}\n'
            f'aisp_requests_total{{protocol="grpc",model="other",code="OK"}} {ok}\n'
        )

    findings = diagnose(at(100, 0), at(1100, 500), seconds=2.0)
    assert (findings[0].cause, findings[0].stage) == ("admission_overload", "fraud")
    assert findings[0].evidence["refused"] == 500
    assert all(f.stage != "other" for f in findings)


def test_an_image_step_busy_decoding_is_decode_bound() -> None:
    stages = {
        **CALM,
        "prepare": {"kind": "stateful", "busy": 9.5, "cpu": 9.0, "compute": [0.19] * 500, "rows": [16] * 500,
                    "budget": 0.05},
    }  # fmt: skip
    media = (
        "# TYPE aisp_media_decode_seconds counter",
        'aisp_media_decode_seconds_total{stage="prepare"} 17.6',
        "# TYPE aisp_media_bytes counter",
        'aisp_media_bytes_total{stage="prepare"} 800000000',
        "# TYPE aisp_media_units counter",
        'aisp_media_units_total{stage="prepare",unit="pixels"} 1638400000',
    )
    top = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.3] * 1000, events_in=8000, extra=media)))[0]
    assert (top.cause, top.stage) == ("decode_bound", "prepare")
    assert top.evidence["mb_in_per_s"] == 80.0 and top.evidence["decode_threads_busy"] == 1.76
    plain = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.3] * 1000, events_in=8000)))[0]
    assert plain.cause == "slow_operator"


def test_a_speech_step_busy_in_its_model_is_asr_bound() -> None:
    stages = {
        **CALM,
        "asr": {"kind": "stateful", "busy": 9.0, "cpu": 8.5, "compute": [0.3] * 300, "rows": [16] * 300,
                "budget": 0.05},
    }  # fmt: skip
    speech = (
        "# TYPE aisp_asr_model_seconds counter",
        'aisp_asr_model_seconds_total{stage="asr"} 8.2',
        "# TYPE aisp_asr_audio_seconds counter",
        'aisp_asr_audio_seconds_total{stage="asr"} 160',
        "# TYPE aisp_asr_model_audio_seconds counter",
        'aisp_asr_model_audio_seconds_total{stage="asr"} 480',
    )
    top = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.3] * 1000, events_in=8000, extra=speech)))[
        0
    ]
    assert (top.cause, top.stage) == ("asr_bound", "asr")
    assert top.evidence["audio_s_per_s"] == 16.0 and top.evidence["model_audio_per_audio"] == 3.0
    assert "partial" in top.suggestion
    plain = diagnose(None, Scrape(metrics_text(10.0, stages, e2e=[0.3] * 1000, events_in=8000)))[0]
    assert plain.cause == "slow_operator"


def _retrieval_extra(queries: int, low: int, *, threshold: bool = True) -> tuple[str, ...]:
    """The vector index's families as ``counter_families`` writes them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from aisp.observe.export.operators import counter_families
    from aisp.observe.retrieval import RetrievalCounters

    counters = RetrievalCounters()
    best = np.r_[np.full(queries - low, 0.9), np.full(low, 0.1)]
    counters.add(best, best, low)
    if threshold:
        counters.threshold, counters.target_share = 0.5, 0.2
    registry = CollectorRegistry()

    class _Collector:
        def collect(self) -> Any:
            return counter_families({"retrieval": {"index": counters.stats()}})

    registry.register(_Collector())  # type: ignore[arg-type]
    return tuple(generate_latest(registry).decode().splitlines())


@pytest.mark.parametrize("low", [0, 100, 150, 400, 900])
def test_queries_under_the_retrieval_threshold_past_the_target_share_rank_first(low: int) -> None:
    extra = _retrieval_extra(1000, low)
    findings = diagnose(
        None, Scrape(metrics_text(10.0, CALM, e2e=[0.004] * 1000, events_in=1000, extra=extra))
    )
    if low <= 200:  # within the target share (0.2)
        assert findings[0].cause == "healthy"
        assert "retrieval_confidence" not in [f.cause for f in findings]
        return
    top = findings[0]
    assert (top.cause, top.stage) == ("retrieval_confidence", "index")
    assert top.evidence["low_share"] == pytest.approx(low / 1000)
    assert top.evidence["threshold"] == 0.5
    assert "embedding model" in top.suggestion


def test_a_vector_index_without_a_confidence_target_is_never_judged() -> None:
    extra = _retrieval_extra(1000, 900, threshold=False)
    findings = diagnose(
        None, Scrape(metrics_text(10.0, CALM, e2e=[0.004] * 1000, events_in=1000, extra=extra))
    )
    assert findings[0].cause == "healthy"


@pytest.mark.parametrize(
    ("live_s", "tail", "expected"),
    [
        (3.0, True, "cold_start"),
        (600.0, True, "slow_model"),
        (3.0, False, "slow_model"),
        (None, True, "slow_model"),
    ],
)
def test_a_models_slow_calls_just_after_it_began_serving_are_its_cold_start(
    live_s: float | None, tail: bool, expected: str
) -> None:
    """(``None``: an exporter without ``aisp_model_live_seconds``: the version's age is unknown.)"""
    compute = [0.001] * 90 + ([0.09] * 10 if tail else [0.001] * 10)
    stages = {**CALM, "score": {**CALM["score"], "busy": 0.9, "compute": compute, "budget": 0.005}}
    extra: tuple[str, ...] = ()
    if live_s is not None:
        extra = ("# TYPE aisp_model_live_seconds gauge", f'aisp_model_live_seconds{{stage="score"}} {live_s}')
    findings = diagnose(
        None, Scrape(metrics_text(10.0, stages, e2e=[0.06] * 1000, events_in=5000, extra=extra))
    )
    top = findings[0]
    assert (top.cause, top.stage) == (expected, "score"), [(f.cause, f.stage, f.score) for f in findings]
    if expected == "cold_start":
        assert top.evidence["live_s"] == live_s and "input_specs" in top.suggestion


def test_failing_model_calls_rank_above_every_latency_cause() -> None:
    extra = (
        "# TYPE aisp_model_rows counter",
        'aisp_model_rows_total{stage="score",outcome="scored"} 950',
        'aisp_model_rows_total{stage="score",outcome="error"} 50',
    )
    stages = {**CALM, "score": {**CALM["score"], "busy": 0.95, "compute": [0.04] * 100}}
    findings = diagnose(
        None, Scrape(metrics_text(10.0, stages, e2e=[0.06] * 1000, events_in=1000, extra=extra))
    )
    assert findings[0].cause == "model_errors", [(f.cause, f.score) for f in findings]
    assert findings[1].cause == "slow_model"


@pytest.mark.parametrize(("int8_cpu", "expected"), [(0.30, "quantization_tradeoff"), (0.15, "healthy")])
def test_a_quantized_tier_variant_costing_more_cpu_than_its_fp32_sibling_is_a_defect(
    int8_cpu: float, expected: str
) -> None:
    """Both variants made 10,000 calls of 20 rows: the INT8 one's 30 us of CPU a call against the
    FP32 one's 20 is a defect even in a healthy pipeline; at 15 us it is what quantization is for."""
    model = {"kind": "infer", "busy": 0.2, "compute": [0.0003] * 100, "rows": [20] * 100, "budget": 0.01}
    stages = {"events": CALM["events"], "score.tier0": model, "score.default": model, "out": CALM["out"]}
    extra = [
        "# TYPE aisp_model_info gauge",
        'aisp_model_info{stage="score.tier0",model="m8",version="1",provider="cpu",precision="int8"} 1',
        'aisp_model_info{stage="score.default",model="m",version="1",provider="cpu",precision="fp32"} 1',
        "# TYPE aisp_model_calls counter", "# TYPE aisp_model_cpu_seconds counter",
        "# TYPE aisp_model_rows counter",
    ]  # fmt: skip
    for stage, cpu in (("score.tier0", int8_cpu), ("score.default", 0.2)):
        extra += [
            f'aisp_model_calls_total{{stage="{stage}"}} 10000',
            f'aisp_model_cpu_seconds_total{{stage="{stage}"}} {cpu}',
            f'aisp_model_rows_total{{stage="{stage}",outcome="scored"}} 200000',
        ]
    findings = diagnose(
        None, Scrape(metrics_text(10.0, stages, e2e=[0.004] * 1000, events_in=1000, extra=tuple(extra)))
    )
    assert findings[0].cause == expected, [(f.cause, f.stage, f.score) for f in findings]
    if expected != "healthy":
        assert findings[0].stage == "score.tier0"
        assert findings[0].evidence["variant_cpu_us_per_row"] == 1.5 and "FP32" in findings[0].suggestion
