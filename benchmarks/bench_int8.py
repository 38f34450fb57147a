"""INT8 vs FP32 fraud model: speed (ONNX Runtime alone, batch 512) and accuracy on workload F.

Accuracy compares the two models on the same events scored by the engine (`aisp` Python API,
fraud example with ``model=``): max and mean absolute score difference, and alert agreement
(``score > 0.9``). Speed: ORT rows/s at batch 512, one intra-op thread, median of 5 runs.

    python benchmarks/bench_int8.py [--events 200000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import load_fraud_example, write_events  # noqa: E402

FP32 = ROOT / "examples" / "fraud" / "model.onnx"
INT8 = ROOT / "examples" / "fraud" / "model.int8.onnx"


def engine_scores(data: Path, model: Path, out: Path) -> tuple[dict[int, float], float]:
    from aisp import JsonlFileSink, JsonlFileSource, run

    module = load_fraud_example()
    p = module.build(model=model)
    p.bind(source=JsonlFileSource(path=str(data), schema=module.Event), sink=JsonlFileSink(path=str(out)))
    summary = run(p)
    scores = {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        scores[row["id"]] = row["score"]
    return scores, summary.events_per_s


def ort_rows_per_s(model: Path, x: np.ndarray) -> float:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    batches = [x[i : i + 512] for i in range(0, len(x) - 511, 512)]
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for b in batches:
            sess.run(None, {"features": b})
        runs.append(len(batches) * 512 / (time.perf_counter() - t0))
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aisp-int8-"))
    data = work / "events.jsonl"
    write_events(data, args.events, seed=0)
    fp32, fp32_rate = engine_scores(data, FP32, work / "fp32.jsonl")
    int8, int8_rate = engine_scores(data, INT8, work / "int8.jsonl")
    ids = sorted(fp32)
    a = np.array([fp32[i] for i in ids])
    b = np.array([int8[i] for i in ids])
    rng = np.random.default_rng(0)
    x = np.column_stack(
        [rng.normal(size=(65536, 16)), rng.integers(1, 20, 65536), rng.lognormal(3, 1, 65536)]
    )
    x = x.astype(np.float32)
    result = {
        "events": len(ids),
        "max_abs_score_diff": float(np.abs(a - b).max()),
        "mean_abs_score_diff": float(np.abs(a - b).mean()),
        "alert_agreement": float(np.mean((a > 0.9) == (b > 0.9))),
        "alerts_fp32": int((a > 0.9).sum()),
        "alerts_int8": int((b > 0.9).sum()),
        "ort_rows_per_s_fp32": round(ort_rows_per_s(FP32, x)),
        "ort_rows_per_s_int8": round(ort_rows_per_s(INT8, x)),
        "pipeline_events_per_s_fp32": fp32_rate,
        "pipeline_events_per_s_int8": int8_rate,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
