"""Checkpoint cost and restore time on workload F.

* Throughput: ``aisp run examples/fraud/pipeline.py`` on ``--events`` events, without
  checkpoints and with ``--checkpoint-dir`` at ``--interval`` s, alternating, ``--repeats``
  times each (events/s from the run summary: executor start to the last row written).
* Restore: the newest checkpoint of the last checkpointed run (workload F has 100,000 users, so
  it holds 100k keys and their state) is read, verified and loaded into a fresh executor:
  wall time of ``CheckpointStore.latest()`` plus the executor's restore.

    python benchmarks/bench_checkpoint.py [--events 1000000 --interval 1 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from benchmarks.workload import write_events  # noqa: E402

PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def run(data: Path, out: Path, summary: Path, *extra: str) -> dict[str, object]:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data)]
    cmd += ["--output", str(out), "--no-live", "--summary-json", str(summary), *extra]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    return dict(json.loads(summary.read_text()))


def restore_seconds(chk: Path, out: Path, state_store: bool) -> tuple[float, int]:
    from aisp.cli import load_pipeline
    from aisp.connectors.file import JsonlFileSink
    from aisp.schedule.executor import LocalExecutor
    from aisp.sinks.deadletter import DeadLetterSink
    from aisp.state.checkpoint import CheckpointStore

    pipeline = load_pipeline(str(PIPELINE))
    pipeline.bind(sink=JsonlFileSink(path=str(out), columns=pipeline.output_columns))
    graph = pipeline.build()
    t0 = time.perf_counter()
    latest = CheckpointStore(chk).latest()
    assert latest is not None
    store = None
    if state_store:
        from aisp.state.store import LmdbStateStore

        store = LmdbStateStore(chk / "state")
    ex = LocalExecutor(graph, dead_letter=DeadLetterSink().open(), restore=latest, state_store=store)
    ex._build()
    ex._restore_state(latest)
    seconds = time.perf_counter() - t0
    keys = max(len(index) for index in ex._key_indexes.values())
    return seconds, keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--state-store", action="store_true", help="checkpoint keyed state into the LMDB store")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "events.jsonl"
        write_events(data, args.events, seed=0)
        plain, checked = [], []
        for i in range(args.repeats):
            s = run(data, tmp / "a.jsonl", tmp / "a.json")
            plain.append(float(s["events_per_s"]))  # type: ignore[arg-type]
            chk = tmp / f"chk{i}"
            s = run(data, tmp / "b.jsonl", tmp / "b.json", "--checkpoint-dir", str(chk),
                    "--checkpoint-interval-s", str(args.interval),
                    *(["--state-store"] if args.state_store else []))  # fmt: skip
            checked.append(float(s["events_per_s"]))  # type: ignore[arg-type]
            print(f"run {i}: plain {plain[-1]:,.0f} ev/s, checkpointed {checked[-1]:,.0f} ev/s"
                  f" ({s['checkpoints']} checkpoints)", flush=True)  # fmt: skip
        size = sum(f.stat().st_size for f in sorted(chk.glob("chk-*"))[-1].iterdir())
        seconds, keys = restore_seconds(chk, tmp / "b.jsonl", args.state_store)
    p, c = statistics.median(plain), statistics.median(checked)
    print(f"median: plain {p:,.0f} ev/s, checkpointed {c:,.0f} ev/s: {100 * (1 - c / p):.1f}% lower")
    print(f"restore: {keys:,} keys, checkpoint of {size / 1e6:.1f} MB, in {seconds:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
