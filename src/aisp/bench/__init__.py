"""``aisp bench``: open- and closed-loop load against a pipeline, rate sweeps to the highest
rate meeting an SLO, and their reports (JSON, PNG, HTML)."""

from aisp.bench.load import LoadSpec, PointResult, run_point, workload_lines
from aisp.bench.report import Sweep, plot_html, plot_png, sweep, write_report
from aisp.bench.targets import make_target

__all__ = [
    "LoadSpec",
    "PointResult",
    "Sweep",
    "make_target",
    "plot_html",
    "plot_png",
    "run_point",
    "sweep",
    "workload_lines",
    "write_report",
]
