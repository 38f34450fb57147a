"""Adaptive batching vs the best fixed setting of a grid search, at the same p99 target.

One producer thread offers requests of ``--rows`` rows open loop at ``--rate`` rows/s (built
ahead, so the batcher and the model are what is measured) to a ``DynamicBatcher`` running an MLP made here
(18 -> 512 -> 512 -> 1, random weights: batching pays). Each row's latency runs from its
scheduled arrival to the moment its batch's results are emitted. For every fixed setting
(max batch size x max queue delay, 0 = eager) the run lasts ``--seconds``; the best fixed
setting is the highest delivered throughput with p99 <= ``--p99-ms``. The adaptive batcher
then runs from its default start for ``--adaptive-seconds``; throughput and p99 are measured
over its last ``--seconds``.

    python benchmarks/bench_adaptive.py [--rate 40000 --p99-ms 20 --seconds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(ROOT))
from aisp.batch import Batch  # noqa: E402
from aisp.infer import AdaptiveConfig, BatcherConfig, DynamicBatcher, OnnxRuntime  # noqa: E402
from benchmarks.workload import mlp_model  # noqa: E402


def offer(
    cfg: BatcherConfig, model: Path, rate: float, seconds: float, measure_s: float, per_req: int
) -> tuple[float, float, dict[str, object]]:
    """Run one batcher for ``seconds``; (rows/s, p99 ms) over the last ``measure_s``, its setting."""
    rt = OnnxRuntime(model, name="mlp")
    rng = np.random.default_rng(0)
    reqs = [
        Batch.from_columns({"x": rng.normal(size=(per_req, 18)).astype(np.float32)}, ingest_ns=0)
        for _ in range(64)
    ]
    done: list[tuple[int, np.ndarray]] = []
    lock = threading.Lock()

    def emit(b: Batch) -> None:
        now = time.monotonic_ns()
        with lock:
            done.append((now, b.numpy("_ingest_ns")))

    batcher = DynamicBatcher(
        rt,
        cfg,
        prepare=lambda b: {"features": b.numpy("x")},
        finish=lambda b, o, r: b,
        emit=emit,
        dead_letter=lambda b, r: None,
    )
    batcher.start()
    period = 1e9 * per_req / rate
    start = time.monotonic_ns()
    end = start + int(seconds * 1e9)
    k = 0
    while (due := start + int(k * period)) < end:
        now = time.monotonic_ns()
        if due > now:
            time.sleep((due - now) / 1e9)
        batcher.submit(reqs[k % 64].with_columns({"_ingest_ns": np.full(per_req, due, dtype=np.int64)}))
        k += 1
    batcher.close()
    cutoff = end - int(measure_s * 1e9)
    window = [(t, ing) for t, ing in done if cutoff <= t <= end]  # not the drain after the end
    lat = np.concatenate([t - ing for t, ing in window]) if window else np.zeros(1)
    n = sum(len(ing) for _, ing in window)
    return n / measure_s, float(np.percentile(lat, 99) / 1e6), batcher.batching()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=40_000)
    ap.add_argument("--rows", type=int, default=16, help="rows per request")
    ap.add_argument("--p99-ms", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--adaptive-seconds", type=float, default=20.0)
    args = ap.parse_args()
    import tempfile

    model = mlp_model(Path(tempfile.mkdtemp(prefix="aisp-adaptive-")) / "mlp.onnx", width=512)
    sizes, delays = (8, 32, 128, 512), (0.0, 1.0, 4.0)
    grid = []
    for size in sizes:
        for delay in delays:
            cfg = BatcherConfig(
                max_batch_size=size, max_queue_delay_ms=delay, eager=delay == 0, capacity_rows=1 << 20
            )
            rps, p99, _ = offer(cfg, model, args.rate, args.seconds, args.seconds - 1.0, args.rows)
            grid.append(
                {
                    "max_batch_size": size,
                    "max_queue_delay_ms": delay,
                    "rows_per_s": round(rps),
                    "p99_ms": round(p99, 2),
                }
            )
            print(
                f"  fixed {size:4d} rows, {delay:3.1f} ms: {rps:9,.0f} rows/s  p99 {p99:8.2f} ms",
                file=sys.stderr,
            )
    meeting = [g for g in grid if g["p99_ms"] <= args.p99_ms]
    best = max(meeting, key=lambda g: g["rows_per_s"]) if meeting else None
    adaptive = AdaptiveConfig(p99_target_ms=args.p99_ms, batch_sizes=sizes, delays_ms=delays, trial_s=0.5)
    cfg = BatcherConfig(max_batch_size=512, capacity_rows=1 << 20, adaptive=adaptive)
    rps, p99, state = offer(cfg, model, args.rate, args.adaptive_seconds, args.seconds - 1.0, args.rows)
    setting = f"{state['max_batch_size']}, {state['max_queue_delay_ms']} ms"
    print(f"  adaptive: {rps:9,.0f} rows/s  p99 {p99:8.2f} ms  setting {setting}", file=sys.stderr)
    result = {
        "offered_rows_per_s": args.rate,
        "rows_per_request": args.rows,
        "p99_target_ms": args.p99_ms,
        "best_fixed": best,
        "adaptive": {"rows_per_s": round(rps), "p99_ms": round(p99, 2), "state": state},
        "ratio_adaptive_to_best_fixed": round(rps / best["rows_per_s"], 2) if best else None,
        "grid": grid,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
