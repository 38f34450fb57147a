"""What watching a run costs: workload F paced open loop, unobserved and observed, alternating.

Observed means what a user watching it does: the dashboard's event stream open, and
``/metrics`` and ``/dashboard/state`` fetched once a second (one short HTTP/1.1 connection
each, from this process). Each run reports the engine's own end-to-end percentiles; the report
gives the median p99 of each side and their ratio (the goal: observed within 1.2x).

    python benchmarks/bench_observe.py --rate 190000 --events 1000000 --repeats 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import write_events  # noqa: E402

PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"


def _get(port: int, path: str) -> float:
    """Milliseconds to fetch ``path`` (-1 when it failed)."""
    started = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", path)
        conn.getresponse().read()
        conn.close()
    except OSError:
        return -1.0
    return (time.perf_counter() - started) * 1000


def _stream(port: int, stop: threading.Event) -> None:
    """Keep the dashboard's event stream open, reading it, as the page does."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/dashboard/events")
        resp = conn.getresponse()
        while not stop.is_set() and resp.read1(65536):
            pass
        conn.close()
    except OSError:
        return


def run(data: Path, work: Path, rate: int, mode: str, port: int) -> dict[str, Any]:
    """One run: ``unobserved``, ``served`` (/metrics and the dashboard on, nobody watching)
    or ``observed``."""
    observe = mode == "observed"
    summary = work / "summary.json"
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data)]
    cmd += ["--output", str(work / "out.jsonl"), "--summary-json", str(summary), "--no-live"]
    cmd += ["--rate", str(rate)]
    if mode != "unobserved":
        cmd += ["--dashboard", "--metrics-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    fetches: dict[str, list[float]] = {"/metrics": [], "/dashboard/state": []}
    stop = threading.Event()
    if observe:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until the server is up
            if line.startswith(b"dashboard http://"):
                break
        threading.Thread(target=_stream, args=(port, stop), daemon=True).start()
        while proc.poll() is None:
            for path, took in fetches.items():
                took.append(_get(port, path))
            stop.wait(1.0)
    _, err = proc.communicate()
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"aisp run failed ({proc.returncode}): {err.decode()[-2000:]}")
    s = json.loads(summary.read_text())
    return {"events_per_s": s["events_per_s"], "latency_ms": s["latency_ms"], "fetch_ms": fetches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, required=True, help="events/s (80%% of make bench's median)")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=9477)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--served", action="store_true", help="also runs with the server on and nobody watching ('served')"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aisp-observe-"))
    data = work / "events.jsonl"
    write_events(data, args.events, seed=0)
    modes = ["unobserved", *(["served"] if args.served else []), "observed"]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for i in range(args.repeats):
        for name in runs:
            r = run(data, work, args.rate, name, args.port)
            runs[name].append(r)
            lat = r["latency_ms"]
            print(f"  run {i + 1} {name:10s} p50 {lat['p50']:7.2f} p99 {lat['p99']:7.2f} ms", file=sys.stderr)
    p99 = {name: sorted(r["latency_ms"]["p99"] for r in rs)[len(rs) // 2] for name, rs in runs.items()}
    result = {
        "rate": args.rate,
        "p99_ms": p99,
        "ratio": round(p99["observed"] / p99["unobserved"], 2) if p99["unobserved"] else None,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
