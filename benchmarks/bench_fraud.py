"""`make bench`: workload F through (a) the naive loop, (b) the hand loop, (c) `aisp run`, and the
validating loop (the hand loop with the input's validity rules) beside them.

Every contender runs in its own process, one after another (never two at once), on the same
JSONL file, ``--repeats`` times, alternating; the report gives the median events/s (by each
contender's own clock), the median wall-clock of the whole command (start-up included), its p99
latency and the peak RSS of the whole process tree (the engine's worker processes included),
then the ratios c/a and c/b by throughput and by wall-clock (c/b is the one judged: the hand
loop is the strongest a user writes for a clean file; ``ratio_c_v`` against the validating loop,
which checks every line as the engine does). ``--workers 1,2`` runs the engine
with each number of worker processes (``aisp-w2``: ``--workers 2``), for the scaling. Each
engine run's output is checked against the hand loop's (ids, users, alerts, n and
mean_amount equal, scores within 1e-5; several workers' lines in the order of their ids).
A last run paces the engine open loop at 80% of its measured maximum and reports the end-to-end
latency percentiles under that load.

    python benchmarks/bench_fraud.py --events 1000000 --repeats 3 [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.baselines import compare_outputs  # noqa: E402
from benchmarks.workload import write_events  # noqa: E402

MODEL = ROOT / "examples" / "fraud" / "model.onnx"
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"


def run_tree(cmd: list[str]) -> tuple[str, float, float]:
    """Run ``cmd``; return its stdout, the peak RSS (MB) of its process tree (sampled at 20 Hz)
    and the wall-clock seconds from start to exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {err[-2000:]}")
    return out, peak / 2**20, wall


def baseline(name: str, data: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "baselines.py"), name, "--input", str(data)]
    stdout, rss, wall = run_tree([*cmd, "--output", str(out), "--model", str(MODEL)])
    res = json.loads(stdout.strip().splitlines()[-1])
    return {
        "events_per_s": res["events_per_s"],
        "wall_s": round(wall, 3),
        "p99_ms": res["p99_ms"],
        "rss_mb": rss,
    }


def engine(data: Path, out: Path, rate: float = 0.0, workers: int = 1) -> dict[str, Any]:
    summary = out.with_suffix(".summary.json")
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data), "--output", str(out)]
    cmd += ["--summary-json", str(summary), "--no-live", "--rate", str(rate), "--workers", str(workers)]
    _, rss, wall = run_tree(cmd)
    s = json.loads(summary.read_text())
    return {
        "events_per_s": s["events_per_s"],
        "wall_s": round(wall, 3),
        "p99_ms": s["latency_ms"]["p99"],
        "latency_ms": s["latency_ms"],
        "rss_mb": rss,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with the median wall-clock over all runs."""
    best = sorted(runs, key=lambda r: r["events_per_s"])[len(runs) // 2]
    walls = sorted(r["wall_s"] for r in runs)
    return {
        **best,
        "wall_s": walls[len(walls) // 2],
        "all_events_per_s": [r["events_per_s"] for r in runs],
        "all_wall_s": [r["wall_s"] for r in runs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-naive", action="store_true", help="skip (a); it takes ~1 min per 1M events")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--workers",
        default="1,2",
        help="`aisp run --workers N` for each N (comma-separated); the first is 'aisp'",
    )
    args = ap.parse_args()
    workers = [int(x) for x in args.workers.split(",")]
    engines = {"aisp" if i == 0 else f"aisp-w{n}": n for i, n in enumerate(workers)}

    work = Path(tempfile.mkdtemp(prefix="aisp-bench-"))
    data = work / "events.jsonl"
    write_events(data, args.events, seed=0)
    order = ([] if args.skip_naive else ["naive"]) + ["hand", "validating", *engines]
    outs = {name: work / f"{name}.jsonl" for name in order}
    results: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in order}
    for i in range(args.repeats):
        for name in order:
            if name in engines:
                r = engine(data, outs[name], workers=engines[name])
            else:
                r = baseline(name, data, outs[name])
            runs[name].append(r)
            print(
                f"  run {i + 1} {name:10s} {r['events_per_s']:>12,.0f} ev/s  wall {r['wall_s']:7.2f} s"
                f"  p99 {r['p99_ms']:8.2f} ms  rss {r['rss_mb']:6.0f} MB",
                file=sys.stderr,
            )
    for name in order:
        results[name] = median_of(runs[name])
    c = results["aisp"]
    for base, key in (("hand", "c_b"), ("validating", "c_v"), ("naive", "c_a")):
        if base in results:
            results[f"ratio_{key}"] = round(c["events_per_s"] / results[base]["events_per_s"], 2)
            results[f"ratio_{key}_wall"] = round(results[base]["wall_s"] / c["wall_s"], 2)
    for name, n in engines.items():
        if name != "aisp":
            results[f"ratio_{name}_b"] = round(
                results[name]["events_per_s"] / results["hand"]["events_per_s"], 2
            )
            results[f"ratio_{name}_b_wall"] = round(results["hand"]["wall_s"] / results[name]["wall_s"], 2)
        problems = compare_outputs(outs["hand"], outs[name], score_tol=1e-5, any_order=n > 1)
        results["outputs_equal"] = results.get("outputs_equal", True) and not problems
        if problems:
            print(
                f"{name}'s output differs from the hand loop's:",
                *problems[:5],
                sep="\n  ",
                file=sys.stderr,
            )
    rate = round(0.8 * c["events_per_s"])
    results["paced_80pct"] = {"rate": rate, **engine(data, outs["aisp"], rate=rate)}
    results["machine"] = {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "events": args.events,
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if results["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
