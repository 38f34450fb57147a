"""Quantized tier variants that cost more than the model they stand in for, for
``aisp.observe.diagnose.pipeline``.

``Stream.infer_by_tier`` binds tiers to model variants (``{step}.tier<N>``, ``{step}.default``),
typically a cheaper INT8 or FP16 copy for the low tiers. Quantization pays on large models and
CPUs with int8 dot products (VNNI, AMX) or GPUs with FP16; on a small model the work of
quantizing activations can outweigh the cheaper arithmetic, and the variant is slower than its
FP32 sibling (the fraud model's INT8 variant is, on a 2-vCPU EPYC VM: BENCHMARKS.md).

Two steps' calls are compared by the CPU time they took (``aisp_model_cpu_seconds_total``:
the model's own work, without the waits for the GIL or a core that swamp a small model's wall
time in a busy process), at the batch sizes they ran at, with what holds whatever the cost's
fixed and per-row parts are: the variant is slower when its calls take at least as long with no
more rows each, or its rows cost at least as much in batches at least as large.
A variant slower than the model it stands in for loses twice (quantization never adds
accuracy), so it is a defect whatever the latency: ranked with the failures (0.5 plus its share
of the model steps' time). Accuracy itself is not judged here: that needs labels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["QUANTIZATION_CAUSES", "QUANTIZED", "ModelPoint", "slower_variants", "suggestion"]

QUANTIZATION_CAUSES = ("quantization_tradeoff",)
QUANTIZED = frozenset({"int8", "int4", "fp16"})
_TIER_STEP = re.compile(r"^(?P<group>.+)\.(?:tier-?\d+|default)$")


@dataclass(frozen=True)
class ModelPoint:
    """A model step over the window: its precision, mean rows and CPU seconds per call, calls."""

    stage: str
    precision: str
    rows: float
    call_s: float
    calls: float


def slower_variants(points: list[ModelPoint]) -> list[tuple[ModelPoint, ModelPoint, dict[str, Any]]]:
    """(quantized variant, its full-precision sibling, evidence) for each variant slower than a
    sibling of the same ``infer_by_tier`` step."""
    groups: dict[str, list[ModelPoint]] = {}
    for p in points:
        m = _TIER_STEP.match(p.stage)
        if m is not None and p.calls > 0 and p.rows > 0:
            groups.setdefault(m.group("group"), []).append(p)
    out = []
    for members in groups.values():
        full = [p for p in members if p.precision == "fp32"]
        for q in (p for p in members if p.precision in QUANTIZED):
            for f in full:
                per_row_q, per_row_f = q.call_s / q.rows, f.call_s / f.rows
                slower = (q.rows <= f.rows and q.call_s >= f.call_s) or (
                    q.rows >= f.rows and per_row_q >= per_row_f
                )
                if slower:
                    ev = {
                        "variant": q.stage, "variant_precision": q.precision, "sibling": f.stage,
                        "variant_call_cpu_ms": round(q.call_s * 1000, 3),
                        "sibling_call_cpu_ms": round(f.call_s * 1000, 3),
                        "variant_rows_per_call": round(q.rows, 1), "sibling_rows_per_call": round(f.rows, 1),
                        "variant_cpu_us_per_row": round(per_row_q * 1e6, 2),
                        "sibling_cpu_us_per_row": round(per_row_f * 1e6, 2),
                    }  # fmt: skip
                    out.append((q, f, ev))
                    break
    return out


def suggestion(q: ModelPoint, f: ModelPoint) -> str:
    return (
        f"the {q.precision.upper()} variant in step {q.stage!r} is slower than the FP32 model of "
        f"{f.stage!r} ({round(q.call_s * 1e6 / q.rows, 2)} vs {round(f.call_s * 1e6 / f.rows, 2)} us of CPU "
        "a row, "
        f"{q.rows:.0f} vs {f.rows:.0f} rows a call): quantization does not pay for this model on this "
        "hardware; bind its tiers to the FP32 model, or quantize statically (QDQ with calibration) "
        "for a CPU with int8 dot products (VNNI, AMX) or run FP16 on a GPU"
    )
