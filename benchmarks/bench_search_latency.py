"""Query latency of the search example (embed + search) at 80% of its capacity.

The stream: ``--documents`` documents upserted, then ``--queries`` queries (``examples/search``:
standard-library docstrings, MiniLM int8 embeddings, the vector index with HNSW). First the
stream runs unpaced: its throughput, with the model's batches as large as they come when the
whole input waits. Rows that arrive one by one (open loop: each row due at its time, latency
counted from then, so a stall is not hidden) form smaller batches, which this encoder runs
less efficiently (the texts of a batch are padded to their lengths' groups); so the capacity is
what the pipeline achieves paced at that unpaced throughput (more than it can take: it runs
flat out with the batches paced arrivals give). Then paced runs at ``--loads`` of that
capacity. Only the
query rows reach the sink (upserts are consumed by the index), so the end-to-end percentiles
are the queries': from when a query is due to when its top 10 are written. Median of
``--rounds`` paced runs at each of ``--loads``. The embedding cache is off (``--cache none``):
every query is embedded, as a stream of new questions would be (the example's queries repeat
documents' texts, which the cache would answer without the model).

    python benchmarks/bench_search_latency.py [--documents 1000 --queries 1500 --loads 0.8 --rounds 3]
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


def run_once(documents: int, queries: int, rate: float, cache: str) -> dict[str, Any]:
    from aisp import ExecutorOptions, NullSink

    p = load_search_example().build(documents=documents, queries=queries, cache=cache)
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
    ap.add_argument("--loads", default="0.5,0.8,0.9", help="fractions of the capacity, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--cache", default="none", help="the example's embedding cache: none, local or redis://..."
    )
    args = ap.parse_args()
    unpaced = run_once(args.documents, args.queries, 0.0, args.cache)["events_per_s"]
    capacity = run_once(args.documents, args.queries, unpaced, args.cache)["events_per_s"]
    out: dict[str, Any] = {"documents": args.documents, "queries": args.queries, "cache": args.cache,
                           "unpaced_rows_per_s": round(unpaced, 1), "capacity_rows_per_s": round(capacity, 1),
                           "loads": []}  # fmt: skip
    for load in (float(x) for x in args.loads.split(",")):
        rate = capacity * load
        paced = [run_once(args.documents, args.queries, rate, args.cache) for _ in range(args.rounds)]
        out["loads"].append({
            "load": load, "paced_rows_per_s": round(rate, 1),
            "runs": [{"p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"],
                      "queries": r["queries"]} for r in paced],
            "median_p50_ms": statistics.median(r["latency_ms"]["p50"] for r in paced),
            "median_p99_ms": statistics.median(r["latency_ms"]["p99"] for r in paced),
        })  # fmt: skip
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
