"""Query latency of the search example (embed + search) at 80% of its capacity.

The stream: ``--documents`` documents upserted, then ``--queries`` queries (``examples/search``:
standard-library docstrings, MiniLM int8 embeddings, the vector index with HNSW). First the
stream runs unpaced, which gives the capacity (rows/s); then paced (open loop: each row due at
its time, latency counted from then, so a stall is not hidden) at ``--load`` of it. Only the
query rows reach the sink (upserts are consumed by the index), so the end-to-end percentiles
are the queries': from when a query is due to when its top 10 are written. Median of
``--rounds`` paced runs.

    python benchmarks/bench_search_latency.py [--documents 1000 --queries 1500 --load 0.8 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import load_search_example  # noqa: E402


def run_once(documents: int, queries: int, rate: float) -> dict[str, Any]:
    from aisp import ExecutorOptions, NullSink

    p = load_search_example().build(documents=documents, queries=queries)
    p.bind(sink=NullSink())
    summary = p.run(execution=ExecutorOptions(rate_events_per_s=rate))
    return {
        "events_per_s": summary.events_per_s,
        "queries": summary.events_out,
        "latency_ms": summary.latency_ms,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=1500)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    capacity = run_once(args.documents, args.queries, 0.0)["events_per_s"]
    rate = capacity * args.load
    paced = [run_once(args.documents, args.queries, rate) for _ in range(args.rounds)]
    p50 = statistics.median(r["latency_ms"]["p50"] for r in paced)
    p99 = statistics.median(r["latency_ms"]["p99"] for r in paced)
    print(json.dumps({
        "documents": args.documents, "queries": args.queries, "capacity_rows_per_s": round(capacity, 1),
        "paced_rows_per_s": round(rate, 1),
        "runs": [{"p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"], "queries": r["queries"]}
                 for r in paced],
        "median_p50_ms": p50, "median_p99_ms": p99,
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
