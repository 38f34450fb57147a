"""Tracing cost on workload F: throughput without tracing, and with 1% of the events traced
(OpenTelemetry spans exported over OTLP/HTTP to a receiver in another process).

``aisp run examples/fraud/pipeline.py`` on ``--events`` generated events, as fast as it goes,
alternating: no tracing; ``--trace-sample 0.01`` with the default cap (100 new traces/s) and
with 50/s;
``--trace-sample 0.01 --trace-max-per-s 0`` (every 1%, uncapped). ``--repeats`` times each;
medians of events/s from the run summaries.

    python benchmarks/bench_tracing.py [--events 2000000 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

# a receiver that reads each export and answers 200 with an empty response (another process,
# so its work is not charged to the pipeline)
RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(events: int, summary: Path, *extra: str) -> float:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--events", str(events)]
    cmd += ["--output", "null:", "--no-live", "--summary-json", str(summary), *extra]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    return float(json.loads(summary.read_text())["events_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    variants = {
        "off": (),
        "1%, cap 100/s": ("--trace-sample", "0.01", "--trace-endpoint", endpoint),
        "1%, cap 50/s": ("--trace-sample", "0.01", "--trace-max-per-s", "50", "--trace-endpoint", endpoint),
        "1%, no cap": ("--trace-sample", "0.01", "--trace-max-per-s", "0", "--trace-endpoint", endpoint),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                for name, extra in variants.items():
                    rates[name].append(run(args.events, Path(tmp) / "s.json", *extra))
                    print(f"{name}: {rates[name][-1]:,.0f} events/s", flush=True)
    finally:
        receiver.terminate()
        receiver.wait()
    base = statistics.median(rates["off"])
    print(f"\n{args.events:,} events, {args.repeats} runs each, median events/s:")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"  {name:>14}: {med:>9,.0f}  ({100 * (base - med) / base:+.1f}% cost)  runs {values}")


if __name__ == "__main__":
    main()
