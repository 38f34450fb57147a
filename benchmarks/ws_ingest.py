"""Workload-F events streamed into `aisp serve examples/fraud/pipeline.py` over its WebSocket, checked
against `aisp run` on the same file: every result once, in order, equal (scores within 1e-5).

    python benchmarks/ws_ingest.py [--events 1000000] [--message-events 1000]

Prints one JSON line: events, results, seconds, events_per_s (client side, from the first message
sent to the server's close), close code, mismatches. Exits 1 unless every result matches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.workload import write_events  # noqa: E402

PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
FIELDS = ("user", "alert", "n", "mean_amount")


def stream(
    address: str, lines: list[bytes], per_message: int
) -> tuple[list[dict[str, object]], float, int | None]:
    from websockets.sync.client import connect

    got: list[str] = []
    started = time.perf_counter()
    # binary frames (no UTF-8 check of the events at either end), no compression (the server
    # declines permessage-deflate: zlib costs more than the pipeline's work on a message)
    with connect(f"ws://{address}/v1/pipelines/fraud/ws", max_size=None, compression=None) as ws:
        reader = threading.Thread(target=lambda: got.extend(str(m) for m in ws))
        reader.start()
        for i in range(0, len(lines), per_message):
            ws.send(b"\n".join(lines[i : i + per_message]))
        ws.send(b"")
        reader.join()
        code = ws.close_code
    seconds = time.perf_counter() - started  # the results are parsed after the clock stops
    return [orjson.loads(x) for x in "".join(got).splitlines()], seconds, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--message-events", type=int, default=1000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aisp-ws-"))
    data, reference = tmp / "events.jsonl", tmp / "reference.jsonl"
    write_events(data, args.events, seed=0)
    run = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data), "--no-live"]
    subprocess.run([*run, "--output", str(reference)], env=ENV, check=True, capture_output=True)
    serve = [
        sys.executable,
        "-m",
        "aisp.cli",
        "serve",
        str(PIPELINE),
        "--http-port",
        "0",
        "--grpc-port",
        "-1",
    ]
    proc = subprocess.Popen(serve, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[1]
        time.sleep(1.0)
        rows, seconds, code = stream(address, data.read_bytes().splitlines(), args.message_events)
    finally:
        proc.terminate()
        proc.wait(60)
    expected = sorted((json.loads(x) for x in reference.read_bytes().splitlines()), key=lambda r: r["id"])
    same_ids = [r["id"] for r in rows] == [e["id"] for e in expected]
    mismatches = sum(
        tuple(r[f] for f in FIELDS) != tuple(e[f] for f in FIELDS) or abs(r["score"] - e["score"]) > 1e-5  # type: ignore[operator]
        for r, e in zip(rows, expected, strict=False)
    )
    report = {
        "events": args.events,
        "results": len(rows),
        "seconds": round(seconds, 2),
        "events_per_s": round(args.events / seconds),
        "close": code,
        "in_order_once": same_ids,
        "mismatches": mismatches,
    }
    print(json.dumps(report))
    return 0 if same_ids and not mismatches and code == 1000 else 1


if __name__ == "__main__":
    sys.exit(main())
