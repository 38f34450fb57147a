"""p99 during a model hot swap vs steady state, on workload F paced open loop.

The fraud example runs from a copy of its model repository (`--model-repository`), paced at
``--rate`` events/s. After ``--swap-at-s`` seconds a version 2 directory is renamed into the
repository; the repository poller loads it, warms it up and switches between batches. The
end-to-end latency histogram is snapshotted every 250 ms; the report gives the p99 of the
steady windows (after a 1 s warm-up, outside the swap window) and of the windows from the swap
request until 1.25 s after it, and their ratio.

    python benchmarks/bench_hot_swap.py [--events 600000 --rate 60000 --swap-at-s 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import load_fraud_example, write_events  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=600_000)
    ap.add_argument("--rate", type=float, default=60_000)
    ap.add_argument("--swap-at-s", type=float, default=4.0)
    args = ap.parse_args()

    from aisp import ExecutorOptions, JsonlFileSink, JsonlFileSource, ObserveOptions, RunOptions, run
    from aisp.observe.latency import LatencyHistogram

    work = Path(tempfile.mkdtemp(prefix="aisp-swap-"))
    repo = work / "repo"
    shutil.copytree(ROOT / "examples" / "fraud" / "repository", repo)
    data = work / "events.jsonl"
    write_events(data, args.events, seed=0)
    module = load_fraud_example()
    p = module.build(model_repository=repo)
    p.bind(
        source=JsonlFileSource(path=str(data), schema=module.Event),
        sink=JsonlFileSink(path=str(work / "o.jsonl")),
    )

    windows: list[tuple[float, LatencyHistogram, str]] = []
    state = {"t0": None, "last": None, "swapped": False}

    def progress(ex: object) -> None:
        now = time.monotonic()
        stats = ex.stats  # type: ignore[attr-defined]
        if state["t0"] is None:
            state["t0"], state["last"] = now, stats.e2e.snapshot()
            return
        t = now - state["t0"]
        if not state["swapped"] and t >= args.swap_at_s:
            staged = repo / "fraud" / ".v2"
            staged.mkdir()
            shutil.copy(repo / "fraud" / "1" / "model.onnx", staged / "model.onnx")
            staged.rename(repo / "fraud" / "2")
            state["swapped"] = True
            state["swap_t"] = t
        snap = stats.e2e.snapshot()
        version = next(iter(ex.batchers.values())).runtime.version  # type: ignore[attr-defined]
        windows.append((t, snap.since(state["last"]), version))
        state["last"] = snap

    options = RunOptions(
        execution=ExecutorOptions(rate_events_per_s=args.rate),
        observe=ObserveOptions(on_progress=progress),
        repository_poll_s=0.1,
    )
    summary = run(p, options)
    swap_t = state["swap_t"]
    steady = LatencyHistogram()
    during = LatencyHistogram()
    for t, h, _ in windows[:-1]:  # the last window is the drain
        if swap_t <= t <= swap_t + 1.25:
            during.merge(h)
        elif t >= 1.0:
            steady.merge(h)
    switched = next((t for t, _, v in windows if v == "2"), None)
    result = {
        "rate": args.rate,
        "events": summary.events_out,
        "dead_letters": summary.dead_letters,
        "swaps": summary.models["score"]["swaps"],
        "swap_requested_at_s": round(swap_t, 2),
        "version_2_serving_by_s": switched and round(switched, 2),
        "steady_p99_ms": round(steady.percentile(99) / 1e6, 3),
        "swap_p99_ms": round(during.percentile(99) / 1e6, 3),
        "ratio": round(during.percentile(99) / max(steady.percentile(99), 1), 2),
        "overall": summary.latency_ms,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
