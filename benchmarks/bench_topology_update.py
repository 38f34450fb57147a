"""p99 request latency while a served pipeline's topology changes, vs steady state.

``aisp serve examples/fraud/pipeline.py`` takes workload F events over HTTP from ``--clients``
threads, each posting chunks of ``--chunk`` events in a closed loop (a request waits for its
answers). Every ``--every-s`` seconds the graph is replaced (``POST /v1/pipelines/fraud/graph``)
by the other of two versions: the example itself and a version with a filter step after the
keyed running statistics and another output step (``tests/integration/test_topology_update``);
the keyed state is carried each time. For each of ``--rounds`` updates the report gives the p99
of the requests sent in the steady second before it, the p99 of the requests that overlap the
update (sent from the update request until 0.5 s after its answer), their ratio, and the
update's own report (how long the old graph was paused). Median of the rounds.

    python benchmarks/bench_topology_update.py [--clients 4 --chunk 20 --rounds 3 --every-s 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import write_events  # noqa: E402
from tests.integration.test_topology_update import NEW_VERSION, PIPELINE  # noqa: E402
from tests.support.serving import aisp_serve, wait_http  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every-s", type=float, default=4.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="aisp-topology-"))
    data = work / "events.jsonl"
    write_events(data, 200_000, seed=1)
    lines = data.read_bytes().splitlines()
    v2 = work / "fraud_v2.py"
    v2.write_text(NEW_VERSION)
    samples: list[tuple[float, float]] = []  # (sent at, latency s)
    failures: list[str] = []
    stop = threading.Event()

    with aisp_serve(PIPELINE, http=True, grpc=False, extra_args=("--allow-model-control",)) as (addresses, _):
        wait_http(addresses["http"])
        base = f"http://{addresses['http']}"

        def client(worker: int) -> None:
            with httpx.Client(base_url=base, timeout=60) as c:
                i = worker * args.chunk
                while not stop.is_set():
                    body = b"\n".join(lines[i % len(lines) : i % len(lines) + args.chunk])
                    t0 = time.monotonic()
                    r = c.post("/v1/pipelines/fraud/events", content=body)
                    samples.append((t0, time.monotonic() - t0))
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    i += args.chunk * args.clients

        threads = [threading.Thread(target=client, args=(w,)) for w in range(args.clients)]
        for t in threads:
            t.start()
        rounds = []
        with httpx.Client(base_url=base, timeout=60) as admin:
            for r in range(args.rounds):
                time.sleep(args.every_s)
                path = str(v2) if r % 2 == 0 else str(PIPELINE)
                sent = time.monotonic()
                report = admin.post("/v1/pipelines/fraud/graph", json={"path": path}).json()
                answered = time.monotonic()
                rounds.append((sent, answered, report))
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()

    out = []
    for sent, answered, report in rounds:
        steady = [lat for t0, lat in samples if sent - 1.5 <= t0 < sent - 0.5]
        overlapping = [(t0, lat) for t0, lat in samples if sent <= t0 + lat and t0 <= answered + 0.5]
        during = [lat for _, lat in overlapping]
        slowest = sorted(overlapping, key=lambda s: -s[1])[:5]
        p99_steady = float(np.percentile(steady, 99)) * 1000
        p99_during = float(np.percentile(during, 99)) * 1000
        out.append(
            {
                "steady_requests": len(steady),
                "steady_p99_ms": round(p99_steady, 2),
                "during_requests": len(during),
                "during_p99_ms": round(p99_during, 2),
                "ratio": round(p99_during / p99_steady, 2),
                "load_ms": report.get("load_ms"),
                "paused_ms": report.get("paused_ms"),
                "update_took_ms": report.get("took_ms"),
                "carried": report.get("carried"),
                # where the slowest requests fell: (sent, ms after the update's request; took, ms)
                "slowest_during": [
                    [round((t0 - sent) * 1000, 1), round(lat * 1000, 2)] for t0, lat in slowest
                ],
            }
        )
    result = {
        "clients": args.clients,
        "chunk_events": args.chunk,
        "requests": len(samples),
        "failed_requests": len(failures),
        "rounds": out,
        "median_ratio": statistics.median(r["ratio"] for r in out),
    }
    print(json.dumps(result, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
