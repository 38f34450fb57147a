"""Keyed state larger than the hot layer: ``--state-max-keys`` against an unbounded store.

A generated workload-F stream (no JSON) with ``--users`` distinct keys goes through key-by
and running stats into a counting sink, with checkpoints to a state store every ``--interval``
s; once with every key in memory, once with at most ``--max-keys`` per key space. Each run is a
fresh process. Reported: events/s, peak anonymous memory (RssAnon sampled every 50 ms; the
store's file pages that LMDB maps count in RSS but are the page cache's), keys evicted and read back,
keys in memory at the end; then a restore of the last checkpoint (wall time to a running
executor: the bounded one loads no state, it reads each key back when it is seen).

    python benchmarks/bench_state_bound.py [--events 4000000 --users 1000000 --max-keys 50000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

CHILD = """
import json, resource, sys, time
from aisp import Pipeline
from aisp.ingest.generator import WorkloadFSource
from aisp.runner import CheckpointOptions, RunOptions, run
from aisp.sinks import NullSink

events, users, max_keys, interval, chk, zipf = sys.argv[1:7]
p = Pipeline("state-bound")
s = p.source("src", WorkloadFSource(events=int(events), users=int(users), seed=7, zipf=float(zipf)))
s.key_by("by_user", "user").running_stats("stats", "amount").sink("out", NullSink())
t0 = time.monotonic()
checkpoints = CheckpointOptions(dir=chk, interval_s=float(interval), state_store=True,
                                state_max_keys=int(max_keys))
summary = run(p, RunOptions(checkpoints=checkpoints))
print(json.dumps({"events_per_s": summary.events_per_s, "seconds": summary.seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "state": summary.state, "checkpoints": summary.checkpoints,
                  "wall_s": time.monotonic() - t0, "restored_from": summary.restored_from}))
"""


def child(
    events: int, users: int, max_keys: int, interval: float, chk: Path, zipf: float
) -> dict[str, object]:
    """One run in a fresh process; its anonymous memory is sampled from here (a thread in the
    run would keep the state store from forking its writer process)."""
    args = [str(events), str(users), str(max_keys), str(interval), str(chk), str(zipf)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    peak_kb = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak_kb = max(
                peak_kb, next(int(x.split()[1]) for x in status.splitlines() if x.startswith("RssAnon:"))
            )
        except (OSError, StopIteration):
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the run failed:\n{err.decode()}")
    result = dict(json.loads(out.decode().strip().splitlines()[-1]))
    result["peak_anon_mb"] = round(peak_kb / 1024, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=4_000_000)
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--max-keys", type=int, default=50_000)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the users (0: uniform)")
    args = ap.parse_args()
    results = {}
    for label, bound in (("unbounded", 0), ("bounded", args.max_keys)):
        with tempfile.TemporaryDirectory() as d:
            chk = Path(d) / "chk"
            run = child(args.events, args.users, bound, args.interval, chk, args.zipf)
            # a restart: restore the final checkpoint, read nothing more (the input is done)
            restart = child(args.events, args.users, bound, args.interval, chk, args.zipf)
            run["restart_wall_s"] = round(float(restart["wall_s"]), 2)  # type: ignore[arg-type]
            run["restart_peak_anon_mb"] = restart["peak_anon_mb"]
            results[label] = run
            print(label, json.dumps(run), flush=True)
    print(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
