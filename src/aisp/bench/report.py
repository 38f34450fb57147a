"""Rate sweeps (the highest rate that meets the SLO) and their reports: JSON, and latency
percentiles against the offered rate as a PNG (matplotlib, the ``plot`` extra) or a
self-contained HTML page (inline SVG, no script)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aisp.bench.load import LoadSpec, PointResult, Target, run_point
from aisp.errors import ConfigError

__all__ = ["Sweep", "plot_html", "plot_png", "sweep", "write_report"]

PERCENTILES = ("p50", "p90", "p99", "p999")


class Sweep:
    """The points measured, in the order run, and the best rate meeting the SLO."""

    def __init__(self, target: str, spec: LoadSpec) -> None:
        self.target, self.spec = target, spec
        self.points: list[PointResult] = []

    @property
    def best(self) -> PointResult | None:
        good = [p for p in self.points if p.meets_slo()]
        return max(good, key=lambda p: p.offered_rate or p.achieved_rate) if good else None

    def as_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "target": self.target,
            "mode": self.spec.mode,
            "slo_ms": self.spec.slo_ms,
            "events_per_request": self.spec.events_per_request,
            "duration_s": self.spec.duration_s,
            "points": [p.as_dict() for p in sorted(self.points, key=lambda p: p.offered_rate)],
            "best_rate": best.offered_rate if best is not None else None,
        }


def sweep(
    target: Target | str,
    name: str,
    spec: LoadSpec,
    *,
    rates: list[float] | None = None,
    refine: int = 3,
    max_rate: float = 2_000_000,
    lines: list[bytes] | None = None,
    on_point: Callable[[PointResult], None] | None = None,
) -> Sweep:
    """Run ``spec`` at each of ``rates``; without ``rates``, from ``spec.rate`` doubling until
    a point misses the SLO, then ``refine`` bisections between the last good and first bad."""
    result = Sweep(name, spec)

    def point(rate: float) -> PointResult:
        p = run_point(target, replace(spec, rate=rate), lines=lines)
        result.points.append(p)
        if on_point is not None:
            on_point(p)
        return p

    if rates:
        for rate in rates:
            point(rate)
        return result
    if spec.rate <= 0:
        raise ConfigError("an automatic sweep starts from --rate (open loop)")
    good, bad = 0.0, 0.0
    rate = spec.rate
    while rate <= max_rate:
        if point(rate).meets_slo():
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    for _ in range(refine if good and bad else 0):
        mid = round((good + bad) / 2, -1) or (good + bad) / 2
        if mid in (good, bad):
            break
        if point(mid).meets_slo():
            good = mid
        else:
            bad = mid
    return result


def write_report(result: Sweep, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.as_dict(), indent=2) + "\n")


def _series(result: Sweep) -> tuple[list[float], dict[str, list[float]]]:
    points = sorted(result.points, key=lambda p: p.offered_rate or p.achieved_rate)
    xs = [p.offered_rate or p.achieved_rate for p in points]
    return xs, {q: [max(p.latency_ms[q], 1e-3) for p in points] for q in PERCENTILES}


def plot_png(result: Sweep, path: str | Path) -> None:
    """Latency percentiles (log scale) against the offered rate, with the SLO as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("a PNG plot needs matplotlib: pip install 'aisp[plot]' (or write .html)") from exc
    xs, ys = _series(result)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for q, values in ys.items():
        ax.plot(xs, values, marker="o", label=q)
    ax.axhline(result.spec.slo_ms, color="red", linestyle="--", label=f"SLO {result.spec.slo_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (events/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"aisp bench: {result.target}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)


_COLORS = {"p50": "#1f77b4", "p90": "#2ca02c", "p99": "#ff7f0e", "p999": "#9467bd"}


def _table(result: Sweep) -> tuple[str, str]:
    """The HTML rows and header of the points' table."""
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(c))}</td>"
            for c in (
                f"{p.offered_rate:,.0f}",
                f"{p.achieved_rate:,.0f}",
                *(p.latency_ms[q] for q in (*PERCENTILES, "max")),
                f"{100 * p.slo_attainment:.2f}%",
                sum(p.errors.values()),
                "yes" if p.meets_slo() else "no",
            )
        )
        + "</tr>"
        for p in sorted(result.points, key=lambda p: p.offered_rate)
    )
    head = "".join(
        f"<th>{c}</th>"
        for c in (
            "offered/s",
            "achieved/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "within SLO",
            "errors",
            "meets SLO",
        )
    )
    return rows, head


def plot_html(result: Sweep, path: str | Path) -> None:
    """The same chart as ``plot_png`` as an HTML page with an inline SVG, and the points' table."""
    xs, ys = _series(result)
    w, h, pad = 760, 420, 60
    slo = result.spec.slo_ms
    lo = math.log10(min([*(v for vals in ys.values() for v in vals), slo]) / 1.5)
    hi = math.log10(max([*(v for vals in ys.values() for v in vals), slo]) * 1.5)
    x_hi = max(xs) * 1.05 if xs else 1.0

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * x / x_hi

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * (math.log10(y) - lo) / max(hi - lo, 1e-9)

    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"'
    parts = [svg + ' font-family="sans-serif" font-size="12">']
    parts.append(
        f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#999"/>'
    )
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if lo <= math.log10(v) <= hi:
                y = py(v)
                parts.append(f'<line x1="{pad}" x2="{w - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
                parts.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    parts += [f'<text x="{px(x):.1f}" y="{h - pad + 16}" text-anchor="middle">{x:,.0f}</text>' for x in xs]
    y = py(slo)
    parts.append(
        f'<line x1="{pad}" x2="{w - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="red" stroke-dasharray="6 4"/>'
    )
    parts.append(f'<text x="{w - pad}" y="{y - 4:.1f}" text-anchor="end" fill="red">SLO {slo:g} ms</text>')
    for i, (q, values) in enumerate(ys.items()):
        pts = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, values, strict=True))
        parts.append(
            f'<polyline class="{q}" points="{pts}" fill="none" stroke="{_COLORS[q]}" stroke-width="2"/>'
        )
        parts += [
            f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3" fill="{_COLORS[q]}"/>'
            for x, v in zip(xs, values, strict=True)
        ]
        parts.append(f'<text x="{pad + 10 + 70 * i}" y="{pad - 10}" fill="{_COLORS[q]}">{q}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">offered rate (events/s)</text>')
    turn = f'transform="rotate(-90 14 {h / 2})"'
    parts.append(f'<text x="14" y="{h / 2}" {turn} text-anchor="middle">latency (ms, log)</text>')
    parts.append("</svg>")
    rows, head = _table(result)
    best = result.best
    verdict = (
        f"highest rate meeting the SLO: {best.offered_rate:,.0f} events/s" if best else "no rate met the SLO"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>aisp bench</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
        f"<h1>aisp bench</h1><p>{html.escape(result.target)} ({result.spec.mode} loop, "
        f"{result.spec.events_per_request} events per request, {result.spec.duration_s:g} s per point); "
        f"{html.escape(verdict)}</p>{''.join(parts)}<table><tr>{head}</tr>{rows}</table></body></html>\n"
    )
    Path(path).write_text(page)
